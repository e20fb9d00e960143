"""The decoder written directly as ONNX: used by export (portable graphs) and by backends that rebuild them."""
