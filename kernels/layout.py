"""The weight layouts mxspd's ops read (kernels/*.cc).

ai.mxspd::MXMatMul (mx_matmul.cc): output columns in groups of 16 (N padded with code 0), blocks of
32 codes along K (padded with code 0). A group's block is 8 chunks; chunk q holds codes 4q..4q+3 of
the 16 columns in the order the kernel multiplies them: its byte o (0..63) is code 4q + 2 (o // 32)
+ o % 2 of column (o % 32) // 2, one column's pair of codes per 32-bit lane, for VNNI's int16 pair
dot products with one column per lane. MXINT8 (pack_int8_columns) keeps those 64 code bytes;
MXFP6 (pack_columns) packs them to 48 bytes, 6 per 8 codes, code i of the 8 at bits 6i (little
endian), which the AVX-512 path unpacks with two byte permutes and a multishift (layout TRIPLES), or
(layout PLANES, what the AVX2 path decodes fastest) each pair of chunks as 96 bytes: the codes' low 4
bits (chunk 2p's 32 bytes, then chunk 2p + 1's; byte i holds position i in bits 0-3 and 32 + i in
4-7), then 32 bytes of their top two bits (byte i, from bit 7 down: bit 4, bit 5 of positions i and
32 + i of chunk 2p, then of chunk 2p + 1). Layout PLANES8 is PLANES with another chunk byte order, for
int8 activations (vpmaddubsw's 4 codes per column and 32-bit lane): byte o of chunk q is code 4q + o % 4
of column 4 (o // 32) + 8 ((o % 32) // 16) + (o % 16) // 4 (columns 0-3 and 8-11 in the first 32 bytes,
4-7 and 12-15 in the second: the AVX2 path's column order). MXFP4 (pack_fp4_columns, weight_bits 4,
layout PLANES8's order) packs a chunk's 64 codes in 32 bytes: byte i holds position i in bits 0-3 and
position 32 + i in bits 4-7 (each nibble's sign at bit 3: at bit 7 once the byte is doubled 4 times, or
already there). Scales (pack_scales): [G, KB, 16] E8M0 bytes. Groups are contiguous, so a call streams
each weight once, front to back.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32
GROUP = 16  # MXMatMul's output columns per group: packed weights concatenate along N in whole groups
CHUNKS = 8
BLOCK_BYTES = {4: CHUNKS * 32, 6: CHUNKS * 48, 8: CHUNKS * 64}  # per group and block of 32: weight bits -> bytes
# MXMatMul's attribute `layout`: MXFP6 in any, PLANES8 with int8 activations only; MXFP4 in PLANES8's order
TRIPLES, PLANES, PLANES8 = 0, 1, 2
PANEL = 64  # ai.mxspd::RowMatMul (row_matmul.cc): float32 weights in panels of 64 columns
GPU_BLOCK_BYTES = {6: 24, 8: 32}  # ai.mxspd::MXMatMulGPU (mx_gpu_layout.h): bytes per column and block of 32

# Chunk byte o of chunk q: (column, code) within a group's block; PLANES8's order apart.
_O = np.arange(64)
_COLUMN = np.broadcast_to((_O % 32) // 2, (CHUNKS, 64))
_CODE = 4 * np.arange(CHUNKS)[:, None] + 2 * (_O // 32) + _O % 2
_COLUMN8 = np.broadcast_to(4 * (_O // 32) + 8 * ((_O % 32) // 16) + (_O % 16) // 4, (CHUNKS, 64))
_CODE8 = 4 * np.arange(CHUNKS)[:, None] + _O % 4


def pack_panels(weight: np.ndarray) -> np.ndarray:
    """float32 [K, N] -> [ceil(N/64), K, 64], zero-padded: each panel one contiguous read per call."""
    k, n = weight.shape
    panels = -(-n // PANEL)
    out = np.zeros((k, panels * PANEL), dtype=np.float32)
    out[:, :n] = weight
    return np.ascontiguousarray(out.reshape(k, panels, PANEL).transpose(1, 0, 2))


def _chunks(codes: np.ndarray, four: bool = False) -> np.ndarray:
    """Codes [K, N] -> [G, KB, 8, 64] in the kernel's byte order (`four`: PLANES8's; padding with code 0)."""
    k, n = codes.shape
    kb, groups = -(-k // BLOCK), -(-n // GROUP)
    c = np.zeros((groups * GROUP, kb * BLOCK), dtype=codes.dtype)
    c[:n, :k] = codes.T
    c = c.reshape(groups, GROUP, kb, BLOCK).transpose(0, 2, 1, 3)  # [G, KB, column, code]
    return c[:, :, _COLUMN8, _CODE8] if four else c[:, :, _COLUMN, _CODE]


def pack_columns(codes: np.ndarray, layout: int = TRIPLES) -> np.ndarray:
    """FLOAT6 codes uint8 [K, N] -> uint8 [ceil(N/16), ceil(K/32), 384] in `layout`."""
    if layout in (PLANES, PLANES8):
        return _planes(_chunks(codes, four=layout == PLANES8))
    if layout != TRIPLES:
        raise ValueError(f"unknown MXFP6 layout {layout!r}: {TRIPLES} (triples), {PLANES} (planes) or {PLANES8} "
                         "(planes8)")
    chunks = _chunks(codes)
    eights = chunks.astype(np.uint64).reshape(*chunks.shape[:3], 8, 8)
    bits = (eights << (6 * np.arange(8, dtype=np.uint64))).sum(axis=-1, dtype=np.uint64)  # 48 bits per 8 codes
    low6 = bits[..., None].view(np.uint8)[..., :6]  # little-endian: the low 6 bytes
    return np.ascontiguousarray(low6.reshape(*chunks.shape[:2], BLOCK_BYTES[6]))


def _planes(chunks: np.ndarray) -> np.ndarray:
    """[G, KB, 8, 64] codes -> [G, KB, 384], the PLANES layout."""
    pairs = chunks.reshape(*chunks.shape[:2], CHUNKS // 2, 2, 2, 32)  # [.., pair, chunk, half, i]
    low = pairs & 15
    nibbles = low[..., 0, :] | low[..., 1, :] << 4  # [.., pair, chunk, i]
    top = pairs.reshape(*pairs.shape[:3], 4, 32) >> 4  # register r = 2 chunk + half: bits 4, 5 as 0..3
    shifts = (6 - 2 * np.arange(4, dtype=np.uint8))[:, None]  # bit 4 of register r at 7 - 2r, bit 5 at 6 - 2r
    plane = (((top & 1) << 1 | top >> 1) << shifts).sum(axis=-2, dtype=np.uint8)  # [.., pair, i]
    out = np.concatenate([nibbles.reshape(*nibbles.shape[:3], 64), plane], axis=-1)
    return np.ascontiguousarray(out.reshape(*chunks.shape[:2], BLOCK_BYTES[6]))


def pack_fp4_columns(codes: np.ndarray) -> np.ndarray:
    """FLOAT4 codes uint8 [K, N] -> uint8 [ceil(N/16), ceil(K/32), 256]: PLANES8's positions, two a byte."""
    chunks = _chunks(codes, four=True)
    packed = chunks[..., :32] | chunks[..., 32:] << 4
    return np.ascontiguousarray(packed.reshape(*chunks.shape[:2], BLOCK_BYTES[4]))


def pack_int8_columns(codes: np.ndarray) -> np.ndarray:
    """MXINT8 codes int8 [K, N] -> uint8 [ceil(N/16), ceil(K/32), 512] (two's complement bytes)."""
    chunks = _chunks(codes)
    return np.ascontiguousarray(chunks.view(np.uint8).reshape(*chunks.shape[:2], BLOCK_BYTES[8]))


def pack_scales(exponents: np.ndarray) -> np.ndarray:
    """E8M0 exponents uint8 [KB, N] -> [ceil(N/16), KB, 16] (padded columns: 127, a scale of 1 on code 0)."""
    kb, n = exponents.shape
    groups = -(-n // GROUP)
    out = np.full((groups * GROUP, kb), 127, dtype=np.uint8)
    out[:n] = exponents.T
    return np.ascontiguousarray(out.reshape(groups, GROUP, kb).transpose(0, 2, 1))


def unpack_columns(packed: np.ndarray, k: int, n: int) -> np.ndarray:
    """The inverse of `pack_columns`: uint8 [G, KB, 384] -> codes [K, N]."""
    groups, kb = packed.shape[:2]
    six = np.zeros((groups, kb, CHUNKS, 8, 8), dtype=np.uint8)
    six[..., :6] = packed.reshape(groups, kb, CHUNKS, 8, 6)
    bits = six.view(np.uint64)[..., 0]  # [G, KB, 8 chunks, 8 groups of 8 codes]
    chunks = ((bits[..., None] >> (6 * np.arange(8, dtype=np.uint64))) & 63).astype(np.uint8).reshape(
        groups, kb, CHUNKS, 64)
    c = np.zeros((groups, kb, GROUP, BLOCK), dtype=np.uint8)
    c[:, :, _COLUMN, _CODE] = chunks
    return np.ascontiguousarray(c.transpose(0, 2, 1, 3).reshape(groups * GROUP, kb * BLOCK)[:n, :k].T)


def pack_gpu(codes: np.ndarray, wbits: int) -> np.ndarray:
    """MXMatMulGPU's weights (kernels/mx_gpu_layout.h): codes [K, N] (FLOAT6 uint8, or MXINT8 int8) ->
    uint8 [N, ceil(K/32), 24 or 32], each output column's blocks contiguous, K padded with code 0; FLOAT6
    4 codes in 3 bytes, code i of a block at bits 6i (little endian)."""
    k, n = codes.shape
    kb = -(-k // BLOCK)
    c = np.zeros((n, kb * BLOCK), dtype=codes.dtype)
    c[:, :k] = codes.T
    if wbits == 8:
        return np.ascontiguousarray(c.view(np.uint8).reshape(n, kb, GPU_BLOCK_BYTES[8]))
    quads = c.astype(np.uint32).reshape(n, kb, BLOCK // 4, 4)
    bits = (quads << (6 * np.arange(4, dtype=np.uint32))).sum(axis=-1, dtype=np.uint32)  # 24 bits per 4 codes
    return np.ascontiguousarray(bits[..., None].view(np.uint8)[..., :3].reshape(n, kb, GPU_BLOCK_BYTES[6]))


def pack_gpu_scales(exponents: np.ndarray) -> np.ndarray:
    """E8M0 exponents uint8 [KB, N] -> MXMatMulGPU's [N, KB]."""
    return np.ascontiguousarray(exponents.T)
