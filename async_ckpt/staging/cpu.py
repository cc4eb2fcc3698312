"""CPU -> CPU: every (destination, source) pair in one fused call."""

from __future__ import annotations

from typing import Sequence

import torch

from ..compat import foreach_copy_


def copy_cpu(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """One ``_foreach_copy_``; ATen parallelises large copies over the intra-op threads."""
    if dsts:
        foreach_copy_(list(dsts), list(srcs))
