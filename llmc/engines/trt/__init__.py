"""The TensorRT backend. Building: `lower` (attention subgraphs to llmc's plugin op), `plugin` (the op: numpy
reference, ONNX Runtime stand-in, TensorRT plugin over an ahead-of-time Triton kernel), `profiles` (optimization
profiles from the build limits), `build` (the plans). Running: `run` (the engine over device KV memory)."""
