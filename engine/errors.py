"""Exceptions raised by the engine."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """A model directory is missing a file, or a file does not hold what it should."""


class UnsupportedModelError(ModelLoadError):
    """The model directory describes an architecture or option this engine cannot run."""


class RequestError(EngineError, ValueError):
    """A request cannot be accepted: bad parameters, too long, or a duplicate id."""
