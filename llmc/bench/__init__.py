"""Benchmarks: engines (llmc bench ENGINE_DIR) and servers (llmc bench --serve URL)."""
