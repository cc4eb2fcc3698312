"""Storage: step layout and commit protocol, manifests, and DCP-format I/O over fsspec."""

from .commit import StepTarget
from .fs import Storage
from .layout import CheckpointLayout
from .manifest import FileRecord, Manifest
from .retry import RetryPolicy

__all__ = ["CheckpointLayout", "FileRecord", "Manifest", "RetryPolicy", "StepTarget", "Storage"]
