"""Staging: state dict -> host snapshot (the only part of a save that blocks training)."""

from .plan import StagingPlan, make_plan
from .pool import HostBufferPool, Lease
from .stager import HostSnapshot, Stager

__all__ = ["HostBufferPool", "HostSnapshot", "Lease", "Stager", "StagingPlan", "make_plan"]
