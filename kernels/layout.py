"""The weight layouts mxspd's ops read (kernels/*.cc).

ai.mxspd::MXMatMul (mx_matmul.cc): MXFP6 codes at 6 bits each, or MXINT8 codes at 8 (pack_int8_columns).

Per output column and block of 32 codes c[0..31], 24 bytes: 16 bytes of low nibbles
(c[j] & 15 | (c[j + 16] & 15) << 4), then 8 bytes of bit pairs: byte j holds the pairs of c[j],
c[j + 8], c[j + 16], c[j + 24] at bits 0, 2, 4, 6. A code's pair is its sign (bit 0) and whether
its magnitude is in the lower half, codes 0-15 whose 8 * value is the code itself (bit 1): the
AVX2 path turns 32 codes into int8 values with one table lookup and a handful of instructions.
Columns are contiguous, so a decode step streams each weight once, front to back.
"""

from __future__ import annotations

import numpy as np

BLOCK, BLOCK_BYTES = 32, 24
PANEL = 64  # ai.mxspd::RowMatMul (row_matmul.cc): float32 weights in panels of 64 columns


def pack_panels(weight: np.ndarray) -> np.ndarray:
    """float32 [K, N] -> [ceil(N/64), K, 64], zero-padded: each panel one contiguous read per call."""
    k, n = weight.shape
    panels = -(-n // PANEL)
    out = np.zeros((k, panels * PANEL), dtype=np.float32)
    out[:, :n] = weight
    return np.ascontiguousarray(out.reshape(k, panels, PANEL).transpose(1, 0, 2))


def pack_columns(codes: np.ndarray) -> np.ndarray:
    """FLOAT6 codes [K, N] (K padded with code 0 to whole blocks) -> uint8 [N, ceil(K/32), 24]."""
    k, n = codes.shape
    kb = -(-k // BLOCK)
    c = np.zeros((n, kb * BLOCK), dtype=np.uint8)
    c[:, :k] = codes.T
    c = c.reshape(n, kb, BLOCK)
    low = (c[..., :16] & 15) | ((c[..., 16:] & 15) << 4)
    top = ((c >> 5) & 1) | ((((c >> 4) & 1) ^ 1) << 1)  # sign, lower-half magnitude
    high = top[..., 0:8] | (top[..., 8:16] << 2) | (top[..., 16:24] << 4) | (top[..., 24:32] << 6)
    return np.ascontiguousarray(np.concatenate([low, high], axis=-1), dtype=np.uint8)


def pack_int8_columns(codes: np.ndarray) -> np.ndarray:
    """MXINT8 codes int8 [K, N] -> uint8 [N, ceil(K/32), 32] (two's complement bytes; K padded with 0)."""
    k, n = codes.shape
    kb = -(-k // BLOCK)
    c = np.zeros((n, kb * BLOCK), dtype=np.int8)
    c[:, :k] = codes.T
    return np.ascontiguousarray(c.view(np.uint8).reshape(n, kb, BLOCK))


def unpack_columns(packed: np.ndarray, k: int) -> np.ndarray:
    """The inverse of `pack_columns`: uint8 [N, KB, 24] -> codes [K, N]."""
    low, high = packed[..., :16], packed[..., 16:]
    lo = np.concatenate([low & 15, low >> 4], axis=-1)
    pair = np.concatenate([(high >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)
    top = ((pair & 1) << 1) | ((pair >> 1) ^ 1)  # sign, upper-half magnitude: the code's bits 5, 4
    codes = (lo | (top << 4)).reshape(packed.shape[0], -1)
    return np.ascontiguousarray(codes[:, :k].T)
