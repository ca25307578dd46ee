"""glmquant: build and prove 2-bit EXL3 checkpoints of huge GLM mixture-of-experts models."""

__version__ = "0.1.0"
