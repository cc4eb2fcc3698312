"""Storage: step layout and commit protocol, manifests, and DCP-format I/O over fsspec."""

from .commit import StepTarget
from .layout import CheckpointLayout
from .manifest import FileRecord, Manifest
from .retry import RetryPolicy
from .storage import Storage

__all__ = ["CheckpointLayout", "FileRecord", "Manifest", "RetryPolicy", "StepTarget", "Storage"]
