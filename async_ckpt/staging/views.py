"""Host views of pooled buffers, kept on the buffers and reused from one save to the next.

Creating thousands of tensor views costs more than copying their bytes, and a training loop
saves the same layout every time, so a pooled buffer remembers the views last made of it.
"""

from __future__ import annotations

from typing import Any, List, cast

import torch


def whole_view(buf: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``buf`` (a flat uint8 buffer of ``t``'s size) viewed as ``t``'s dtype and shape; the
    view is kept on the buffer and reused while the next save has the same dtype and shape."""
    cached = getattr(buf, "_async_ckpt_view", None)
    if cached is not None and cached.dtype == t.dtype and cached.shape == t.shape:
        return cached
    view = cast(Any, buf)._async_ckpt_view = buf.view(t.dtype).view(t.shape)  # an attribute of our own on the buffer
    return view


def slab_views(slab: torch.Tensor, sig: Any, offsets: List[int], ts: List[torch.Tensor]) -> List[torch.Tensor]:
    """Views of ``slab`` at ``offsets`` shaped like ``ts``. The slab remembers them under
    ``sig`` (the layout's signature) and the next save with an equal signature reuses them."""
    cached = getattr(slab, "_async_ckpt_views", None)
    if cached is not None and (cached[0] is sig or cached[0] == sig):
        return cached[1]
    views = [slab[off: off + t.nbytes].view(t.dtype).view(t.shape) for off, t in zip(offsets, ts)]
    cast(Any, slab)._async_ckpt_views = (sig, views)  # an attribute of our own on the slab
    return views
