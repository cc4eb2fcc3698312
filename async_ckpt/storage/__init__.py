"""Storage: step layout and commit protocol, manifests, and DCP-format I/O over fsspec."""

from .fs import Storage
from .layout import CheckpointLayout, StepTarget
from .manifest import FileRecord, Manifest
from .retry import RetryPolicy

__all__ = ["CheckpointLayout", "FileRecord", "Manifest", "RetryPolicy", "StepTarget", "Storage"]
