"""Code packing in the ONNX raw_data bit orders: 6-bit codes 4 in 3 bytes, 4-bit codes 2 in a byte,
LSB-first.

One code per byte would cost 8 instead of 6 (or 4) bits and lose most of MX's size advantage.
ONNX `raw_data` is the 6-bit stream cut to ceil(6n/8) bytes: `pack_fp6(c)[:ceil(6n/8)]`; FLOAT4E2M1's
is ceil(n/2) bytes, the first code in each byte's low 4 bits.
"""

from __future__ import annotations

import numpy as np

__all__ = ["pack_fp4", "pack_fp6", "packed_fp6_size", "unpack_fp4", "unpack_fp6"]


def packed_fp6_size(count: int) -> int:
    """Bytes `pack_fp6` returns for `count` codes (whole 3-byte groups)."""
    return -(-count // 4) * 3


def pack_fp6(codes: np.ndarray) -> np.ndarray:
    """Pack 6-bit codes (any shape, read flat) into uint8 bytes; the tail is zero-padded to 4."""
    flat = np.asarray(codes).ravel()
    if flat.size and (flat.dtype.kind not in "iu" or flat.min() < 0 or flat.max() > 63):
        # Silently masking would corrupt neighbouring codes' bits in the stream.
        raise ValueError("pack_fp6 needs integer codes in [0, 63]")
    flat = flat.astype(np.uint8, copy=False)
    pad = -flat.size % 4
    if pad:
        flat = np.concatenate([flat, np.zeros(pad, dtype=np.uint8)])
    x = flat.reshape(-1, 4)
    x0, x1, x2, x3 = x[:, 0], x[:, 1], x[:, 2], x[:, 3]
    out = np.empty((x.shape[0], 3), dtype=np.uint8)
    out[:, 0] = x0 | ((x1 & 3) << 6)
    out[:, 1] = (x1 >> 2) | ((x2 & 15) << 4)
    out[:, 2] = (x2 >> 4) | (x3 << 2)
    return out.reshape(-1)


def unpack_fp6(packed: np.ndarray, count: int) -> np.ndarray:
    """Inverse of `pack_fp6`: the first `count` codes as flat uint8.

    Accepts the full padded stream (`packed_fp6_size(count)` bytes) or the ONNX raw_data
    length ceil(6 * count / 8); anything else means the count and buffer disagree.
    """
    data = np.asarray(packed)
    if data.dtype != np.uint8:
        raise ValueError(f"unpack_fp6 needs uint8 bytes, got {data.dtype}")
    data = data.ravel()
    if isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 0:
        raise ValueError(f"count must be a non-negative integer, got {count!r}")
    full = packed_fp6_size(int(count))
    minimal = -(-int(count) * 6 // 8)
    if not minimal <= data.size <= full:
        raise ValueError(
            f"{data.size} packed bytes do not hold {count} 6-bit codes "
            f"(expected {full}, or {minimal} as in ONNX raw_data)"
        )
    if data.size < full:
        data = np.concatenate([data, np.zeros(full - data.size, dtype=np.uint8)])
    b = data.reshape(-1, 3)
    b0, b1, b2 = b[:, 0], b[:, 1], b[:, 2]
    out = np.empty((b.shape[0], 4), dtype=np.uint8)
    out[:, 0] = b0 & 63
    out[:, 1] = (b0 >> 6) | ((b1 & 15) << 2)
    out[:, 2] = (b1 >> 4) | ((b2 & 3) << 4)
    out[:, 3] = b2 >> 2
    return out.reshape(-1)[:count]


def pack_fp4(codes: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes (any shape, read flat) two to a byte, the first in the low 4 bits (ONNX's
    FLOAT4E2M1 raw_data: ceil(n / 2) bytes, an odd count's last high half zero)."""
    flat = np.asarray(codes).ravel()
    if flat.size and (flat.dtype.kind not in "iu" or flat.min() < 0 or flat.max() > 15):
        raise ValueError("pack_fp4 needs integer codes in [0, 15]")
    flat = flat.astype(np.uint8, copy=False)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, dtype=np.uint8)])
    return flat[0::2] | (flat[1::2] << 4)


def unpack_fp4(packed: np.ndarray, count: int) -> np.ndarray:
    """Inverse of `pack_fp4`: the first `count` codes as flat uint8, from exactly ceil(count / 2) bytes."""
    data = np.asarray(packed)
    if data.dtype != np.uint8:
        raise ValueError(f"unpack_fp4 needs uint8 bytes, got {data.dtype}")
    if isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 0:
        raise ValueError(f"count must be a non-negative integer, got {count!r}")
    data = data.ravel()
    if data.size != -(-int(count) // 2):
        raise ValueError(f"{data.size} packed bytes do not hold {count} 4-bit codes (expected {-(-int(count) // 2)})")
    out = np.empty(2 * data.size, dtype=np.uint8)
    out[0::2], out[1::2] = data & 15, data >> 4
    return out[:count]
