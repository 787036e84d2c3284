"""Sluice: an overload-protecting gateway for LLM inference."""

__version__ = "0.1.0"
