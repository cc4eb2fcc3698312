"""Storage: the bytes and paths of one root (step directories, commit protocol, lease, retries)."""

from .commit import StepTarget
from .layout import CheckpointLayout
from .retry import RetryPolicy
from .storage import Storage

__all__ = ["CheckpointLayout", "RetryPolicy", "StepTarget", "Storage"]
