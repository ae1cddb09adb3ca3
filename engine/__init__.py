"""Ebb's engine: a headless library (no Qt) around llama.cpp. See engine.cli for the CLI."""

__all__ = ["__version__"]
__version__ = "0.1.0"
