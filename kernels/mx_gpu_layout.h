// The weights of ai.mxspd::MXMatMulGPU, the MX matmul of the GPU target: what its CUDA kernel
// (kernels/cuda/mx_matmul_gpu.cu) reads, and its CPU reference (kernels/mx_matmul_gpu.cc) too.
//
// Layout (kernels/layout.py, pack_gpu): each output column's blocks of 32 codes along K, contiguous:
// W uint8 [N, KB, 24] for MXFP6 E2M3 (4 codes in 3 bytes: code i of a block at bits 6i of its 24 bytes,
// little endian) or [N, KB, 32] for MXINT8 (two's complement codes), K padded to whole blocks with
// code 0; S uint8 [N, KB], the blocks' E8M0 exponents (MXINT8's already holding its 2^-6). A GPU warp
// reading one column reads 32 consecutive blocks at a time: 768 (or 1,024) contiguous bytes.
//
// Value of weight (n, k): w(code) * 2^(S[n, k / 32] - 127 - shift), where w is 8 * the E2M3 value (an
// integer, |w| <= 60; shift 3) or the MXINT8 code (shift 0); exponent 255 is NaN. 6.25 bits per weight
// read for MXFP6, 8.25 for MXINT8.

#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define MXSPD_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MXSPD_HOST_DEVICE inline
#endif

namespace mxspd::gpu_layout {

constexpr int kBlock = 32;
template <int WBits>
constexpr int kBlockBytes = WBits == 8 ? 32 : 24;
template <int WBits>
constexpr int kShift = WBits == 8 ? 0 : 3;

// 8 * the value of an E2M3 code (bit 5 sign, bits 3-4 exponent, bits 0-2 mantissa).
MXSPD_HOST_DEVICE int e2m3_times8(uint32_t code) {
  const int e = (code >> 3) & 3, m = code & 7;
  const int magnitude = e == 0 ? m : (8 + m) << (e - 1);
  return code & 32 ? -magnitude : magnitude;
}

// Integer weight i (0..31) of a block whose bytes are read as little-endian 64-bit words (MXFP6: 3 of
// them, MXINT8: 4).
template <int WBits>
MXSPD_HOST_DEVICE int block_weight(const uint64_t words[4], int i) {
  if constexpr (WBits == 8) {
    return static_cast<int8_t>((words[i / 8] >> (8 * (i % 8))) & 0xFF);
  } else {
    const int bit = 6 * i, word = bit / 64, shift = bit % 64;
    uint64_t v = words[word] >> shift;
    if (shift > 58) v |= words[word + 1] << (64 - shift);
    return e2m3_times8(static_cast<uint32_t>(v & 63));
  }
}

}  // namespace mxspd::gpu_layout
