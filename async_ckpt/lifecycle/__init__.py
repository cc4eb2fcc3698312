"""The lifecycle of steps: which are committed, in flight or being deleted, and in what order."""

from .catalog import StepCatalog

__all__ = ["StepCatalog"]
