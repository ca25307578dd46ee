"""Checkpoint I/O: lazy safetensors reading, layouts, shard writing, index, manifest, verifier."""
