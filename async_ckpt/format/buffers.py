"""Where a buffer's bytes are: the address of a contiguous buffer, without torch.

The writer thread and the writer process (which imports no torch) both use it to find where a
large tensor's data went in a record stream.
"""

from __future__ import annotations

from typing import Any


def address_of(b: Any) -> int:
    """The address of the first byte of a contiguous buffer (a memoryview, bytes, an array),
    or -1 where it cannot be had (without NumPy, which async_ckpt does not require).

    Args:
        b: any object with the buffer protocol.

    Returns:
        The address, or -1.
    """
    try:
        import numpy as np
    except ImportError:
        return -1
    try:
        return int(np.frombuffer(b, dtype=np.uint8).ctypes.data)
    except (TypeError, ValueError):
        return -1
