"""The ONNX Runtime CPU backend. Building: `config` (what `llmc build` is asked for, `auto` resolved), `graphs`
(the export's decoder rebuilt for ONNX Runtime), `quality` (layer precisions chosen by measurement), `build` (the
engine folder). Running: `run` (the engine over the export's graphs, concat KV) and `inplace` (one bound KV buffer
written in place)."""
