// mxspd's native ONNX Runtime op: ai.mxspd::MXMatMul, a matmul whose weights stay MXFP6 E2M3 in memory
// (6 bits per code plus one E8M0 byte per 32 codes: 6.25 bits per weight) and are decoded in registers.
//
// Why: ONNX Runtime has no 6-bit matmul; MatMulNBits(bits=8) reads 8-bit codes plus float32 scales
// (9 bits per weight), and decode speed on a CPU is bytes per token over memory bandwidth.
//
// Semantics: activations are rounded per row and block of 32 to integers with a float32 scale xs
// (int16, or int8 with activation_bits = 8); weights are integers too (8 * the E2M3 value, or the
// MXINT8 code) with the block's power-of-two scale ws. Then, for every row and output column,
//   acc = 0; for each block b in order: acc = fma(float(isum_b), ws_b * xs_b, acc);   y = acc
// where isum_b is the block's exact integer dot product (int32: no rounding, so any grouping of its
// 32 products gives the same sum). Every row is computed by that sequence whatever the number of rows
// in the call (batch invariance: a token's logits do not depend on what else shares its call).
//
// Weight layout (kernels/layout.py writes it): output columns in groups of 16 (N padded with code 0),
// W uint8 [G = ceil(N/16), K/32, 384 (MXFP6), 512 (MXINT8) or 256 (MXFP4)], S uint8 [G, K/32, 16] E8M0 exponents
// (K padded to whole blocks with code 0). A group's block is 8 chunks; chunk q holds codes 4q..4q+3
// of the 16 columns in the order the kernel multiplies them: its byte o (0..63) is code
// 4q + 2 (o / 32) + o % 2 of column (o % 32) / 2, so each 32-bit lane holds one column's pair of
// codes for VNNI's int16 pair dot products, one column per lane. MXINT8 stores the 64 code bytes as
// they are; MXFP6 packs them into 48 bytes, in one of two layouts (attribute `layout`):
//   0, triples: 6 bytes per 8 codes, code i of the 8 at bits 6i (little endian); what the AVX-512 path
//      unpacks with byte permutes.
//   1, planes: each pair of chunks (2p, 2p + 1) as 96 bytes: the codes' low 4 bits, chunk 2p's 32 bytes
//      then chunk 2p + 1's (byte i: position i in bits 0-3, position 32 + i in bits 4-7), then 32 bytes
//      of their top 2 bits (byte i, from bit 7 down: bit 4 then bit 5 of positions i and 32 + i of chunk
//      2p, then of chunk 2p + 1): what AVX2 decodes with the fewest operations (a mask, a byte doubling,
//      a 16-entry lookup and two blends per 32 codes).
//   2, planes8 (int8 activations only): planes' bits with another byte order, chunk byte o holding code
//      4q + o % 4 of column 4 (o / 32) + 8 ((o % 32) / 16) + (o % 16) / 4: one column's 4 codes per
//      32-bit lane, for vpmaddubsw (columns 0-3 and 8-11 first: the AVX2 path's ColumnOrder).
// The compiler picks the library's preferred one for the activations (kernels.preferred_mx_layout).
// One pass over a group's weights serves every row of the call, and each extra row costs
// 16 dot products, one conversion, one scale product and one fma per 16 columns and block.
//
// Code paths: AVX-512 with VNNI and VBMI (codes unpacked by byte permutes, up to 12 rows per pass),
// AVX2 (up to 6 rows per pass; int8 activations on planes8: vpmaddubsw), portable; from 16 rows (MXINT8:
// 8 on AVX2, 32 on AVX-512; MXFP4: 5 on AVX2) the AVX-512 and AVX2 paths decode each weight once per call
// and pass over it for every row (int8 activations: vpmaddubsw on AVX2 with MXFP6 and MXFP4 weights,
// vpdpbusd on AVX-512 with every width, from 12 rows for MXFP6, 24 for MXINT8, 64 for MXFP4). Fewer rows
// of int8 activations on AVX-512 multiply bytes too (group_avx512_int8: weights + an offset by the signed
// activations). On AMX (Intel Xeon since Sapphire Rapids, where the OS enables it; MXSPD_KERNELS_NO_AMX turns
// it off) int8 calls of 32 rows or more take the many-row path with its integer sums from tdpbssd on tiles.
// All give the same bits (tests/test_native_kernel.py).
//
// weight_bits = 8: MXINT8 instead (codes k, S holding e - 6: the value k * 2^(S-127)): 8.25 bits per
// weight, for the weights a recipe keeps finer (the LM head, sensitive layers).
//
// weight_bits = 4: MXFP4 E2M1 (integers 2 * value, |w| <= 12; 4.25 bits per weight), layout 2 (planes8's
// positions) and int8 activations only: W uint8 [G, K/32, 256], chunk q's 32 bytes holding position i in
// bits 0-3 of byte i and position 32 + i in bits 4-7. Few rows on AVX2: a 16-entry lookup gives the
// weights + 12 for vpmaddubsw by the rows' signed activations, 4 chunks' pair sums added as int16
// (<= 4 x 2 x 24 x 127 = 24,384) before one vpmaddwd, less 12 x each row's block sum; many rows: the
// tile decoded once to signed bytes for the biased int8 pass loop (4 chunks in int16 too). On AVX-512
// one vpermb gives a chunk's weights + 12 for vpdpbusd, by the rows' signed activations, less 12 x each
// row's block sum (group_avx512_int8).
//
// prologue (kernels/prologue.h), computed on the input rows before they are rounded, in place of a
// node of its own (compiler/matmul_prologue.py):
//   0: none: A [..., K].
//   1: SwiGLU: A [..., 2K] is a packed gate and up projection; the rows are swiglu_row(A).
//   2: residual RMS norm: inputs 3 (skip, A's shape) and 4 (gamma [K]), attribute epsilon; the rows are
//      skip_rms_row's norm of A + skip, and output 1 is the sum A + skip (the next residual).
//
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "ort_api.h"
#include "prologue.h"

namespace mxspd {
namespace {

constexpr int kBlock = 32, kGroup = 16, kChunks = 8;
constexpr int kRowGroup = 6;  // rows per pass over the weights on the AVX2 and portable paths
template <int WBits>
constexpr int kChunkBytes = WBits == 8 ? 64 : WBits == 6 ? 48 : 32;
template <int WBits>
constexpr int kGroupBlockBytes = kChunks * kChunkBytes<WBits>;

// 8 * value of every E2M3 code (bit 5: sign, bits 3-4: exponent, bits 0-2: mantissa), for one byte
// permute (VBMI) or a lookup.
struct CodeTable {
  alignas(64) int8_t weight[64];
  alignas(64) uint8_t offset[64];  // weight + 64 (4 .. 124): unsigned, for vpdpbusd's first operand
  CodeTable() {
    for (int c = 0; c < 64; ++c) {
      const int mag = c & 31, e = mag >> 3, m = mag & 7;
      const int w = e == 0 ? m : (8 + m) << (e - 1);
      weight[c] = static_cast<int8_t>(c & 32 ? -w : w);
      offset[c] = static_cast<uint8_t>(weight[c] + 64);
    }
  }
};
const CodeTable kCodes;

// 2 * value of every E2M1 code (bit 3: sign, bits 1-2: exponent, bit 0: mantissa), twice over: one
// 16-entry byte shuffle per 128-bit lane.
struct Fp4Table {
  alignas(32) int8_t weight[32];
  alignas(64) uint8_t offset[64];  // weight + 12 (0 .. 24), four times over: vpermb's 64 entries, read by a
                                   // code's low 4 bits alone (its first 32: AVX2's shuffle)
  Fp4Table() {
    for (int i = 0; i < 64; ++i) {
      const int c = i % 16, e = (c >> 1) & 3, m = c & 1;
      const int w = e == 0 ? m : (2 + m) << (e - 1), signed_w = c & 8 ? -w : w;
      offset[i] = static_cast<uint8_t>(signed_w + 12);
      if (i >= 32) continue;
      weight[i] = static_cast<int8_t>(signed_w);
    }
  }
};
const Fp4Table kFp4;

// 2^(e - 127 - shift): the block scale with the integer weights' step folded in (E2M3: 8 * value is
// an integer, shift 3; E2M1: 2 * value, shift 1; MXINT8: S already holds the 2^-6, shift 0); 255 is NaN.
template <int WBits>
constexpr int kScaleShift = WBits == 8 ? 0 : WBits == 6 ? 3 : 1;
struct ScaleTable {
  float v[256];
  explicit ScaleTable(int shift) {
    for (int e = 0; e < 255; ++e) v[e] = std::ldexp(1.0f, e - 127 - shift);
    v[255] = NAN;
  }
};
const ScaleTable kScalesE2M3(kScaleShift<6>), kScalesInt8(kScaleShift<8>), kScalesE2M1(kScaleShift<4>);
template <int WBits>
const float* scales() { return WBits == 8 ? kScalesInt8.v : WBits == 6 ? kScalesE2M3.v : kScalesE2M1.v; }

// The 48 bits of an MXFP6 chunk's codes 8i..8i+7 (the portable path), by one 8-byte load inside the chunk.
inline uint64_t eight_codes(const uint8_t* chunk, int i) {
  const int at = std::min(6 * i, 40);  // the last 6 bytes: load bytes 40-47, shift the first two out
  uint64_t bits;
  std::memcpy(&bits, chunk + at, 8);
  return bits >> (8 * (6 * i - at));
}

enum Layout : int64_t { kTriples = 0, kPlanes = 1, kPlanes8 = 2 };
constexpr int kPairBytes = 96;  // planes: a pair of MXFP6 chunks

// The code at byte o of chunk q of a planes block: its low 4 bits from the chunk's nibbles, bits 4 and 5
// from the pair's plane (register r = 2 (q % 2) + o / 32 has bit 4 at bit 7 - 2r, bit 5 at bit 6 - 2r).
inline int plane_code(const uint8_t* block, int q, int o) {
  const uint8_t* pair = block + (q / 2) * kPairBytes;
  const int i = o % 32, r = 2 * (q % 2) + o / 32;
  const int low = (pair[32 * (q % 2) + i] >> (4 * (o / 32))) & 15, plane = pair[64 + i];
  return low | ((plane >> (7 - 2 * r)) & 1) << 4 | ((plane >> (6 - 2 * r)) & 1) << 5;
}

// The column and code of byte o of chunk q of a group's block (planes8: 4 codes per column and 32-bit lane).
inline std::pair<int, int> column_code(int q, int o, Layout layout) {
  if (layout == kPlanes8) return {4 * (o / 32) + 8 * ((o % 32) / 16) + (o % 16) / 4, 4 * q + o % 4};
  return {(o % 32) / 2, 4 * q + 2 * (o / 32) + o % 2};
}

// The integer weight at byte o of chunk q of a group's block (the layouts above).
template <int WBits>
int weight_at(const uint8_t* block, int q, int o, Layout layout) {
  const uint8_t* chunk = block + q * kChunkBytes<WBits>;
  if constexpr (WBits == 8)
    return static_cast<int8_t>(chunk[o]);
  else if constexpr (WBits == 4)  // planes8's positions, two a byte
    return kFp4.weight[(chunk[o % 32] >> (4 * (o / 32))) & 15];
  else if (layout != kTriples)  // planes and planes8: the same bits, another (column, code) per byte
    return kCodes.weight[plane_code(block, q, o)];
  else
    return kCodes.weight[(eight_codes(chunk, o / 8) >> (6 * (o % 8))) & 63];
}

// Activations, row by row and block by block, as integers with a float32 scale (absmax / qmax):
// exact integer products with the integer weights, float32 only once per block. Bits = 16 rounds
// each activation to 1/65534 of its block's largest (closer than float16 does); Bits = 8 to 1/254 (as
// MatMulNBits' accuracy_level 4 and llama.cpp's Q8 activations do). Both are stored as int16.
// Rounding is to nearest even (lrintf, and the vector conversion under the default MXCSR), so the
// AVX2 path gives the portable one's integers.
struct Activations {
  std::vector<int16_t> q;    // [KB, M, 32]: a block's rows side by side, at fixed offsets from one pointer
  std::vector<float> scale;  // [KB, M]
  std::vector<uint8_t> biased;  // [KB, M, 32]: int8 activations + 128 (bias(), for the AVX2 and AVX-512
                                // many-row paths)
  std::vector<int8_t> signs;    // [KB, M, 64]: int8 activations, then their negations (sign(), planes8's rows)
  std::vector<int8_t> bytes;    // [KB, M, 32]: int8 activations (narrow(), the few-row int8 loops on AVX-512
                                // and MXFP4's on AVX2)
  std::vector<int32_t> sums;    // [KB, M]: each block's sum of them

  void fill(const float* a, int64_t m, int64_t k, int64_t kb, float qmax) {
    q.assign(m * kb * kBlock, 0);  // keeps the capacity: no allocation once the largest call has run
    scale.assign(m * kb, 0.0f);
    int16_t* const qs = q.data();  // (not q[...] in the loop: each call between would reload it, a thread_local's
    float* const scales = scale.data();  // through __tls_get_addr)
    for (int64_t r = 0; r < m; ++r)
      for (int64_t b = 0; b < kb; ++b) {
        const int64_t k0 = b * kBlock, n = std::min<int64_t>(k - k0, kBlock);
        int16_t* out = qs + (b * m + r) * kBlock;
        float* sc = scales + b * m + r;
#ifdef MXSPD_X86
        if (kHasAvx2 && n == kBlock) {
          block_avx2(a + r * k + k0, out, sc, qmax);
          continue;
        }
#endif
        block_scalar(a + r * k + k0, n, out, sc, qmax);
      }
  }

  // biased = q + 128: int8 activations (|q| <= 127) as the unsigned operand of vpmaddubsw. (Through local
  // pointers: a byte store may alias anything, so a loop over the members reloaded each vector's pointer,
  // a thread_local's through __tls_get_addr, at every element: 18% of a 64-row call at 1536 x 576.)
  void bias() {
    biased.resize(q.size());
    const int16_t* from = q.data();
    uint8_t* to = biased.data();
    for (size_t i = 0, n = q.size(); i < n; ++i) to[i] = static_cast<uint8_t>(from[i] + 128);
  }

  // signs: each block's 32 int8 activations (|q| <= 127), then the same negated: planes8's few-row path
  // moves each weight's sign onto its activation by choosing between the two.
  void sign() {
    signs.resize(2 * q.size());
    const int16_t* from = q.data();
    int8_t* to = signs.data();
    for (size_t i = 0, n = q.size(); i < n; i += kBlock)
      for (int j = 0; j < kBlock; ++j) {
        to[2 * i + j] = static_cast<int8_t>(from[i + j]);
        to[2 * i + kBlock + j] = static_cast<int8_t>(-from[i + j]);
      }
  }

  // bytes and sums: the int8 activations (|q| <= 127) as vpdpbusd's signed operand, and each block's sum of
  // them (local pointers, as in bias()).
  void narrow() {
    bytes.resize(q.size());
    sums.resize(scale.size());
    const int16_t* from = q.data();
    int8_t* to = bytes.data();
    int32_t* total = sums.data();
    for (size_t i = 0, n = sums.size(); i < n; ++i) {
      int32_t sum = 0;
      for (int j = 0; j < kBlock; ++j) {
        to[i * kBlock + j] = static_cast<int8_t>(from[i * kBlock + j]);
        sum += from[i * kBlock + j];
      }
      total[i] = sum;
    }
  }

  // bytes alone, with `pad` rows after the last block's: AMX's A operand reads 16 rows whatever the call's
  // (the sums of rows past the call are never stored).
  void narrow_tiles(int pad) {
    bytes.resize(q.size() + pad * kBlock);
    const int16_t* from = q.data();
    int8_t* to = bytes.data();
    for (size_t i = 0, n = q.size(); i < n; ++i) to[i] = static_cast<int8_t>(from[i]);
  }

  static void block_scalar(const float* x, int64_t n, int16_t* out, float* scale, float qmax) {
    float amax = 0.0f;
    bool finite = true;
    for (int64_t i = 0; i < n; ++i) {
      amax = std::max(amax, std::fabs(x[i]));
      finite = finite && std::isfinite(x[i]);
    }
    if (!finite) {  // Inf or NaN in, NaN out (as a float matmul would give, at least for NaN)
      *scale = NAN;
    } else if (amax > 0.0f) {
      const float inv = qmax / amax;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int16_t>(std::lrintf(x[i] * inv));
      *scale = amax / qmax;
    }
  }

#ifdef MXSPD_X86
  // The exponent fields of the scales, lowest and highest (for exponent_products); false where one is not a
  // normal float (a block of zeros, NaN from non-finite activations, or subnormal). Branch-free, so that it
  // vectorizes: 0.1 ns a scale, against 0.7 with an early exit.
  __attribute__((target("avx2"))) bool scale_exponents(int* lowest, int* highest) const {
    uint32_t lo = 255, hi = 0, bad = 0;
    for (const float v : scale) {
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      const uint32_t e = bits >> 23;  // the sign is 0 (absmax / qmax), else e > 255: not normal either
      lo = std::min(lo, e), hi = std::max(hi, e);
      bad |= (e == 0) | (e >= 255);
    }
    *lowest = static_cast<int>(lo), *highest = static_cast<int>(hi);
    return !bad;
  }

  __attribute__((target("avx2,fma"))) static void block_avx2(const float* x, int16_t* out, float* scale, float qmax) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 v[4], amax = _mm256_setzero_ps();
    __m256i exponents = _mm256_setzero_si256();  // all-ones exponent: Inf or NaN
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      const __m256 mag = _mm256_and_ps(v[i], abs_mask);
      amax = _mm256_max_ps(amax, mag);
      exponents = _mm256_or_si256(exponents, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(mag),
          _mm256_set1_epi32(0x7F800000)), _mm256_set1_epi32(0x7F800000)));
    }
    if (!_mm256_testz_si256(exponents, exponents)) {
      *scale = NAN;
      return;
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, amax);
    const float m = *std::max_element(lanes, lanes + 8);
    if (m == 0.0f) return;
    const __m256 inv = _mm256_set1_ps(qmax / m);
    for (int i = 0; i < 4; i += 2) {
      const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 1], inv));
      // packs works within 128-bit lanes: put the 16 results back in order
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * i),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), _MM_SHUFFLE(3, 1, 2, 0)));
    }
    *scale = m / qmax;
  }
#endif
};

template <int WBits>
struct Problem {
  const int16_t* xq;  // [KB, M, 32]
  const float* xs;    // [KB, M]
  const uint8_t* xu;  // [KB, M, 32]: the int8 activations + 128, where the AVX2 and AVX-512 many-row paths
                      // read them
  const int8_t* xn;   // [KB, M, 64]: the int8 activations and their negations, where planes8's few-row path reads them
  const uint8_t* w;   // [G, KB, kGroupBlockBytes<WBits>]
  const uint8_t* s;   // [G, KB, 16]
  float* y;           // [M, N]
  int64_t m, n, kb;
  Layout layout;      // of MXFP6 weights (MXFP4: planes8's positions)
  const int8_t* xi = nullptr;   // [KB, M, 32]: the int8 activations, where the few-row int8 loops on AVX-512 (and
                                // MXFP4's on AVX2) read them
  const int32_t* xt = nullptr;  // [KB, M]: each block's sum of them
  // The exponent fields of the call's activation scales, where all are normal floats (xs_normal): the
  // AVX-512 many-row path's exponent products.
  bool xs_normal = false;
  int xs_lowest = 0, xs_highest = 0;

  const int16_t* x(int64_t row, int64_t b) const { return xq + (b * m + row) * kBlock; }
  const float* x_scale(int64_t row, int64_t b) const { return xs + b * m + row; }
  const uint8_t* x_biased(int64_t row, int64_t b) const { return xu + (b * m + row) * kBlock; }
  const int8_t* x_signs(int64_t row, int64_t b) const { return xn + (b * m + row) * 2 * kBlock; }
  const int8_t* x_bytes(int64_t row, int64_t b) const { return xi + (b * m + row) * kBlock; }
  const int32_t* x_sum(int64_t row, int64_t b) const { return xt + b * m + row; }
  const uint8_t* block(int64_t g, int64_t b) const { return w + (g * kb + b) * kGroupBlockBytes<WBits>; }
  const uint8_t* exponents(int64_t g, int64_t b) const { return s + (g * kb + b) * kGroup; }
  int columns(int64_t g) const { return static_cast<int>(std::min<int64_t>(kGroup, n - g * kGroup)); }
};

// The portable path: the documented arithmetic, column by column.
template <int WBits>
void group_scalar(const Problem<WBits>& p, int64_t g, int64_t row0, int rows) {
  float acc[kRowGroup][kGroup] = {};
  for (int64_t b = 0; b < p.kb; ++b) {
    int32_t w[kGroup][kBlock];  // [column][code]
    for (int q = 0; q < kChunks; ++q)
      for (int o = 0; o < 64; ++o) {
        const auto [column, code] = column_code(q, o, p.layout);
        w[column][code] = weight_at<WBits>(p.block(g, b), q, o, p.layout);
      }
    const uint8_t* e = p.exponents(g, b);
    for (int r = 0; r < rows; ++r) {
      const int16_t* x = p.x(row0 + r, b);
      const float xs = *p.x_scale(row0 + r, b);
      for (int j = 0; j < kGroup; ++j) {
        int32_t sum = 0;
        for (int i = 0; i < kBlock; ++i) sum += w[j][i] * x[i];
        acc[r][j] = std::fma(static_cast<float>(sum), scales<WBits>()[e[j]] * xs, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < rows; ++r) std::memcpy(p.y + (row0 + r) * p.n + g * kGroup, acc[r], p.columns(g) * sizeof(float));
}

#ifdef MXSPD_X86
// ---- AVX2: 8 columns per register, up to 6 rows per pass ------------------------------------------
// On a Zen 3 core (AVX2, no AVX-512) decoding MXFP6, not memory, bounded a one-row call: a chunk is
// decoded in registers (layout planes: a mask, a 16-entry lookup, two blends and byte doublings, 8
// vector ops per 32 codes, the loads included; layout triples: shuffles, shifts and the lookup, 15) and
// widened to int16 there by in-lane unpacks, which leave the columns in ColumnOrder (docs/benchmarks-history.md).

// Per 128-bit lane: each 3 packed bytes [b0 b1 b2] (4 codes at bits 0, 6, 12, 18) to one 32-bit lane
// [b0 b1 b1 b2], the second lane's bytes starting `second` bytes into its 16.
struct SpreadTable {
  alignas(32) uint8_t v[32];
  explicit SpreadTable(int second) {
    for (int i = 0; i < 32; ++i) {
      const int j = (i % 16) / 4, o = (i < 16 ? 0 : second) + 3 * j;
      v[i] = static_cast<uint8_t>(o + std::array<int, 4>{0, 1, 1, 2}[i % 4]);
    }
  }
};
const SpreadTable kSpread0(0), kSpread4(4);

// 8 * value of the magnitudes 16-31 (magnitudes 0-15 are the code itself), for a 16-entry shuffle.
struct UpperTable {
  alignas(32) int8_t v[32];
  UpperTable() {
    for (int i = 0; i < 32; ++i) v[i] = kCodes.weight[16 + i % 16];
  }
};
const UpperTable kUpper;

// 32 codes' packed triples, spread by SpreadTable, to their integer weights (8 * the E2M3 value).
__attribute__((target("avx2,fma"))) inline __m256i weights_of_triples_avx2(__m256i v) {
  // A lane [b0 b1 b1 b2] holds bits 0-15 and 8-23 of its triple t in its 16-bit halves; the low half
  // shifted left by 4 takes the high half's shape: code 4t + 2h at bits 4-9 of half h, 4t + 2h + 1 at
  // bits 10-15 (bits 0-3: parts of other codes)
  const __m256i z = _mm256_blend_epi16(_mm256_slli_epi16(v, 4), v, 0xAA);
  const __m256i z2 = _mm256_srli_epi16(z, 2);  // the first code at bits 2-7, the second at 8-13
  // the magnitude's 5 bits, one code per byte
  const __m256i m = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(z, 4), _mm256_set1_epi16(0x001F)),
                                    _mm256_and_si256(z2, _mm256_set1_epi16(0x1F00)));
  // m < 16: the shuffle's index has bit 7 set and gives 0, and the weight is m; else the table's, >= m
  const __m256i mag = _mm256_max_epu8(
      _mm256_shuffle_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(kUpper.v)),
                          _mm256_sub_epi8(m, _mm256_set1_epi8(16))), m);
  // each byte's code with its sign bit (5) at bit 7, nonzero wherever the magnitude is; a byte that is
  // zero (or only other codes' bits) goes with a zero magnitude, which stays 0
  const __m256i sign = _mm256_blendv_epi8(z2, z, _mm256_set1_epi16(static_cast<int16_t>(0xFF00)));
  return _mm256_sign_epi8(mag, sign);
}

// The integer weights of chunk q (int8): code pair 2q of the 16 columns in *lo, pair 2q + 1 in *hi.
template <int WBits>
__attribute__((target("avx2,fma"))) inline void chunk_avx2(const uint8_t* chunk, __m256i* lo, __m256i* hi) {
  if constexpr (WBits == 8) {
    *lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
    *hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32));
  } else {  // triples 0-7 and 8-15, each lane by a 16-byte load inside the chunk
    const __m256i first = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(chunk + 12),
                                              reinterpret_cast<const __m128i*>(chunk));
    const __m256i second = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(chunk + 32),
                                               reinterpret_cast<const __m128i*>(chunk + 24));
    *lo = weights_of_triples_avx2(
        _mm256_shuffle_epi8(first, _mm256_load_si256(reinterpret_cast<const __m256i*>(kSpread0.v))));
    *hi = weights_of_triples_avx2(
        _mm256_shuffle_epi8(second, _mm256_load_si256(reinterpret_cast<const __m256i*>(kSpread4.v))));
  }
}

// The magnitudes (8 x |value|, unsigned bytes) of a planes pair of chunks' 4 registers (register r: chunk
// r / 2, positions 32 (r % 2) ..), and each one's sign flag at bit 7 of sign[r]: a register's magnitude is
// its 4 low bits, or the table's for 16-31 where bit 4 is set; the plane's byte doubled moves the next
// flag to bit 7, which is all a blend reads.
__attribute__((target("avx2,fma"))) inline void plane_magnitudes_avx2(const uint8_t* pair, __m256i mag[4],
                                                                     __m256i sign[4]) {
  const __m256i low4 = _mm256_set1_epi8(15);
  const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair));
  const __m256i second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + 32));
  const __m256i low[4] = {_mm256_and_si256(first, low4), _mm256_and_si256(_mm256_srli_epi16(first, 4), low4),
                          _mm256_and_si256(second, low4), _mm256_and_si256(_mm256_srli_epi16(second, 4), low4)};
  const __m256i upper = _mm256_load_si256(reinterpret_cast<const __m256i*>(kUpper.v));
  __m256i flags = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + 64));
  for (int r = 0; r < 4; ++r) {
    mag[r] = _mm256_blendv_epi8(low[r], _mm256_shuffle_epi8(upper, low[r]), flags);
    sign[r] = flags = _mm256_add_epi8(flags, flags);
    flags = _mm256_add_epi8(flags, flags);
  }
}

// The integer weights (int8) of chunks q and q + 1: code pairs 2q, 2q + 1 in w[0], w[1] (as chunk_avx2's lo,
// hi), then chunk q + 1's in w[2], w[3]. Planes: the magnitudes, negated where the sign flag is set (8
// operations per 32 codes, the loads included, against 15).
template <int WBits, bool Planes>
__attribute__((target("avx2,fma"))) inline void two_chunks_avx2(const uint8_t* block, int q, __m256i w[4]) {
  if constexpr (Planes) {
    __m256i mag[4], sign[4];
    plane_magnitudes_avx2(block + static_cast<unsigned>(q) / 2 * kPairBytes, mag, sign);  // q even: no fixup
    for (int r = 0; r < 4; ++r)
      w[r] = _mm256_blendv_epi8(mag[r], _mm256_sub_epi8(_mm256_setzero_si256(), mag[r]), sign[r]);
  } else {
    chunk_avx2<WBits>(block + q * kChunkBytes<WBits>, &w[0], &w[1]);
    chunk_avx2<WBits>(block + (q + 1) * kChunkBytes<WBits>, &w[2], &w[3]);
  }
}

// The order of the 16 columns in the AVX2 path's accumulators: widened by in-lane unpacks (a lane-crossing
// widening costs Zen 3 three times as much), the first register holds columns 0-3 and 8-11.
struct ColumnOrder {
  alignas(16) uint8_t v[16];
  ColumnOrder() {
    for (int i = 0; i < 16; ++i) v[i] = static_cast<uint8_t>(i % 4 + 8 * (i % 8 / 4) + 4 * (i / 8));
  }
};
const ColumnOrder kColumnOrder;

// int8 weights to int16, in place of sign extension: columns 0-3 and 8-11 in out[0], 4-7 and 12-15 in out[1].
__attribute__((target("avx2,fma"))) inline void widen_avx2(__m256i v, __m256i out[2]) {
  const __m256i sign = _mm256_cmpgt_epi8(_mm256_setzero_si256(), v);
  out[0] = _mm256_unpacklo_epi8(v, sign);
  out[1] = _mm256_unpackhi_epi8(v, sign);
}

// A row's 16 columns from ColumnOrder (a0: columns 0-3 and 8-11, a1: 4-7 and 12-15) back in order into y.
__attribute__((target("avx2,fma"))) inline void store_columns_avx2(__m256 a0, __m256 a1, float* y, int columns) {
  alignas(32) float out[kGroup];
  _mm256_store_ps(out, _mm256_permute2f128_ps(a0, a1, 0x20));
  _mm256_store_ps(out + 8, _mm256_permute2f128_ps(a0, a1, 0x31));
  std::memcpy(y, out, columns * sizeof(float));
}

// The 16 columns' block scales, in ColumnOrder; the table only where one is not a normal float (rare).
template <int WBits>
__attribute__((target("avx2,fma"))) inline void scales_avx2(const uint8_t* e8, __m256 ws[2]) {
  constexpr int shift = kScaleShift<WBits>;
  const __m128i e16 = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(e8)),
                                       _mm_load_si128(reinterpret_cast<const __m128i*>(kColumnOrder.v)));
  const __m256i e[2] = {_mm256_cvtepu8_epi32(e16), _mm256_cvtepu8_epi32(_mm_srli_si128(e16, 8))};
  for (int h = 0; h < 2; ++h) {
    const __m256i t = _mm256_sub_epi32(e[h], _mm256_set1_epi32(shift + 1));  // normal: 0 <= t <= 253 - shift
    const __m256i bad = _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_setzero_si256(), t),
                                        _mm256_cmpgt_epi32(t, _mm256_set1_epi32(253 - shift)));
    ws[h] = _mm256_testz_si256(bad, bad)
                ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(e[h], _mm256_set1_epi32(shift)), 23))
                : _mm256_i32gather_ps(scales<WBits>(), e[h], 4);
  }
}

// The weights `Ahead` bytes past a block, asked for while it is multiplied: a call's weights are one
// stream per thread, but the hardware prefetcher stops at each 4 KiB page. 1 KiB ahead on the AVX2 path
// (docs/benchmarks-history.md: 1.03-1.04x MXFP6 and 1.10-1.12x MXINT8 at one row on a Zen 3); a page
// ahead on the AVX-512 path (docs/benchmarks.md: on an Intel Xeon, one row 1.2x faster with 1 KiB than
// without, and 1.23-1.26x faster again with 4 KiB; 8 KiB no better). As an integer: the address may lie
// past the weights, where a prefetch does nothing.
template <int WBits, uintptr_t Ahead>
inline void prefetch_ahead(const uint8_t* block) {
  for (int line = 0; line < kGroupBlockBytes<WBits>; line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(block) + Ahead + line));
}

// A block's float step for rows row0 ..: acc = fma(float(block sum), ws * xs, acc), in ColumnOrder.
template <int WBits, int Rows>
__attribute__((target("avx2,fma"))) inline void block_step_avx2(const Problem<WBits>& p, int64_t g, int64_t b,
                                                                int64_t row0, const __m256i sum[Rows][2],
                                                                __m256 acc[Rows][2]) {
  __m256 ws[2];
  scales_avx2<WBits>(p.exponents(g, b), ws);
  const float* xs = p.x_scale(row0, b);
  for (int r = 0; r < Rows; ++r)
    for (int h = 0; h < 2; ++h)
      acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][h]), _mm256_mul_ps(ws[h], _mm256_set1_ps(xs[r])),
                                  acc[r][h]);
}

template <int WBits, int Rows, bool Planes>
__attribute__((target("avx2,fma"))) void group_avx2(const Problem<WBits>& p, int64_t g, int64_t row0) {
  __m256 acc[Rows][2];
  for (int r = 0; r < Rows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < p.kb; ++b) {
    const uint8_t* blk = p.block(g, b);
    prefetch_ahead<WBits, 1024>(blk);
    const int16_t* xb = p.x(row0, b);  // row r's 32 activations at xb + 32 r
    __m256i sum[Rows][2];  // in ColumnOrder
    for (int r = 0; r < Rows; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int q2 = 0; q2 < kChunks; q2 += 2) {  // unrolled: each pair's offsets become constants
      __m256i w8[4];
      two_chunks_avx2<WBits, Planes>(blk, q2, w8);
      for (int c = 0; c < 2; ++c) {
        const int q = q2 + c;
        // as int16: [pair 2q | 2q + 1][the two halves of ColumnOrder], each 32-bit lane one column's pair
        __m256i w[2][2];
        widen_avx2(w8[2 * c], w[0]);
        widen_avx2(w8[2 * c + 1], w[1]);
        for (int r = 0; r < Rows; ++r) {
          int32_t x0, x1;
          std::memcpy(&x0, xb + r * kBlock + 4 * q, 4);
          std::memcpy(&x1, xb + r * kBlock + 4 * q + 2, 4);
          const __m256i b0 = _mm256_set1_epi32(x0), b1 = _mm256_set1_epi32(x1);
          for (int h = 0; h < 2; ++h)
            sum[r][h] = _mm256_add_epi32(sum[r][h], _mm256_add_epi32(_mm256_madd_epi16(w[0][h], b0),
                                                                      _mm256_madd_epi16(w[1][h], b1)));
        }
      }
    }
    block_step_avx2<WBits, Rows>(p, g, b, row0, sum, acc);
  }
  for (int r = 0; r < Rows; ++r) store_columns_avx2(acc[r][0], acc[r][1], p.y + (row0 + r) * p.n + g * kGroup, p.columns(g));
}

// ---- AVX2, int8 activations on layout planes8 (one row to a few) -----------------------------------
// Each 32-bit lane of a decoded register holds one column's 4 codes of a chunk (planes8), so one
// vpmaddubsw multiplies 8 columns' codes by the row's 4 activations of that chunk: the weights' magnitudes
// (unsigned, <= 60) by the activations with each weight's sign moved onto them (a blend of x and -x by
// the plane's sign flag: no negation of the weights, no widening to int16). Two chunks' pair sums (each
// <= 2 x 60 x 127 = 15,240) add as int16 (<= 30,480: no saturation), then one vpmaddwd by ones widens
// them to int32: the block's exact integer sums, so the bits are the int16 loop's on the same integers.
// ~35 vector operations per 128 codes against ~58 for the int16 loop.
// Row r's 4 activations of chunk q and their negations, each broadcast to every 32-bit lane (xb: the rows'
// activations then their negations, 64 bytes a row): what planes8's few-row loop blends by sign.
__attribute__((target("avx2,fma"))) inline void row_quads_avx2(const int8_t* xb, int r, int q, __m256i* x, __m256i* n) {
  int32_t x4, n4;
  std::memcpy(&x4, xb + r * 2 * kBlock + 4 * q, 4);
  std::memcpy(&n4, xb + r * 2 * kBlock + kBlock + 4 * q, 4);
  *x = _mm256_set1_epi32(x4);
  *n = _mm256_set1_epi32(n4);
}

template <int Rows>
__attribute__((target("avx2,fma"))) void group_avx2_int8(const Problem<6>& p, int64_t g, int64_t row0) {
  __m256 acc[Rows][2];
  for (int r = 0; r < Rows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < p.kb; ++b) {
    const uint8_t* blk = p.block(g, b);
    prefetch_ahead<6, 1024>(blk);
    const int8_t* xb = p.x_signs(row0, b);  // row r's 32 activations at xb + 64 r, their negations 32 further
    __m256i sum[Rows][2];
    for (int r = 0; r < Rows; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int q2 = 0; q2 < kChunks; q2 += 2) {
      __m256i mag[4], sign[4], s16[Rows][2];
      plane_magnitudes_avx2(blk + static_cast<unsigned>(q2) / 2 * kPairBytes, mag, sign);
      for (int reg = 0; reg < 4; ++reg) {  // chunk q2 + reg / 2, columns of ColumnOrder half reg % 2
        const int q = q2 + reg / 2, h = reg % 2;
        for (int r = 0; r < Rows; ++r) {
          __m256i x, n;
          row_quads_avx2(xb, r, q, &x, &n);
          const __m256i prod = _mm256_maddubs_epi16(mag[reg], _mm256_blendv_epi8(x, n, sign[reg]));
          s16[r][h] = reg < 2 ? prod : _mm256_add_epi16(s16[r][h], prod);
        }
      }
      for (int r = 0; r < Rows; ++r)
        for (int h = 0; h < 2; ++h) sum[r][h] = _mm256_add_epi32(sum[r][h], _mm256_madd_epi16(s16[r][h], ones));
    }
    block_step_avx2<6, Rows>(p, g, b, row0, sum, acc);
  }
  for (int r = 0; r < Rows; ++r) store_columns_avx2(acc[r][0], acc[r][1], p.y + (row0 + r) * p.n + g * kGroup, p.columns(g));
}

// MXFP4's chunks whose vpmaddubsw pair sums add in int16 before one vpmaddwd by ones widens them: a pair of
// biased activations (<= 255) and weights (|w| <= 12), or of weights + 12 (<= 24) and activations
// (|x| <= 127), stays within 6,120, so 4 chunks' sums stay within 24,480 (5 would still fit; a block's 8
// would not). On the many-row loop 10 multiplies per 4 chunks and row instead of 16 (1.5x its rate in L1
// on a Zen 3). MXFP6's |w| <= 60 allows one pair (<= 30,600): its chunks widen one by one.
constexpr int kFp4Chunks16 = 4;

// ---- AVX2, MXFP4 weights with int8 activations (one row to a few) -----------------------------------
// A chunk's 32 bytes are its two registers' nibbles (positions i and 32 + i of planes8's order): one
// 16-entry lookup per register gives the weights + 12 (unsigned, 0 .. 24), which vpmaddubsw multiplies by
// the row's signed activations, as the AVX-512 loop does: a pair stays within 2 x 24 x 127 = 6,096, so 4
// chunks' pair sums add as int16 (<= 24,384: no saturation) before one vpmaddwd by ones, and 12 times the
// row's block sum comes off the block's: its exact integer sums, the bits of every other path. Per 4
// chunks and row: 4 broadcasts, 8 vpmaddubsw, 6 int16 adds, 2 vpmaddwd; the decode is 5 operations a
// chunk for every row. (Before 2026-12-02 the magnitudes met activations whose sign each weight's chose,
// a blend a register and row: 1.3x the operations at one row.)
template <int Rows>
__attribute__((target("avx2,fma"))) void group_avx2_fp4(const Problem<4>& p, int64_t g, int64_t row0) {
  __m256 acc[Rows][2];
  for (int r = 0; r < Rows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(15);
  const __m256i table = _mm256_load_si256(reinterpret_cast<const __m256i*>(kFp4.offset));
  for (int64_t b = 0; b < p.kb; ++b) {
    const uint8_t* blk = p.block(g, b);
    prefetch_ahead<4, 1024>(blk);
    const int8_t* xb = p.x_bytes(row0, b);  // row r's 32 activations at xb + 32 r
    const int32_t* xt = p.x_sum(row0, b);
    __m256i sum[Rows][2];
    for (int r = 0; r < Rows; ++r) sum[r][0] = sum[r][1] = _mm256_set1_epi32(-12 * xt[r]);
    for (int q0 = 0; q0 < kChunks; q0 += kFp4Chunks16) {
      __m256i s16[Rows][2];
#pragma GCC unroll 4
      for (int q = q0; q < q0 + kFp4Chunks16; ++q) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + q * kChunkBytes<4>));
        const __m256i w[2] = {_mm256_shuffle_epi8(table, _mm256_and_si256(v, low4)),
                              _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4))};
        for (int r = 0; r < Rows; ++r) {
          int32_t x4;
          std::memcpy(&x4, xb + r * kBlock + 4 * q, 4);
          const __m256i x = _mm256_set1_epi32(x4);
          for (int h = 0; h < 2; ++h) {
            const __m256i prod = _mm256_maddubs_epi16(w[h], x);
            s16[r][h] = q == q0 ? prod : _mm256_add_epi16(s16[r][h], prod);
          }
        }
      }
      for (int r = 0; r < Rows; ++r)
        for (int h = 0; h < 2; ++h) sum[r][h] = _mm256_add_epi32(sum[r][h], _mm256_madd_epi16(s16[r][h], ones));
    }
    block_step_avx2<4, Rows>(p, g, b, row0, sum, acc);
  }
  for (int r = 0; r < Rows; ++r) store_columns_avx2(acc[r][0], acc[r][1], p.y + (row0 + r) * p.n + g * kGroup, p.columns(g));
}

// ---- AVX2, many rows (prefill, a server's batched step): each weight decoded once per call ---------
// As the AVX-512 path below: a task takes a column group and walks K in tiles of kTileBlocks2 blocks,
// decoded once (kept in L1) with their block scales, then passes over the tile for every few rows. The
// float accumulators live in a per-thread row buffer (16 ymm registers hold a pass's integer sums, not
// its float sums too); each row's block sums and its fma chain over the blocks are the one-row path's,
// so the bits are the same. (Before, every pass of 6 rows decoded the whole of K again: a 64-row call
// decoded each weight 11 times.)
// Two integer arithmetics, the same sums:
//   int16 activations: the tile's codes widened to int16, one vpmaddwd (16 multiply-adds) and one add
//     per 16 columns and 2 codes of a row;
//   int8 activations with MXFP6 weights: the row's bytes biased to unsigned (x + 128), one vpmaddubsw
//     (32), one vpmaddwd by ones and one add per 8 columns and 4 codes, less 128 times each column's
//     code sum per block (found once per tile). |w| <= 60, so a pair of products stays below 2^15 (no
//     saturation) and the sum is exact. 1.35-1.45x the int16 loop's rate on a Zen 3 (MXINT8's codes,
//     up to 127, could saturate: they keep the int16 loop). MXFP4 (|w| <= 12) takes it too, adding
//     kFp4Chunks16 chunks' pair sums as int16 before each vpmaddwd.

constexpr int kTileBlocks2 = 8;   // K blocks decoded at a time: 1 KiB of int16 (or 512 B of int8) per block
constexpr int kChunkShorts = 64;  // a chunk as int16: [pair 2q, pair 2q + 1] x [the two ColumnOrder halves] x 16
constexpr int kChunkBytes8 = 64;  // a chunk as int8: [the two ColumnOrder halves] x 8 columns x 4 codes
// Calls with at least this many rows take this path: where it was faster on a Zen 3 at Llama-2-7B's MLP
// shape (MXFP6 1.06-1.11x at 16 rows, 0.91-0.95x at 8; MXINT8, whose one-row kernel's chunks cost it more
// passes of loads, 1.14-1.15x at 8 rows; docs/benchmarks.md).
// MXFP4 from 5 rows since its 4 chunks in int16 (2026-12-02, Zen 3: 1.11x / 1.11x at 5 rows, 1.18-1.22x at 6
// and 7, 0.94x / 1.09x at 4).
template <int WBits>
constexpr int kGemmMinRows2 = WBits == 6 ? 16 : WBits == 4 ? 5 : 8;

// The integer step of a tile: int16 (Int8 false) or biased int8 activations (MXFP6 and MXFP4 weights).
template <bool Int8>
struct Avx2Tile {
  static constexpr int kRows = Int8 ? 4 : 3;  // rows per pass: their integer sums, the chunk's weights and
                                              // the broadcasts fill the 16 registers without spills
  alignas(32) std::conditional_t<Int8, int8_t, int16_t> codes[kTileBlocks2 * kChunks * kChunkShorts];
  alignas(32) float ws[kTileBlocks2 * kGroup];      // block scales, ColumnOrder
  alignas(32) int32_t bias[kTileBlocks2 * kGroup];  // Int8: 128 x each column's code sum, ColumnOrder
};

// A chunk's two registers of int8 weights (each column's 4 codes in a 32-bit lane, ColumnOrder) into the
// tile at `at`, their codes added to each column's sums.
__attribute__((target("avx2,fma"))) inline void keep_int8_avx2(const __m256i h[2], int8_t* at, __m256i sums[2]) {
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int i = 0; i < 2; ++i) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(at + 32 * i), h[i]);
    sums[i] = _mm256_add_epi32(sums[i], _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, h[i]), ones16));
  }
}

// Blocks b0 .. b0 + count - 1 of group g, decoded into t (Four: layout planes8, already in the tile's order;
// MXFP4 is in that order too: each register's nibbles through the signed lookup).
template <int WBits, bool Planes, bool Int8, bool Four>
__attribute__((target("avx2,fma"))) void decode_group_avx2(const Problem<WBits>& p, int64_t g, int64_t b0,
                                                           int64_t count, Avx2Tile<Int8>& t) {
  for (int64_t b = 0; b < count; ++b) {
    __m256 scale[2];
    scales_avx2<WBits>(p.exponents(g, b0 + b), scale);
    _mm256_store_ps(t.ws + b * kGroup, scale[0]);
    _mm256_store_ps(t.ws + b * kGroup + 8, scale[1]);
    const uint8_t* blk = p.block(g, b0 + b);
    prefetch_ahead<WBits, 1024>(blk);
    __m256i sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    if constexpr (WBits == 4) {
      static_assert(Int8, "MXFP4 takes int8 activations");
      const __m256i low4 = _mm256_set1_epi8(15);
      const __m256i table = _mm256_load_si256(reinterpret_cast<const __m256i*>(kFp4.weight));
      for (int q = 0; q < kChunks; ++q) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + q * kChunkBytes<4>));
        const __m256i h[2] = {_mm256_shuffle_epi8(table, _mm256_and_si256(v, low4)),
                              _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4))};
        keep_int8_avx2(h, t.codes + (b * kChunks + q) * kChunkBytes8, sums);
      }
    } else {
#pragma GCC unroll 4
      for (int q2 = 0; q2 < kChunks; q2 += 2) {
        __m256i w8[4];
        two_chunks_avx2<WBits, Planes>(blk, q2, w8);
        for (int c = 0; c < 2; ++c) {  // chunk q2 + c: code pairs in w8[2c] and w8[2c + 1]
          if constexpr (Int8) {  // each column's 4 codes in one 32-bit lane, in ColumnOrder
            const __m256i h[2] = {Four ? w8[2 * c] : _mm256_unpacklo_epi16(w8[2 * c], w8[2 * c + 1]),
                                  Four ? w8[2 * c + 1] : _mm256_unpackhi_epi16(w8[2 * c], w8[2 * c + 1])};
            keep_int8_avx2(h, t.codes + (b * kChunks + q2 + c) * kChunkBytes8, sums);
          } else {
            for (int i = 0; i < 2; ++i) {
              __m256i w16[2];
              widen_avx2(w8[2 * c + i], w16);
              int16_t* at = t.codes + (b * kChunks + q2 + c) * kChunkShorts + 32 * i;
              _mm256_store_si256(reinterpret_cast<__m256i*>(at), w16[0]);
              _mm256_store_si256(reinterpret_cast<__m256i*>(at + 16), w16[1]);
            }
          }
        }
      }
    }
    if constexpr (Int8)
      for (int i = 0; i < 2; ++i)
        _mm256_store_si256(reinterpret_cast<__m256i*>(t.bias + b * kGroup + 8 * i), _mm256_slli_epi32(sums[i], 7));
  }
}

// Rows row0 .. row0 + Rows - 1 over the tile's blocks b0 .. b0 + count - 1, their float accumulators in
// acc ([rows of the call, 16], ColumnOrder).
template <int WBits, bool Int8, int Rows>
__attribute__((target("avx2,fma"))) void gemm_pass_avx2(const Problem<WBits>& p, const Avx2Tile<Int8>& t, float* acc,
                                                        int64_t row0, int64_t b0, int64_t count) {
  for (int64_t b = b0; b < b0 + count; ++b) {
    __m256i sum[Rows][2];
    for (int r = 0; r < Rows; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
    if constexpr (Int8) {
      const uint8_t* xb = p.x_biased(row0, b);  // row r's 32 biased activations at xb + 32 r
      const int8_t* d = t.codes + (b - b0) * kChunks * kChunkBytes8;
      const __m256i ones = _mm256_set1_epi16(1);
      if constexpr (WBits == 4) {  // kFp4Chunks16 chunks' pair sums in int16, then one widening
        for (int q0 = 0; q0 < kChunks; q0 += kFp4Chunks16)
          for (int r = 0; r < Rows; ++r) {
            __m256i pairs[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 4
            for (int q = q0; q < q0 + kFp4Chunks16; ++q) {
              int32_t x4;
              std::memcpy(&x4, xb + r * kBlock + 4 * q, 4);
              const __m256i v = _mm256_set1_epi32(x4);
              for (int h = 0; h < 2; ++h) {
                const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(d + q * kChunkBytes8 + 32 * h));
                pairs[h] = _mm256_add_epi16(pairs[h], _mm256_maddubs_epi16(v, w));
              }
            }
            for (int h = 0; h < 2; ++h) sum[r][h] = _mm256_add_epi32(sum[r][h], _mm256_madd_epi16(pairs[h], ones));
          }
      } else {
#pragma GCC unroll 1  // unrolled, GCC hoisted every chunk's products and spilled them
        for (int q = 0; q < kChunks; ++q) {
          const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(d + q * kChunkBytes8));
          const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(d + q * kChunkBytes8 + 32));
          for (int r = 0; r < Rows; ++r) {
            int32_t x4;
            std::memcpy(&x4, xb + r * kBlock + 4 * q, 4);
            const __m256i v = _mm256_set1_epi32(x4);
            sum[r][0] = _mm256_add_epi32(sum[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(v, w0), ones));
            sum[r][1] = _mm256_add_epi32(sum[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(v, w1), ones));
          }
        }
      }
      const __m256i* bias = reinterpret_cast<const __m256i*>(t.bias + (b - b0) * kGroup);
      for (int r = 0; r < Rows; ++r)
        for (int h = 0; h < 2; ++h) sum[r][h] = _mm256_sub_epi32(sum[r][h], _mm256_load_si256(bias + h));
    } else {
      const int16_t* xb = p.x(row0, b);  // row r's 32 activations at xb + 32 r
      const int16_t* d = t.codes + (b - b0) * kChunks * kChunkShorts;
#pragma GCC unroll 1
      for (int q = 0; q < kChunks; ++q) {
        const __m256i* w = reinterpret_cast<const __m256i*>(d + q * kChunkShorts);
        const __m256i w00 = _mm256_load_si256(w), w01 = _mm256_load_si256(w + 1);
        const __m256i w10 = _mm256_load_si256(w + 2), w11 = _mm256_load_si256(w + 3);
        for (int r = 0; r < Rows; ++r) {
          int32_t x0, x1;
          std::memcpy(&x0, xb + r * kBlock + 4 * q, 4);
          std::memcpy(&x1, xb + r * kBlock + 4 * q + 2, 4);
          const __m256i v0 = _mm256_set1_epi32(x0), v1 = _mm256_set1_epi32(x1);
          sum[r][0] = _mm256_add_epi32(sum[r][0], _mm256_madd_epi16(w00, v0));
          sum[r][1] = _mm256_add_epi32(sum[r][1], _mm256_madd_epi16(w01, v0));
          sum[r][0] = _mm256_add_epi32(sum[r][0], _mm256_madd_epi16(w10, v1));
          sum[r][1] = _mm256_add_epi32(sum[r][1], _mm256_madd_epi16(w11, v1));
        }
      }
    }
    const float* xs = p.x_scale(row0, b);
    const __m256 s0 = _mm256_load_ps(t.ws + (b - b0) * kGroup), s1 = _mm256_load_ps(t.ws + (b - b0) * kGroup + 8);
    for (int r = 0; r < Rows; ++r) {
      float* a = acc + (row0 + r) * kGroup;
      const __m256 x = _mm256_set1_ps(xs[r]);
      _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][0]), _mm256_mul_ps(s0, x), _mm256_loadu_ps(a)));
      _mm256_storeu_ps(a + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][1]), _mm256_mul_ps(s1, x), _mm256_loadu_ps(a + 8)));
    }
  }
}

template <int WBits, bool Int8, size_t... Rows>
constexpr auto gemm_by_rows_avx2(std::index_sequence<Rows...>) {
  using Pass = void (*)(const Problem<WBits>&, const Avx2Tile<Int8>&, float*, int64_t, int64_t, int64_t);
  return std::array<Pass, sizeof...(Rows)>{gemm_pass_avx2<WBits, Int8, static_cast<int>(Rows + 1)>...};
}

// One task of the AVX2 many-row path: column group `index`, tile by tile of K, every row in passes of up
// to Avx2Tile::kRows (the rows split evenly), then the accumulators back from ColumnOrder into y.
template <int WBits, bool Planes, bool Int8, bool Four = false>
__attribute__((target("avx2,fma"))) void gemm_group_avx2(void* user, size_t index) {
  const Problem<WBits>& p = *static_cast<const Problem<WBits>*>(user);
  constexpr int kRows = Avx2Tile<Int8>::kRows;
  static constexpr auto passes_by_rows = gemm_by_rows_avx2<WBits, Int8>(std::make_index_sequence<kRows>());
  const auto g = static_cast<int64_t>(index);
  thread_local Avx2Tile<Int8> tile;
  thread_local std::vector<float> acc;  // [rows, 16]: reused call after call
  acc.assign(p.m * kGroup, 0.0f);
  const int64_t passes = (p.m + kRows - 1) / kRows;
  for (int64_t b0 = 0; b0 < p.kb; b0 += kTileBlocks2) {
    const int64_t count = std::min<int64_t>(kTileBlocks2, p.kb - b0);
    decode_group_avx2<WBits, Planes, Int8, Four>(p, g, b0, count, tile);
    for (int64_t i = 0, row = 0; i < passes; ++i) {
      const int64_t rows = (p.m - row) / (passes - i);
      passes_by_rows[rows - 1](p, tile, acc.data(), row, b0, count);
      row += rows;
    }
  }
  for (int64_t r = 0; r < p.m; ++r)
    store_columns_avx2(_mm256_loadu_ps(&acc[r * kGroup]), _mm256_loadu_ps(&acc[r * kGroup + 8]), p.y + r * p.n + g * kGroup,
                       p.columns(g));
}

// The AVX2 many-row task for these weights and activations.
template <int WBits>
void (*gemm_avx2(Layout layout, int activation_bits))(void*, size_t) {
  if constexpr (WBits == 8)
    return gemm_group_avx2<8, false, false>;
  else if constexpr (WBits == 4)  // int8 activations only
    return gemm_group_avx2<4, false, true>;
  else if (layout == kPlanes8)  // int8 activations only
    return gemm_group_avx2<6, true, true, true>;
  else if (layout == kPlanes)
    return activation_bits == 8 ? gemm_group_avx2<6, true, true> : gemm_group_avx2<6, true, false>;
  else
    return activation_bits == 8 ? gemm_group_avx2<6, false, true> : gemm_group_avx2<6, false, false>;
}

// ---- AVX-512 (VNNI, VBMI): 16 columns per register, up to 12 rows per pass --------------------------

constexpr int kRowGroup512 = 12;

// Byte permute indexes that spread a chunk's 48 bytes to 6 per 64-bit lane, and the bit offset of
// each of a lane's 8 codes (VBMI's multishift).
struct ChunkTables {
  alignas(64) uint8_t spread[64], offsets[64];
  ChunkTables() {
    for (int b = 0; b < 64; ++b) {
      spread[b] = static_cast<uint8_t>(6 * (b / 8) + std::min(b % 8, 5));
      offsets[b] = static_cast<uint8_t>(6 * (b % 8));
    }
  }
};
const ChunkTables kChunk;

// A triples chunk's 64 MXFP6 codes looked up in a 64-byte table (the permute reads bits 0-5): each 64-bit lane
// takes the 6 bytes `spread` names, and each of its 8 bytes the 8 bits at its `offsets` entry in them.
__attribute__((target(MXSPD_AVX512_VBMI))) inline __m512i fp6_lookup_avx512(const uint8_t* chunk, const uint8_t* spread,
                                                                            const uint8_t* offsets, const void* table) {
  // 48 bytes by two plain loads: a masked 48-byte load made the whole call 3x slower (AMD EPYC)
  const __m256i head = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
  const __m128i tail = _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 32));
  const __m512i raw = _mm512_inserti64x4(_mm512_castsi256_si512(head), _mm256_castsi128_si256(tail), 1);
  const __m512i codes = _mm512_multishift_epi64_epi8(_mm512_load_si512(offsets),
                                                     _mm512_permutexvar_epi8(_mm512_load_si512(spread), raw));
  return _mm512_permutexvar_epi8(codes, _mm512_load_si512(table));
}

// The integer weights of a triples chunk (int8): byte o is code 4q + 2 (o / 32) + o % 2 of column (o % 32) / 2.
template <int WBits>
__attribute__((target(MXSPD_AVX512_VBMI))) inline __m512i chunk_codes_avx512(const uint8_t* chunk) {
  if constexpr (WBits == 8)
    return _mm512_loadu_si512(chunk);
  else
    return fp6_lookup_avx512(chunk, kChunk.spread, kChunk.offsets, kCodes.weight);
}

// The weights of chunk q as int16: code pair 2q (codes 4q, 4q + 1) of the 16 columns in w0, 2q + 1 in w1.
template <int WBits>
__attribute__((target(MXSPD_AVX512_VBMI))) inline void chunk_avx512(const uint8_t* chunk, __m512i* w0, __m512i* w1) {
  const __m512i v = chunk_codes_avx512<WBits>(chunk);
  *w0 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(v));
  *w1 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(v, 1));
}

// Each 32-bit lane's source for an MXFP4 chunk's codes in column order, one column's 4 codes (4q .. 4q + 3) a
// lane, from planes8's lane order (lanes 4-7 hold columns 8-11, lanes 8-11 columns 4-7).
struct LaneTables {
  alignas(64) uint32_t planes8[16];
  LaneTables() {
    for (int j = 0; j < 16; ++j) planes8[j] = static_cast<uint32_t>(j / 4 == 1 ? j + 4 : j / 4 == 2 ? j - 4 : j);
  }
};
const LaneTables kLanes;
constexpr int64_t kHighHalf = 0x0004000400040004;  // four 16-bit shift counts of 4

// A chunk's codes straight into column order (byte i: column i / 4, code 4q + i % 4), which sits at decoded
// position o = 32 (j / 2) + 2 c + j % 2 of triples (chunk_codes_avx512): MXFP6 by a spread that brings each
// 64-bit lane the 6 bytes holding its two columns' codes (bits 24 L .. 24 L + 23 and 192 + 24 L ..) and the
// multishift's offsets within them; MXINT8 by one byte permute.
struct ColumnTables {
  alignas(64) uint8_t spread[64], offsets[64], int8_order[64];
  ColumnTables() {
    for (int i = 0; i < 64; ++i) {
      const int lane = i / 8, column = i / 4, j = i % 4, t = 2 * (column % 2) + j % 2;
      const int b = i % 8;  // the lane's bytes: 3 at 3 L, then 3 at 24 + 3 L (that last one twice more)
      spread[i] = static_cast<uint8_t>(b < 3 ? 3 * lane + b : 24 + 3 * lane + std::min(b - 3, 2));
      offsets[i] = static_cast<uint8_t>(24 * (j / 2) + 6 * t);
      int8_order[i] = static_cast<uint8_t>(32 * (j / 2) + 2 * column + j % 2);
    }
  }
};
const ColumnTables kColumns;

// The offset that makes a width's integer weights unsigned for vpdpbusd: |w| <= 12 (MXFP4, 2 x value), 60
// (MXFP6 E2M3, 8 x value), 128 (MXINT8).
template <int WBits>
constexpr int kOffset = WBits == 4 ? 12 : WBits == 6 ? 64 : 128;

// The signed integer weights of chunk q, one column's 4 codes (4q .. 4q + 3) in each 32-bit lane, columns
// in order: what vpdpbusd multiplies by a row's 4 activations. MXFP4 from planes8's nibbles by one 16-entry
// lookup per 128-bit lane; MXFP6 and MXINT8 by the column tables.
template <int WBits>
__attribute__((target(MXSPD_AVX512_VBMI))) inline __m512i chunk_bytes_avx512(const uint8_t* chunk) {
  if constexpr (WBits == 4) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk)), low4 = _mm256_set1_epi8(15);
    const __m512i nibbles = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, low4)),
                                               _mm256_and_si256(_mm256_srli_epi16(v, 4), low4), 1);
    const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kFp4.weight)));
    return _mm512_permutexvar_epi32(_mm512_load_si512(kLanes.planes8), _mm512_shuffle_epi8(table, nibbles));
  } else if constexpr (WBits == 8) {
    return _mm512_permutexvar_epi8(_mm512_load_si512(kColumns.int8_order), _mm512_loadu_si512(chunk));
  } else {
    return fp6_lookup_avx512(chunk, kColumns.spread, kColumns.offsets, kCodes.weight);
  }
}

// MXFP4 chunk q's 64 weights + 12 (unsigned) for the few-row loop in three instructions: the chunk's 32 bytes
// in both halves, the upper half's 16-bit words shifted right by 4 (each byte's high nibble into its low 4
// bits), then vpermb on the 16 values four times over (an index's bits 4-5, whatever they hold, then pick
// the same value: no mask). The lanes are those of chunk_bytes_avx512<4> before its permute: lane j holds
// column planes8[j] (columns 4-7 and 8-11 swapped), which the loop undoes once per block on the scales and
// once per call on its sums. (Against the nibbles' two masks, a shift, an insert and the permute per chunk:
// 7 instructions.)
__attribute__((target(MXSPD_AVX512_VBMI))) inline __m512i fp4_lanes_avx512(const uint8_t* chunk) {
  const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk)));
  const __m512i nibbles = _mm512_srlv_epi16(both, _mm512_set_epi64(kHighHalf, kHighHalf, kHighHalf, kHighHalf, 0, 0, 0, 0));
  return _mm512_permutexvar_epi8(nibbles, _mm512_load_si512(kFp4.offset));
}

// MXFP6 (triples) and MXINT8 chunk q's 64 weights + kOffset (unsigned), as chunk_bytes_avx512 orders them:
// MXFP6 looked up in the offset table, MXINT8's signed bytes with their sign bit flipped (w + 128 as a byte).
template <int WBits>
__attribute__((target(MXSPD_AVX512_VBMI))) inline __m512i offset_columns_avx512(const uint8_t* chunk) {
  if constexpr (WBits == 8)
    return _mm512_xor_si512(chunk_bytes_avx512<8>(chunk), _mm512_set1_epi8(static_cast<char>(0x80)));
  else
    return fp6_lookup_avx512(chunk, kColumns.spread, kColumns.offsets, kCodes.offset);
}

// The 16 columns' block scales; the table only where a result is not a normal float (rare).
template <int WBits>
__attribute__((target(MXSPD_AVX512_VBMI))) inline __m512 scales_avx512(const uint8_t* e8) {
  constexpr int shift = kScaleShift<WBits>;
  const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(e8)));
  if (_mm512_cmpgt_epu32_mask(_mm512_sub_epi32(e, _mm512_set1_epi32(shift + 1)), _mm512_set1_epi32(253 - shift)))
    return _mm512_i32gather_ps(e, scales<WBits>(), 4);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(shift)), 23));
}

template <int WBits, int Rows>
__attribute__((target(MXSPD_AVX512_VBMI))) void group_avx512(const Problem<WBits>& p, int64_t g, int64_t row0) {
  constexpr int kChains = Rows <= 2 ? 2 : 1;  // integer sums are exact: split only to shorten a lone row's chain
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.kb; ++b) {
    const uint8_t* blk = p.block(g, b);
    prefetch_ahead<WBits, 4096>(blk);
    const int16_t* xb = p.x(row0, b);  // row r's 32 activations at xb + 32 r
    __m512i sum[Rows][kChains];
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < kChains; ++c) sum[r][c] = _mm512_setzero_si512();
    for (int q = 0; q < kChunks; ++q) {
      __m512i w0, w1;
      chunk_avx512<WBits>(blk + q * kChunkBytes<WBits>, &w0, &w1);
      for (int r = 0; r < Rows; ++r) {
        int32_t x0, x1;
        std::memcpy(&x0, xb + r * kBlock + 4 * q, 4);
        std::memcpy(&x1, xb + r * kBlock + 4 * q + 2, 4);
        sum[r][0] = _mm512_dpwssd_epi32(sum[r][0], w0, _mm512_set1_epi32(x0));
        sum[r][kChains - 1] = _mm512_dpwssd_epi32(sum[r][kChains - 1], w1, _mm512_set1_epi32(x1));
      }
    }
    const __m512 ws = scales_avx512<WBits>(p.exponents(g, b));
    const float* xs = p.x_scale(row0, b);
    for (int r = 0; r < Rows; ++r) {
      const __m512i s = kChains == 2 ? _mm512_add_epi32(sum[r][0], sum[r][kChains - 1]) : sum[r][0];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(ws, _mm512_set1_ps(xs[r])), acc[r]);
    }
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << p.columns(g)) - 1);
  for (int r = 0; r < Rows; ++r) _mm512_mask_storeu_ps(p.y + (row0 + r) * p.n + g * kGroup, valid, acc[r]);
}

// int8 activations, one row to a few, by vpdpbusd (every width): each chunk's weights + kOffset (unsigned;
// MXFP4 fp4_lanes_avx512, else offset_columns_avx512) times each row's 4 signed activations, less kOffset x
// the row's block sum (found once per call, shared by every column): the block's exact integer sums (at most
// 8 x 4 x 255 x 127 before the correction), the bits of every other path. MXFP4's lanes hold planes8's
// column order, undone once per block on the scales and once per call on the sums. (Before, MXFP4 decoded
// signed weights for biased activations, one more vpdpbusd a chunk for its code sums; MXFP6 and MXINT8 widened
// the weights to int16 for two vpdpwssd a chunk and row.)
template <int WBits, int Rows>
__attribute__((target(MXSPD_AVX512_VBMI))) void group_avx512_int8(const Problem<WBits>& p, int64_t g, int64_t row0) {
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i lanes = _mm512_load_si512(kLanes.planes8);  // MXFP4: lane j's column (an involution)
  for (int64_t b = 0; b < p.kb; ++b) {
    const uint8_t* blk = p.block(g, b);
    prefetch_ahead<WBits, 4096>(blk);
    const int8_t* xb = p.x_bytes(row0, b);  // row r's 32 activations at xb + 32 r
    __m512i sum[Rows];
    for (int r = 0; r < Rows; ++r) sum[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int q = 0; q < kChunks; ++q) {
      const uint8_t* chunk = blk + q * kChunkBytes<WBits>;
      __m512i w;
      if constexpr (WBits == 4)
        w = fp4_lanes_avx512(chunk);
      else
        w = offset_columns_avx512<WBits>(chunk);
      for (int r = 0; r < Rows; ++r) {
        int32_t x4;
        std::memcpy(&x4, xb + r * kBlock + 4 * q, 4);
        sum[r] = _mm512_dpbusd_epi32(sum[r], w, _mm512_set1_epi32(x4));
      }
    }
    __m512 ws = scales_avx512<WBits>(p.exponents(g, b));
    if constexpr (WBits == 4) ws = _mm512_permutexvar_ps(lanes, ws);  // each lane's column's scale
    const float* xs = p.x_scale(row0, b);
    const int32_t* xt = p.x_sum(row0, b);
    for (int r = 0; r < Rows; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum[r], _mm512_set1_epi32(kOffset<WBits> * xt[r]))),
                               _mm512_mul_ps(ws, _mm512_set1_ps(xs[r])), acc[r]);
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << p.columns(g)) - 1);
  for (int r = 0; r < Rows; ++r)
    _mm512_mask_storeu_ps(p.y + (row0 + r) * p.n + g * kGroup, valid,
                          WBits == 4 ? _mm512_permutexvar_ps(lanes, acc[r]) : acc[r]);
}

// ---- AVX-512, many rows (prefill, a server's batched step): each weight decoded once per call ------
// A task takes two column groups and walks K in tiles of kTileBlocks blocks: it decodes a tile's blocks
// once (16 KiB of int16 or int8 codes, which stay in L1 while every row passes over them), then passes
// over them for every kGemmRows rows, each pass's float accumulators carried from tile to tile in y.
// (Decoding all of K at once left 256-688 KiB to stream from L2 in every pass: the tiles made the path
// 1.26-1.36x faster at 128 rows of Llama-2-7B's MLP shapes on an Intel Xeon, docs/benchmarks.md.) Two
// integer arithmetics, the same sums:
//   int16 activations: per chunk, 4 weight loads and 2 broadcasts per row feed 4 vpdpwssd per row
//     (16 columns x 2 codes each);
//   int8 activations (every weight width): the row's bytes biased to unsigned (x + 128), one vpdpbusd
//     (16 columns x 4 codes) per group, chunk and row, each sum starting from -128 times its column's
//     code sum in the block (found once per tile). vpdpbusd adds its four products into int32 without
//     saturating, so MXINT8's codes (-128 .. 127) take it too, and MXFP4 (planes8's nibbles).
// Each row's integer block sums and the float operations after them, block by block in order, are the
// same as on the other paths: the same bits whatever the path (batch invariance).

constexpr int kGemmRows = 6;     // rows per pass: 6 x 2 groups of integer sums and float accumulators
// K blocks decoded at a time: 16 KiB of a group pair's codes either way (int16: 2 KiB a block). int8 was 8
// blocks too: 16 made 128 rows 1.04-1.07x faster at Llama-2-7B's MLP shape and 64 rows of SmolLM2's 1.04-1.16x
// on a Zen 5 (fewer passes, each loading and storing its float accumulators once per tile; docs/benchmarks.md).
template <bool Int8>
constexpr int kTileBlocks = Int8 ? 16 : 8;
// Calls with at least this many rows take this path: where it was faster on an Intel Xeon at Llama-2-7B's
// shapes (MXFP6 1.19-1.24x at 16 and 20 rows, mixed at 12; MXINT8, whose chunks cost the one-row kernel
// only a widening, 0.99-1.16x at 32 rows, slower at 16).
template <int WBits>
constexpr int kGemmMinRows = WBits == 8 ? 32 : 16;
// int8 activations: where the many-row loop is faster than the few-row one on an AMD Zen 4, at four shapes
// (576 x 1536, 1536 x 576, 2048 x 8192, 4096 x 11008; docs/benchmarks.md, two runs): MXFP6 1.01-1.19x at 12
// rows, 0.76-1.01x at 8; MXINT8 1.10-1.25x at 24, 0.90-1.22x at 16; MXFP4, whose few-row kernel decodes with
// one lookup, 1.04-1.06x at 64 rows, 0.95x at 32.
template <int WBits>
constexpr int kGemmMinRows8 = WBits == 6 ? 12 : WBits == 8 ? 24 : 64;
// int8 activations below those: the few-row loop on bytes (group_avx512_int8) from these rows, else the int16
// loop on the same integers. On a Zen 4, MXINT8 from memory at SmolLM2's shapes (576 x 1536, 1536 x 576) ran
// 0.92-0.93x the int16 loop at one row, 0.95-1.00x at 2, 0.98-1.03x at 3, 1.00-1.20x at 4 and 1.24-1.29x at 8;
// MXFP6 1.02-1.20x at one row and 1.13-1.36x at 2 (its int16 loop widens more); MXFP4 has no int16 loop.
template <int WBits>
constexpr int kFewRows8 = WBits == 8 ? 4 : 1;
constexpr int kPairShorts = 4 * 32;  // a chunk of a group pair as int16: [w0 g0, w0 g1, w1 g0, w1 g1] x 32
constexpr int kPairBytes8 = 2 * 64;  // as int8: [g0, g1] x 16 columns x 4 codes

// A tile of a group pair, decoded: the codes [count, 8 chunks, a chunk of the pair] and the block scales
// [count, 2 groups, 16 columns] (found once here, not again in every pass); int8: each row's integer sums'
// start, -128 x each column's code sum [count, 2 groups, 16 columns].
template <bool Int8>
struct Tile512 {
  alignas(64) std::conditional_t<Int8, int8_t, int16_t> codes[kTileBlocks<Int8> * kChunks * (Int8 ? kPairBytes8 : kPairShorts)];
  alignas(64) float ws[kTileBlocks<Int8> * 2 * kGroup];
  alignas(64) int32_t start[Int8 ? kTileBlocks<Int8> * 2 * kGroup : 1];
  int e8_lowest, e8_highest;  // its E8M0 scale bytes' range
};

// Blocks b0 .. b0 + count - 1 of groups g0 (and g0 + 1), decoded into t.
template <int WBits, bool Int8>
__attribute__((target(MXSPD_AVX512_VBMI))) void decode_pair(const Problem<WBits>& p, int64_t g0, int groups,
                                                           int64_t b0, int64_t count, Tile512<Int8>& t) {
  __m128i lowest = _mm_set1_epi8(-1), highest = _mm_setzero_si128();
  for (int64_t b = 0; b < count; ++b)
    for (int h = 0; h < groups; ++h) {
      const __m128i e8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.exponents(g0 + h, b0 + b)));
      const __mmask16 real = static_cast<__mmask16>((1u << p.columns(g0 + h)) - 1);  // a padded column's is 0
      lowest = _mm_mask_min_epu8(lowest, real, lowest, e8), highest = _mm_mask_max_epu8(highest, real, highest, e8);
      _mm512_store_ps(t.ws + (2 * b + h) * kGroup, scales_avx512<WBits>(p.exponents(g0 + h, b0 + b)));
      const uint8_t* blk = p.block(g0 + h, b0 + b);
      prefetch_ahead<WBits, 4096>(blk);
      __m512i code_sums = _mm512_setzero_si512();  // 128 x each column's codes, by vpdpbusd with bytes of 128
      for (int q = 0; q < kChunks; ++q) {
        if constexpr (Int8) {
          const __m512i w = chunk_bytes_avx512<WBits>(blk + q * kChunkBytes<WBits>);
          _mm512_store_si512(t.codes + (b * kChunks + q) * kPairBytes8 + h * 64, w);
          code_sums = _mm512_dpbusd_epi32(code_sums, _mm512_set1_epi8(static_cast<char>(0x80)), w);
        } else {
          __m512i w0, w1;
          chunk_avx512<WBits>(blk + q * kChunkBytes<WBits>, &w0, &w1);
          int16_t* at = t.codes + (b * kChunks + q) * kPairShorts;
          _mm512_store_si512(at + h * 32, w0);
          _mm512_store_si512(at + (2 + h) * 32, w1);
        }
      }
      if constexpr (Int8) _mm512_store_si512(t.start + (2 * b + h) * kGroup, _mm512_sub_epi32(_mm512_setzero_si512(), code_sums));
    }
  alignas(16) uint8_t lo[16], hi[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(lo), lowest);
  _mm_store_si128(reinterpret_cast<__m128i*>(hi), highest);
  t.e8_lowest = *std::min_element(lo, lo + 16), t.e8_highest = *std::max_element(hi, hi + 16);
}

// The float step's product ws * xs as an integer add ("exponent products"): ws is a power of two, so where ws,
// xs and their product are normal floats, the product's bits are xs's plus ws's less the exponent bias: one
// vpaddd, where vmulps shares vpdpbusd's two pipes (benchmarks.issue_rate's `mx block`: its rate 1.16x with
// vpaddd on a Zen 5). Taken per tile where the call's activation scales (none zero: a block of zeros is
// rare) and the tile's weight scales keep every product a normal float; else vmulps: the same bits.
template <int WBits, bool Int8>
bool exponent_products(const Problem<WBits>& p, const Tile512<Int8>& t) {
  constexpr int bias = 127 + kScaleShift<WBits>;  // ws = 2^(e8 - bias)
  return p.xs_normal && t.e8_lowest > kScaleShift<WBits> && t.e8_highest < 255 &&
         p.xs_lowest + t.e8_lowest - bias >= 1 && p.xs_highest + t.e8_highest - bias <= 254;
}

// A block's ws * xs for one row: the exponents' integer add (Exp; unbiased: ws's bits less 127 << 23) or a
// multiply, as exponent_products chose.
template <bool Exp>
__attribute__((target(MXSPD_AVX512_VBMI))) inline __m512 scale_product(__m512 scale, __m512i unbiased, float xs) {
  if constexpr (Exp) return _mm512_castsi512_ps(_mm512_add_epi32(unbiased, _mm512_castps_si512(_mm512_set1_ps(xs))));
  return _mm512_mul_ps(scale, _mm512_set1_ps(xs));
}

// Rows row0 .. row0 + Rows - 1 over blocks b0 .. b0 + count - 1 (decoded in t), their accumulators read
// from y unless b0 is the first block, written back to y.
template <int WBits, bool Int8, int Rows, int Groups, bool Exp>
__attribute__((target(MXSPD_AVX512_VBMI))) void gemm_pass(const Problem<WBits>& p, int64_t g0, const Tile512<Int8>& t,
                                                         int64_t row0, int64_t b0, int64_t count) {
  __m512 acc[Rows][Groups];
  __mmask16 valid[Groups];
  for (int h = 0; h < Groups; ++h) {
    valid[h] = static_cast<__mmask16>((1u << p.columns(g0 + h)) - 1);
    for (int r = 0; r < Rows; ++r)
      acc[r][h] = b0 == 0 ? _mm512_setzero_ps()
                          : _mm512_maskz_loadu_ps(valid[h], p.y + (row0 + r) * p.n + (g0 + h) * kGroup);
  }
  for (int64_t b = b0; b < b0 + count; ++b) {
    __m512i sum[Rows][Groups];
    if constexpr (Int8) {
      const uint8_t* xb = p.x_biased(row0, b);  // row r's 32 biased activations at xb + 32 r
      const int8_t* d = t.codes + (b - b0) * kChunks * kPairBytes8;
      for (int h = 0; h < Groups; ++h) {
        const __m512i start = _mm512_load_si512(t.start + (2 * (b - b0) + h) * kGroup);
        for (int r = 0; r < Rows; ++r) sum[r][h] = start;
      }
#pragma GCC unroll 8
      for (int q = 0; q < kChunks; ++q) {
        __m512i w[Groups];
        for (int h = 0; h < Groups; ++h) w[h] = _mm512_load_si512(d + q * kPairBytes8 + h * 64);
        for (int r = 0; r < Rows; ++r) {
          int32_t x4;
          std::memcpy(&x4, xb + r * kBlock + 4 * q, 4);
          const __m512i v = _mm512_set1_epi32(x4);
          for (int h = 0; h < Groups; ++h) sum[r][h] = _mm512_dpbusd_epi32(sum[r][h], v, w[h]);
        }
      }
    } else {
      const int16_t* xb = p.x(row0, b);  // row r's 32 activations at xb + 32 r
      const int16_t* d = t.codes + (b - b0) * kChunks * kPairShorts;
      for (int r = 0; r < Rows; ++r)
        for (int h = 0; h < Groups; ++h) sum[r][h] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int q = 0; q < kChunks; ++q) {
        __m512i w0[Groups], w1[Groups];
        for (int h = 0; h < Groups; ++h) {
          w0[h] = _mm512_load_si512(d + q * kPairShorts + h * 32);
          w1[h] = _mm512_load_si512(d + q * kPairShorts + (2 + h) * 32);
        }
        for (int r = 0; r < Rows; ++r) {
          int32_t x0, x1;
          std::memcpy(&x0, xb + r * kBlock + 4 * q, 4);
          std::memcpy(&x1, xb + r * kBlock + 4 * q + 2, 4);
          const __m512i v0 = _mm512_set1_epi32(x0), v1 = _mm512_set1_epi32(x1);
          for (int h = 0; h < Groups; ++h)
            sum[r][h] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(sum[r][h], w0[h], v0), w1[h], v1);
        }
      }
    }
    const float* xs = p.x_scale(row0, b);
    for (int h = 0; h < Groups; ++h) {
      const __m512 scale = _mm512_load_ps(t.ws + (2 * (b - b0) + h) * kGroup);
      const __m512i unbiased = _mm512_sub_epi32(_mm512_castps_si512(scale), _mm512_set1_epi32(127 << 23));
      for (int r = 0; r < Rows; ++r)
        acc[r][h] =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][h]), scale_product<Exp>(scale, unbiased, xs[r]), acc[r][h]);
    }
  }
  for (int h = 0; h < Groups; ++h)
    for (int r = 0; r < Rows; ++r) _mm512_mask_storeu_ps(p.y + (row0 + r) * p.n + (g0 + h) * kGroup, valid[h], acc[r][h]);
}

template <int WBits, bool Int8, int Groups, bool Exp, size_t... Rows>
constexpr auto gemm_by_rows(std::index_sequence<Rows...>) {
  using Pass = void (*)(const Problem<WBits>&, int64_t, const Tile512<Int8>&, int64_t, int64_t, int64_t);
  return std::array<Pass, sizeof...(Rows)>{gemm_pass<WBits, Int8, static_cast<int>(Rows + 1), Groups, Exp>...};
}

// One task of the many-row path: column groups 2i and 2i + 1 (the last alone where their count is odd),
// tile by tile of K: the tile decoded once, then every row in passes of up to kGemmRows, the rows split
// evenly.
template <int WBits, bool Int8>
void gemm_tile(void* user, size_t index) {
  const Problem<WBits>& p = *static_cast<const Problem<WBits>*>(user);
  static constexpr std::array<decltype(gemm_by_rows<WBits, Int8, 1, false>(std::make_index_sequence<kGemmRows>())), 4>
      passes_by{gemm_by_rows<WBits, Int8, 1, false>(std::make_index_sequence<kGemmRows>()),
                gemm_by_rows<WBits, Int8, 2, false>(std::make_index_sequence<kGemmRows>()),
                gemm_by_rows<WBits, Int8, 1, true>(std::make_index_sequence<kGemmRows>()),
                gemm_by_rows<WBits, Int8, 2, true>(std::make_index_sequence<kGemmRows>())};  // [2 exp + groups - 1]
  const int64_t g0 = 2 * static_cast<int64_t>(index);
  const int groups = static_cast<int>(std::min<int64_t>(2, (p.n + kGroup - 1) / kGroup - g0));
  thread_local Tile512<Int8> t;
  const int64_t passes = (p.m + kGemmRows - 1) / kGemmRows;
  for (int64_t b0 = 0; b0 < p.kb; b0 += kTileBlocks<Int8>) {
    const int64_t count = std::min<int64_t>(kTileBlocks<Int8>, p.kb - b0);
    decode_pair(p, g0, groups, b0, count, t);
    const auto& pass = passes_by[2 * exponent_products(p, t) + groups - 1];
    for (int64_t i = 0, row = 0; i < passes; ++i) {
      const int64_t rows = (p.m - row) / (passes - i);
      pass[rows - 1](p, g0, t, row, b0, count);
      row += rows;
    }
  }
}
// ---- AMX (Intel Xeon since Sapphire Rapids), many rows of int8 activations ----------------------------
// The AVX-512 many-row task with its integer sums from AMX's tiles: decode_pair's signed bytes of a block are
// AMX's B operand as they lie (8 rows, one a chunk: 16 columns x 4 codes, 128 bytes apart in the tile), and 16
// rows' 32 signed activations of a block are its A operand (32 bytes apart, as Activations stores them), so one
// tdpbssd (16 rows x 16 columns x 32 multiply-adds, 32 vpdpbusd's worth) gives a block's exact int32 sums: the
// integers every other path finds. They go to L1 (tilestored), and each row's float step is gemm_pass's: the
// same bits. A pass is 16 rows of one group, its 16 float accumulators in registers; two blocks are in flight
// (tiles 0-2 and 3-5), so one block's float steps run while the next block's tdpbssd does.
constexpr int kAmxRows = 16;  // an A tile's rows (the last pass's rows past the call are read, never stored)
// From this many rows (every width) where AMX runs: at 16-24 rows the vpdpbusd loop was as fast or faster on an
// Intel Xeon (0.87-1.04x at SmolLM2's 576 x 1536, 0.96-1.22x at 2048 x 8192: a pass's tile traffic is the
// same for 4 rows as for 16), at 32 AMX 1.07-1.48x (docs/benchmarks.md).
constexpr int kAmxMinRows = 32;

// tilestored of tile N to one pass's sums: as _tile_stored, but naming the memory it writes (the intrinsic
// clobbers all memory, which kept the 16 float accumulators in memory: a load and a store more per row and block).
#define MXSPD_TILE_STORE(N, sums)                                                                      \
  __asm__ volatile("tilestored %%tmm" #N ", (%1,%2,1)" : "=m"(*reinterpret_cast<int32_t(*)[kAmxRows * kGroup]>(sums)) \
                   : "r"(sums), "r"(64L))

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0 and 3: C (16 rows x 16 int32 sums); 1 and 4: A (16 rows x 32 activations); 2 and 5: B (8 rows x 64).
inline TileConfig amx_config() {
  TileConfig c;
  for (int base : {0, 3}) {
    c.rows[base] = kAmxRows, c.colsb[base] = 64;
    c.rows[base + 1] = kAmxRows, c.colsb[base + 1] = kBlock;
    c.rows[base + 2] = kChunks, c.colsb[base + 2] = 64;
  }
  return c;
}

// A block's float step for Rows rows from its int32 sums (16 per row, in L1): gemm_pass's.
template <int Rows, bool Exp>
__attribute__((target(MXSPD_AVX512_VBMI))) inline void amx_float_step(const int32_t* sums, const float* ws,
                                                                      const float* xs, __m512* acc) {
  const __m512 scale = _mm512_load_ps(ws);
  const __m512i unbiased = _mm512_sub_epi32(_mm512_castps_si512(scale), _mm512_set1_epi32(127 << 23));
  for (int r = 0; r < Rows; ++r)
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + r * kGroup)),
                             scale_product<Exp>(scale, unbiased, xs[r]), acc[r]);
}

// Rows row0 .. row0 + Rows - 1 of group g0 + h over blocks b0 .. b0 + count - 1 (decoded in t), their
// accumulators read from y unless b0 is the first block, written back to y.
// Two blocks' int32 sums, in L1 between tilestored and the float steps (a thread's, not the pass's stack frame:
// 1.3-1.5x faster on an Intel Xeon, where the stack copy was read back slowly).
struct AmxSums {
  alignas(64) int32_t of[2][kAmxRows * kGroup];
};

template <int WBits, int Rows, bool Exp>
__attribute__((target(MXSPD_AVX512_VBMI ",amx-tile,amx-int8"))) void amx_pass(const Problem<WBits>& p, int64_t g0,
                                                                              int h, const Tile512<true>& t,
                                                                              AmxSums& buffer, int64_t row0,
                                                                              int64_t b0, int64_t count) {
  auto& sums = buffer.of;
  const __mmask16 valid = static_cast<__mmask16>((1u << p.columns(g0 + h)) - 1);
  float* y = p.y + row0 * p.n + (g0 + h) * kGroup;
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = b0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(valid, y + r * p.n);
  const int8_t* codes = t.codes + h * 64;  // block i's B tile at codes + i * kChunks * kPairBytes8
  // Block i's sums in tile 0 (i even) or 3 (odd), its A and B in the next two tiles; block i + 1 is issued
  // before block i is stored, so each tdpbssd has a block's float steps to finish in.
#define MXSPD_AMX_ISSUE(C, A, B, i)                                            \
  _tile_zero(C);                                                               \
  _tile_loadd(A, p.x_bytes(row0, b0 + (i)), kBlock);                           \
  _tile_loadd(B, codes + (i) * kChunks * kPairBytes8, kPairBytes8);            \
  _tile_dpbssd(C, A, B)
  MXSPD_AMX_ISSUE(0, 1, 2, 0);
  for (int64_t i = 0; i < count; i += 2) {
    if (i + 1 < count) MXSPD_AMX_ISSUE(3, 4, 5, i + 1);
    MXSPD_TILE_STORE(0, sums[0]);
    amx_float_step<Rows, Exp>(sums[0], t.ws + (2 * i + h) * kGroup, p.x_scale(row0, b0 + i), acc);
    if (i + 1 >= count) break;
    if (i + 2 < count) MXSPD_AMX_ISSUE(0, 1, 2, i + 2);
    MXSPD_TILE_STORE(3, sums[1]);
    amx_float_step<Rows, Exp>(sums[1], t.ws + (2 * (i + 1) + h) * kGroup, p.x_scale(row0, b0 + i + 1), acc);
  }
#undef MXSPD_AMX_ISSUE
  for (int r = 0; r < Rows; ++r) _mm512_mask_storeu_ps(y + r * p.n, valid, acc[r]);
}

template <int WBits, bool Exp, size_t... Rows>
constexpr auto amx_by_rows(std::index_sequence<Rows...>) {
  using Pass = void (*)(const Problem<WBits>&, int64_t, int, const Tile512<true>&, AmxSums&, int64_t, int64_t, int64_t);
  return std::array<Pass, sizeof...(Rows)>{amx_pass<WBits, static_cast<int>(Rows + 1), Exp>...};
}

// One task: gemm_tile's column groups and K tiles, each tile's rows in passes of 16 (the last the rest).
template <int WBits>
__attribute__((target(MXSPD_AVX512_VBMI ",amx-tile"))) void amx_tile(void* user, size_t index) {
  const Problem<WBits>& p = *static_cast<const Problem<WBits>*>(user);
  static constexpr std::array<decltype(amx_by_rows<WBits, false>(std::make_index_sequence<kAmxRows>())), 2> passes_by{
      amx_by_rows<WBits, false>(std::make_index_sequence<kAmxRows>()),
      amx_by_rows<WBits, true>(std::make_index_sequence<kAmxRows>())};  // [exp]
  static const TileConfig config = amx_config();
  _tile_loadconfig(&config);  // a thread's tile shapes: set on each task (other code on the thread may set its own)
  const int64_t g0 = 2 * static_cast<int64_t>(index);
  const int groups = static_cast<int>(std::min<int64_t>(2, (p.n + kGroup - 1) / kGroup - g0));
  thread_local Tile512<true> t;
  thread_local AmxSums sums;
  for (int64_t b0 = 0; b0 < p.kb; b0 += kTileBlocks<true>) {
    const int64_t count = std::min<int64_t>(kTileBlocks<true>, p.kb - b0);
    decode_pair(p, g0, groups, b0, count, t);
    const auto& pass = passes_by[exponent_products(p, t)];
    for (int64_t row = 0; row < p.m; row += kAmxRows)
      for (int h = 0; h < groups; ++h)
        pass[std::min<int64_t>(kAmxRows, p.m - row) - 1](p, g0, h, t, sums, row, b0, count);
  }
  _tile_release();
}
// The path's kernels for 1, 2, ... rows per pass (Rows is a template argument: accumulators in registers).
enum class Path { kAvx512, kAvx512Int8, kAvx2, kAvx2Planes, kAvx2Int8, kAvx2Fp4 };
template <int WBits, Path P, size_t... Rows>
constexpr auto by_rows(std::index_sequence<Rows...>) {
  using Kernel = void (*)(const Problem<WBits>&, int64_t, int64_t);
  if constexpr (P == Path::kAvx512)
    return std::array<Kernel, sizeof...(Rows)>{group_avx512<WBits, static_cast<int>(Rows + 1)>...};
  else if constexpr (P == Path::kAvx512Int8)
    return std::array<Kernel, sizeof...(Rows)>{group_avx512_int8<WBits, static_cast<int>(Rows + 1)>...};
  else if constexpr (P == Path::kAvx2Int8)
    return std::array<Kernel, sizeof...(Rows)>{group_avx2_int8<static_cast<int>(Rows + 1)>...};
  else if constexpr (P == Path::kAvx2Fp4)
    return std::array<Kernel, sizeof...(Rows)>{group_avx2_fp4<static_cast<int>(Rows + 1)>...};
  else
    return std::array<Kernel, sizeof...(Rows)>{group_avx2<WBits, static_cast<int>(Rows + 1), P == Path::kAvx2Planes>...};
}

#endif

// One group of 16 columns, every row: in as few passes over its weights as the path's row limit
// allows, the rows split evenly (9 rows at 12 per pass: one pass of 9, not 8 and 1).
template <int WBits>
void tile(void* user, size_t index) {
  const Problem<WBits>& p = *static_cast<const Problem<WBits>*>(user);
  const auto g = static_cast<int64_t>(index);
  int64_t per_pass = kRowGroup;
  void (*const* kernels)(const Problem<WBits>&, int64_t, int64_t) = nullptr;
#ifdef MXSPD_X86
  if constexpr (WBits == 4) {  // one layout (planes8's positions)
    static constexpr auto k512_fp4 = by_rows<4, Path::kAvx512Int8>(std::make_index_sequence<kRowGroup512>());
    static constexpr auto k256_fp4 = by_rows<4, Path::kAvx2Fp4>(std::make_index_sequence<kRowGroup>());
    if (kHasAvx512Vbmi) {
      per_pass = kRowGroup512;
      kernels = k512_fp4.data();
    } else if (kHasAvx2) {
      kernels = k256_fp4.data();
    }
  } else {
    static constexpr auto k512 = by_rows<WBits, Path::kAvx512>(std::make_index_sequence<kRowGroup512>());
    static constexpr auto k512_int8 = by_rows<WBits, Path::kAvx512Int8>(std::make_index_sequence<kRowGroup512>());
    static constexpr auto k256 = by_rows<WBits, Path::kAvx2>(std::make_index_sequence<kRowGroup>());
    // MXINT8 has one layout: its planes kernels are the triples ones (and planes8 is refused for it)
    static constexpr auto k256_planes =
        by_rows<WBits, WBits == 6 ? Path::kAvx2Planes : Path::kAvx2>(std::make_index_sequence<kRowGroup>());
    static constexpr auto k256_planes8 =
        by_rows<WBits, WBits == 6 ? Path::kAvx2Int8 : Path::kAvx2>(std::make_index_sequence<kRowGroup>());
    if (kHasAvx512Vbmi && p.layout == kTriples) {
      per_pass = kRowGroup512;
      kernels = p.xi ? k512_int8.data() : k512.data();  // int8 activations as bytes, or as int16
    } else if (kHasAvx2) {
      kernels = p.layout == kPlanes8 ? k256_planes8.data() : p.layout == kPlanes ? k256_planes.data() : k256.data();
    }
  }
#endif
  const int64_t passes = (p.m + per_pass - 1) / per_pass;
  for (int64_t i = 0, row = 0; i < passes; ++i) {
    const int64_t rows = (p.m - row) / (passes - i);  // the rows left, shared by the passes left
    if (kernels)
      kernels[rows - 1](p, g, row);
    else
      group_scalar(p, g, row, static_cast<int>(rows));
    row += rows;
  }
}

template <int WBits>
OrtStatus* run(OrtKernelContext* ctx, const float* a, const void* w, const void* s, float* y, int64_t m, int64_t k,
               int64_t n, int64_t kb, int activation_bits, Layout layout) {
  thread_local Activations x;  // reused call after call by the thread that runs the op
  x.fill(a, m, k, kb, activation_bits == 8 ? 127.0f : 32767.0f);
  Problem<WBits> p{x.q.data(), x.scale.data(), nullptr, nullptr, static_cast<const uint8_t*>(w),
                   static_cast<const uint8_t*>(s), y, m, n, kb, layout};
  const auto groups = static_cast<size_t>((n + kGroup - 1) / kGroup);
#ifdef MXSPD_X86
  // the AVX-512 path decodes triples and MXFP4 (planes8's positions); AVX2 the rest (planes, planes8)
  const bool wide = kHasAvx512Vbmi && (WBits == 4 || layout == kTriples);
  const bool many8 = m >= kGemmMinRows8<WBits>;
  if (wide && (activation_bits == 8 ? many8 || (kHasAmx && m >= kAmxMinRows) : m >= kGemmMinRows<WBits>))
    p.xs_normal = x.scale_exponents(&p.xs_lowest, &p.xs_highest);
  if (kHasAmx && wide && activation_bits == 8 && m >= kAmxMinRows) {
    x.narrow_tiles(kAmxRows);
    p.xi = x.bytes.data();
    return g_api.parallel_for(ctx, amx_tile<WBits>, (groups + 1) / 2, &p);
  }
  if (wide && activation_bits == 8 && many8) {
    x.bias();
    p.xu = x.biased.data();
    return g_api.parallel_for(ctx, gemm_tile<WBits, true>, (groups + 1) / 2, &p);
  }
  if (wide && activation_bits == 8 && m >= kFewRows8<WBits>) {  // the few-row loop on bytes
    x.narrow();
    p.xi = x.bytes.data(), p.xt = x.sums.data();
  }
  if constexpr (WBits != 4)
    if (wide && m >= kGemmMinRows<WBits>) return g_api.parallel_for(ctx, gemm_tile<WBits, false>, (groups + 1) / 2, &p);
  if (kHasAvx2 && !wide && m >= kGemmMinRows2<WBits>) {
    if (WBits != 8 && activation_bits == 8) {
      x.bias();
      p.xu = x.biased.data();
    }
    return g_api.parallel_for(ctx, gemm_avx2<WBits>(layout, activation_bits), groups, &p);
  }
  if (kHasAvx2 && !wide && WBits == 4) {  // MXFP4's few-row loop: the int8 activations and their block sums
    x.narrow();
    p.xi = x.bytes.data(), p.xt = x.sums.data();
  } else if (kHasAvx2 && !wide && layout == kPlanes8) {
    x.sign();
    p.xn = x.signs.data();
  }
#endif
  return g_api.parallel_for(ctx, tile<WBits>, groups, &p);
}

// ---- the op ---------------------------------------------------------------------------------------

struct Kernel {
  int64_t k, n, activation_bits, weight_bits, prologue;
  float epsilon;
  Layout layout;
};

OrtStatus* create_kernel(const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** out) {
  int64_t k = 0, n = 0;
  if (OrtStatus* s = g_api.attribute(info, "K", &k)) return s;
  if (OrtStatus* s = g_api.attribute(info, "N", &n)) return s;
  int64_t bits = 16, wbits = 6, prologue = kNone, layout = kTriples;
  g_api.optional_attribute(info, "activation_bits", 16, &bits);
  g_api.optional_attribute(info, "weight_bits", 6, &wbits);
  g_api.optional_attribute(info, "layout", kTriples, &layout);
  float epsilon = 0.0f;
  if (OrtStatus* s = read_prologue(info, "MXMatMul: prologue must be 0, 1 or 2", &prologue, &epsilon)) return s;
  if (k <= 0 || n <= 0) return g_api.error("MXMatMul: attributes K and N must be positive");
  if (bits != 8 && bits != 16) return g_api.error("MXMatMul: activation_bits must be 8 or 16");
  if (wbits != 4 && wbits != 6 && wbits != 8)
    return g_api.error("MXMatMul: weight_bits must be 4 (MXFP4 E2M1), 6 (MXFP6 E2M3) or 8 (MXINT8)");
  if (wbits == 4 && (bits != 8 || layout != kPlanes8))
    return g_api.error("MXMatMul: weight_bits 4 (MXFP4) needs activation_bits 8 and layout 2 (planes8's order)");
  if (wbits != 4 && layout != kTriples && (wbits != 6 || (layout != kPlanes && (layout != kPlanes8 || bits != 8))))
    return g_api.error("MXMatMul: layout must be 0 (triples) or, with weight_bits 6, 1 (planes) or, with "
                       "activation_bits 8 too, 2 (planes8)");
  *out = new (std::nothrow) Kernel{k, n, bits, wbits, prologue, epsilon, static_cast<Layout>(layout)};
  return *out ? nullptr : g_api.error("MXMatMul: out of memory");
}

OrtStatus* compute(void* op_kernel, OrtKernelContext* ctx) {
  const Kernel& kernel = *static_cast<Kernel*>(op_kernel);
  const float* a = nullptr;
  std::vector<int64_t> adims, wdims, sdims;
  if (OrtStatus* st = g_api.tensor(ctx, 0, &a, &adims)) return st;
  const OrtValue *w = nullptr, *s = nullptr;
  for (auto [i, v] : {std::pair<size_t, const OrtValue**>{1, &w}, {2, &s}})
    if (OrtStatus* st = g_api.input(ctx, i, v)) return st;
  for (auto [v, d] : {std::pair<const OrtValue*, std::vector<int64_t>*>{w, &wdims}, {s, &sdims}})
    if (OrtStatus* st = g_api.shape(v, d)) return st;
  const int64_t kb = (kernel.k + kBlock - 1) / kBlock;
  if (adims.empty() || adims.back() != (kernel.prologue == kSwiGLU ? 2 : 1) * kernel.k)
    return g_api.error("MXMatMul: the last dimension of A must equal attribute K (2K with prologue 1, SwiGLU)");
  const int64_t groups = (kernel.n + kGroup - 1) / kGroup;
  const int64_t block_bytes = kernel.weight_bits == 8   ? kGroupBlockBytes<8>
                              : kernel.weight_bits == 6 ? kGroupBlockBytes<6>
                                                        : kGroupBlockBytes<4>;
  if (wdims != std::vector<int64_t>{groups, kb, block_bytes} || sdims != std::vector<int64_t>{groups, kb, kGroup})
    return g_api.error("MXMatMul: W must be uint8 [ceil(N/16), ceil(K/32), 256 (weight_bits 4), 384 (6) or 512 (8)] "
                       "and S uint8 [ceil(N/16), ceil(K/32), 16] (kernels/layout.py)");
  int64_t m = 1;
  for (size_t i = 0; i + 1 < adims.size(); ++i) m *= adims[i];
  std::vector<int64_t> ydims = adims;
  ydims.back() = kernel.n;
  float* out = nullptr;
  if (OrtStatus* st = g_api.output_data(ctx, 0, ydims, &out)) return st;
  void *pw = nullptr, *ps = nullptr;
  for (auto [v, d] : {std::pair<const OrtValue*, void**>{w, &pw}, {s, &ps}})
    if (OrtStatus* st = g_api.data(v, d)) return st;
  const float* rows = a;
  if (kernel.prologue != kNone)
    if (OrtStatus* st = prologue_rows(kernel.prologue, kernel.k, kernel.epsilon, ctx, 3, a, adims, m, &rows)) return st;
  if (m == 0) return nullptr;
  const int bits = static_cast<int>(kernel.activation_bits);
  switch (kernel.weight_bits) {
    case 8: return run<8>(ctx, rows, pw, ps, out, m, kernel.k, kernel.n, kb, bits, kernel.layout);
    case 6: return run<6>(ctx, rows, pw, ps, out, m, kernel.k, kernel.n, kb, bits, kernel.layout);
    default: return run<4>(ctx, rows, pw, ps, out, m, kernel.k, kernel.n, kb, bits, kernel.layout);
  }
}

}  // namespace

// The MXFP6 layout this machine multiplies fastest with these activations (the compiler writes weights in
// it): triples where the AVX-512 path runs, planes elsewhere (planes8 with int8 activations on AVX2).
int64_t mx_preferred_layout(int64_t activation_bits) {
#ifdef MXSPD_X86
  if (kHasAvx512Vbmi) return kTriples;
  if (kHasAvx2 && activation_bits == 8) return kPlanes8;
#endif
  return kPlanes;
}

const OrtCustomOp* mx_matmul_op() {
  static const OrtCustomOp op = optional_from<3, 1>(make_op(
      [](const OrtCustomOp*) { return "MXMatMul"; },
      [](const OrtCustomOp*, size_t i) { return i == 1 || i == 2 ? kUint8 : kFloat; },
      [](const OrtCustomOp*) -> size_t { return 5; }, create_kernel, compute,
      [](void* k) { delete static_cast<Kernel*>(k); }, [](const OrtCustomOp*) -> size_t { return 2; }));
  return &op;
}

}  // namespace mxspd
