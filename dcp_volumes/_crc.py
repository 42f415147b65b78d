"""CRC32C arithmetic: extend a running CRC by a piece whose own CRC is already known.

CRC32C is affine in its starting value: for any ``piece`` of ``n`` bytes,
``crc32c(piece, value=v) == A_n(v) ^ crc32c(piece)``, where ``A_n`` is the linear map of
feeding ``n`` zero bytes (``A_n(v) = crc32c(zeros(n), value=v) ^ crc32c(zeros(n))``) and
``A_{m+n} = A_m ∘ A_n``. So the spool reads each byte once, takes the CRC of each piece
between part and block boundaries, and assembles the item, block and part CRCs from those.

``A_n`` is applied as the maps ``A_{2^k}`` of the bits set in ``n``, each kept as four byte
tables (four lookups per application); the tables are built once per process.
"""

from __future__ import annotations

import functools

import crc32c

__all__ = ["crc32c_extend"]

_DIRECT_BITS = 12  # up to 4 KiB the map's columns come straight from CRCs of zeros


def _tables_from_columns(cols: list[int]) -> tuple[tuple[int, ...], ...]:
    tables = []
    for byte in range(4):
        table = [0] * 256
        for value in range(1, 256):
            low = value & -value
            table[value] = table[value ^ low] ^ cols[8 * byte + low.bit_length() - 1]
        tables.append(tuple(table))
    return tuple(tables)


def _apply(tables: tuple[tuple[int, ...], ...], v: int) -> int:
    return (tables[0][v & 0xFF] ^ tables[1][(v >> 8) & 0xFF] ^ tables[2][(v >> 16) & 0xFF]
            ^ tables[3][v >> 24])


@functools.cache
def _power_tables(k: int) -> tuple[tuple[int, ...], ...]:
    """Byte tables of ``A_{2^k}``."""
    if k <= _DIRECT_BITS:
        zeros = bytes(1 << k)
        base = crc32c.crc32c(zeros)
        cols = [crc32c.crc32c(zeros, value=1 << bit) ^ base for bit in range(32)]
    else:
        half = _power_tables(k - 1)
        cols = [_apply(half, _apply(half, 1 << bit)) for bit in range(32)]
    return _tables_from_columns(cols)


def crc32c_extend(crc: int, piece_crc: int, length: int) -> int:
    """``crc32c(piece, value=crc)``, given ``piece_crc == crc32c(piece)`` and ``len(piece)``."""
    if crc == 0:
        return piece_crc  # A_n(0) == 0
    k = 0
    while length:
        if length & 1:
            crc = _apply(_power_tables(k), crc)
        length >>= 1
        k += 1
    return crc ^ piece_crc
