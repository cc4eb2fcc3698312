"""Storage: the bytes and paths of one root (step directories, commit protocol, lease, retries)."""

from .commit import StepTarget
from .retry import RetryPolicy
from .step_dirs import StepDirectories
from .storage import Storage

__all__ = ["StepDirectories", "RetryPolicy", "StepTarget", "Storage"]
