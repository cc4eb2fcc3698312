"""CRC-32C of a concatenation from the CRC-32Cs of its parts.

``crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)``: the parts of a file can be
read and checksummed in any order, on any thread, and the file's CRC put together afterwards.
The method is zlib's ``crc32_combine`` (multiplication by ``x^(8 * len2)`` modulo the CRC
polynomial in GF(2)), with the Castagnoli polynomial.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable, Tuple

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial (reflected bit order, ``1 << 31`` is ``x^0``)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _powers() -> Tuple[int, ...]:
    out = [1 << 30]  # x^1
    for _ in range(31):
        out.append(_multmodp(out[-1], out[-1]))
    return tuple(out)


_X2N = _powers()  # x^(2^k) modulo the polynomial, k = 0..31


@lru_cache(maxsize=4096)
def _x8n(n: int) -> int:
    """``x^(8 * n)`` modulo the polynomial (the shift of appending ``n`` bytes)."""
    p = 1 << 31  # x^0
    k = 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32C of ``a + b`` from ``crc1 = crc32c(a)``, ``crc2 = crc32c(b)`` and ``len(b)``."""
    if len2 <= 0:
        return crc1
    return _multmodp(_x8n(len2), crc1) ^ crc2


def crc32c_concat(parts: Iterable[Tuple[int, int]]) -> int:
    """The CRC-32C of consecutive parts given as ``(crc, length)``, in order."""
    crc = 0
    for c, n in parts:
        crc = crc32c_combine(crc, c, n)
    return crc
