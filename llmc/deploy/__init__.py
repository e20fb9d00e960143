"""Deployment: `llmc package` (Docker, Triton, KServe, Ray Serve artifacts) and the Ray Serve scale-out app."""
