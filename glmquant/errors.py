"""Typed errors. Every failure names the bad input (file, tensor, option) so the CLI can print one clear line."""

from __future__ import annotations


class GlmquantError(Exception):
    """Base of all expected failures; the CLI prints the message (and exits 1 or 2) instead of a traceback."""

    exit_code = 1


class UsageError(GlmquantError):
    """Bad options or unreadable input given by the user."""

    exit_code = 2


class ConfigError(UsageError):
    """A config.json that is missing, malformed or describes an unsupported architecture."""


class TensorCensusError(GlmquantError):
    """A checkpoint's tensor names do not match what its config says (unknown or missing names)."""

    def __init__(self, message: str, unknown: list[str], missing: list[str]) -> None:
        super().__init__(message)
        self.unknown = unknown
        self.missing = missing


class CheckpointFormatError(GlmquantError):
    """A safetensors file or index that is corrupt, truncated or inconsistent."""


class MissingDependencyError(GlmquantError):
    """A feature needs an optional package that is not installed (a gap of this installation, not of the input)."""


class NumericalError(GlmquantError):
    """NaN/Inf weights or activations, or a linear-algebra failure that no fallback could absorb."""
