// mxspd's native ONNX Runtime op: ai.mxspd::MXMatMul, a matmul whose weights stay MXFP6 E2M3 in memory
// (6 bits per code plus one E8M0 byte per 32 codes: 6.25 bits per weight) and are decoded in registers.
//
// Why: ONNX Runtime has no 6-bit matmul; MatMulNBits(bits=8) reads 8-bit codes plus float32 scales
// (9 bits per weight), and decode speed on a CPU is bytes per token over memory bandwidth.
//
// Semantics: Y[m, n] = sum_b scale[n, b] * sum_{k in block b} value(code[n, k]) * A[m, k], in float32,
// with the MXFP6 values exact (no activation quantization). Every row is computed by the same sequence
// of float operations whatever the number of rows in the call (batch invariance: a token's logits do
// not depend on what else shares its call).
//
// Weight layout (kernels/layout.py writes it): W uint8 [N, K/32, 24], per output column n and block b
// of 32 codes c[0..31]: bytes 0-15 hold c[j] & 15 | (c[j + 16] & 15) << 4; bytes 16-23 hold, in byte
// j, the top two bits of c[j], c[j + 8], c[j + 16], c[j + 24] at bits 0, 2, 4, 6. S uint8 [N, K/32]:
// E8M0 exponents. K is padded to whole blocks with code 0.
//
// Code paths: AVX-512 with VNNI and VBMI (two columns per register, codes decoded by byte permutes, up to
// 12 rows per pass over the weights),
// AVX2 (one column, 4 rows), portable; all three give the same bits (tests/test_native_kernel.py).
//
// weight_bits = 8: MXINT8 instead, W [N, K/32, 32] of int8 codes k, and S holds e - 6 (the value
// k * 2^-6 * 2^(e-127) = k * 2^(S-127)): 8.25 bits per weight, for the weights a recipe keeps finer
// (the LM head, sensitive layers). The arithmetic after decoding is the same.
//
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>

#include "ort_api.h"

namespace mxspd {
namespace {

// ---- MXFP6 E2M3 -----------------------------------------------------------------------------------

constexpr int kBlock = 32;
template <int WBits>
constexpr int kBlockBytes = WBits == 8 ? 32 : 24;

// 8 * |value| of E2M3 magnitude codes 16..31 (codes 0..15 are 8 * |value| = code itself).
alignas(16) constexpr int8_t kHighMagnitudes[16] = {16, 18, 20, 22, 24, 26, 28, 30, 32, 36, 40, 44, 48, 52, 56, 60};

// 2^(e - 127 - shift): the block scale with the integer weights' step folded in (E2M3: 8 * value is
// an integer, shift 3; MXINT8: S already holds the 2^-6, shift 0); 255 is NaN.
struct ScaleTable {
  float v[256];
  explicit ScaleTable(int shift) {
    for (int e = 0; e < 255; ++e) v[e] = std::ldexp(1.0f, e - 127 - shift);
    v[255] = NAN;
  }
};
const ScaleTable kScalesE2M3(3), kScalesInt8(0);
template <int WBits>
const float* scales() { return WBits == 8 ? kScalesInt8.v : kScalesE2M3.v; }

// The integer weights of the 32 codes of one block: 8 * value (E2M3) or the code itself (MXINT8).
template <int WBits>
void decode_scalar(const uint8_t* blk, int32_t w[kBlock]) {
  for (int j = 0; j < kBlock; ++j) {
    if constexpr (WBits == 8) {
      w[j] = static_cast<int8_t>(blk[j]);
    } else {
      const int lo = (j < 16 ? blk[j] : blk[j - 16] >> 4) & 15;
      const int pair = (blk[16 + (j & 7)] >> (2 * (j >> 3))) & 3;  // bit 0: sign, bit 1: low half
      const int mag = (pair & 2) ? lo : kHighMagnitudes[lo];
      w[j] = (pair & 1) ? -mag : mag;
    }
  }
}

// Activations, row by row and block by block, as integers with a float32 scale (absmax / qmax):
// exact integer products with the int8 weights (8 * value), float32 only once per block. Bits = 16
// rounds each activation to 1/65534 of its block's largest (closer than float16 does); Bits = 8 to
// 1/254 (as MatMulNBits' accuracy_level 4 and llama.cpp's Q8 activations do), which is faster.
template <int Bits>
struct Activations {
  using Int = std::conditional_t<Bits == 8, int8_t, int16_t>;
  static constexpr float kMax = Bits == 8 ? 127.0f : 32767.0f;
  std::vector<Int> q;        // [KB, M, 32]: a block's rows side by side, at fixed offsets from one pointer
  std::vector<float> scale;  // [KB, M]

  void fill(const float* a, int64_t m, int64_t k, int64_t kb) {
    q.assign(m * kb * kBlock, 0);  // keeps the capacity: no allocation once the largest call has run
    scale.assign(m * kb, 0.0f);
    for (int64_t r = 0; r < m; ++r) {
      const float* x = a + r * k;
      for (int64_t b = 0; b < kb; ++b) {
        Int* out = &q[(b * m + r) * kBlock] - b * kBlock;  // out[i] for i in [k0, k1)
        const int64_t k0 = b * kBlock, k1 = std::min<int64_t>(k, k0 + kBlock);
        float amax = 0.0f;
        bool finite = true;
        for (int64_t i = k0; i < k1; ++i) {
          amax = std::max(amax, std::fabs(x[i]));
          finite = finite && std::isfinite(x[i]);
        }
        if (!finite) {  // Inf or NaN in, NaN out (as a float matmul would give, at least for NaN)
          scale[b * m + r] = NAN;
        } else if (amax > 0.0f) {
          const float inv = kMax / amax;
          for (int64_t i = k0; i < k1; ++i) out[i] = static_cast<Int>(std::lrintf(x[i] * inv));
          scale[b * m + r] = amax / kMax;
        }
      }
    }
  }
};

template <int WBits, int Bits>
struct Problem {
  const typename Activations<Bits>::Int* xq;  // [KB, M, 32]
  const float* xs;                            // [KB, M]
  const uint8_t* w;                           // [N, KB, kBlockBytes<WBits>]
  const uint8_t* s;                           // [N, KB]
  float* y;                                   // [M, N]
  int64_t m, n, kb;

  const typename Activations<Bits>::Int* x(int64_t row, int64_t b) const { return xq + (b * m + row) * kBlock; }
  const float* x_scale(int64_t row, int64_t b) const { return xs + b * m + row; }
};

constexpr int64_t kTileColumns = 8;
constexpr int kRowGroup = 4;

// Which 4 of a block's 32 products make lane l's integer sum, as the vector path groups them:
// int16 (madd of each 16-code half): 2l, 2l+1, 16+2l, 17+2l; int8 (maddubs, then madd): 4l..4l+3.
template <int Bits>
constexpr int lane_product(int l, int i) {
  return Bits == 8 ? 4 * l + i : (i < 2 ? 2 * l + i : 14 + 2 * l + i);
}

// The portable path: the vector path's arithmetic lane by lane (integer sums are exact, and the
// float operations are the same in the same order, so both give the same bits).
template <int WBits, int Bits>
void column_scalar(const Problem<WBits, Bits>& p, int64_t col, int64_t row0, int rows) {
  float acc[kRowGroup][8] = {};
  for (int64_t b = 0; b < p.kb; ++b) {
    int32_t w[kBlock];
    decode_scalar<WBits>(p.w + (col * p.kb + b) * kBlockBytes<WBits>, w);
    const float wscale = scales<WBits>()[p.s[col * p.kb + b]];
    for (int r = 0; r < rows; ++r) {
      const auto* x = p.x(row0 + r, b);
      const float scale = wscale * *p.x_scale(row0 + r, b);
      for (int l = 0; l < 8; ++l) {
        int32_t sum = 0;
        for (int i = 0; i < 4; ++i) sum += w[lane_product<Bits>(l, i)] * x[lane_product<Bits>(l, i)];
        acc[r][l] = std::fma(static_cast<float>(sum), scale, acc[r][l]);
      }
    }
  }
  for (int r = 0; r < rows; ++r) p.y[(row0 + r) * p.n + col] = lane_sum(acc[r]);
}

#ifdef MXSPD_X86
// 32 codes -> their integer weights as int8 (codes 0-15 in the low 128 bits, 16-31 in the high).
template <int WBits>
__attribute__((target("avx2,fma"))) inline __m256i decode_avx2(const uint8_t* blk) {
  if constexpr (WBits == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
  } else {
    const __m256i low4 = _mm256_set1_epi8(15), low_half = _mm256_set1_epi8(char(0x80)), sign = _mm256_set1_epi8(0x40);
    const __m256i nibble_shift = _mm256_setr_epi64x(0, 0, 4, 4), pair_shift = _mm256_setr_epi64x(6, 4, 2, 0);
    const __m256i high = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kHighMagnitudes)));
    // magnitudes (8 * |value|, unsigned bytes) and a sign mask, in registers
    const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi64(q, nibble_shift), low4);  // codes 0-15 | 16-31
    const __m256i pairs = _mm256_sllv_epi64(_mm256_broadcastq_epi64(_mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(blk + 16))), pair_shift);  // each code's pair at bits 6, 7
    const __m256i idx = _mm256_or_si256(lo, _mm256_and_si256(pairs, low_half));  // bit 7: shuffle gives 0
    const __m256i mag = _mm256_max_epu8(_mm256_shuffle_epi8(high, idx), lo);
    const __m256i neg = _mm256_cmpeq_epi8(_mm256_and_si256(pairs, sign), sign);
    return _mm256_sub_epi8(_mm256_xor_si256(mag, neg), neg);
  }
}

// Rows is a template argument so that the accumulators live in registers.
template <int WBits, int Bits, int Rows>
__attribute__((target("avx2,fma"))) void column_avx2(const Problem<WBits, Bits>& p, int64_t col, int64_t row0) {
  const __m256i ones16 = _mm256_set1_epi16(1);
  __m256 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm256_setzero_ps();
  const uint8_t* blk = p.w + col * p.kb * kBlockBytes<WBits>;
  const uint8_t* sc = p.s + col * p.kb;
  for (int64_t b = 0; b < p.kb; ++b, blk += kBlockBytes<WBits>) {
    const __m256i v = decode_avx2<WBits>(blk);
    const __m256 wscale = _mm256_set1_ps(scales<WBits>()[sc[b]]);
    const auto* xb = p.x(row0, b);  // row r's 32 activations at xb + 32 r
    const float* xs = p.x_scale(row0, b);
    if constexpr (Bits == 8) {
      const __m256i mag = _mm256_abs_epi8(v);  // maddubs: unsigned weights, each weight's sign moved onto x
      for (int r = 0; r < Rows; ++r) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + r * kBlock));
        const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(x, v)), ones16);
        const __m256 scale = _mm256_mul_ps(wscale, _mm256_set1_ps(xs[r]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r]);
      }
    } else {
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
      for (int r = 0; r < Rows; ++r) {
        const int16_t* x = xb + r * kBlock;
        const __m256i s = _mm256_add_epi32(
            _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
            _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16))));
        const __m256 scale = _mm256_mul_ps(wscale, _mm256_set1_ps(xs[r]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[r]);
    p.y[(row0 + r) * p.n + col] = lane_sum(lanes);
  }
}

// ---- AVX-512: two columns per register, up to 12 rows per pass over their weights ------------------
//
// Lanes 0-7 hold column c's 8 accumulators and lanes 8-15 column c + 1's, each lane summing the same
// 4 products per block (VNNI's dot products add them without saturating, as the AVX2 path's
// exact integer sums do) and taking the same float operations in the same order: the same bits as
// the AVX2 and portable paths, in about half the instructions per row.

constexpr int kRowGroup512 = 12;  // accumulators in registers (32 of them)
constexpr int64_t kAhead = 16;  // columns

// The integer weight of each 6-bit code c (bits 0-3: its low nibble; bit 4: the sign; bit 5: set for codes
// 0-15 of a magnitude, whose weight is the nibble itself), for VBMI's byte permute: index -> 8 * value.
struct CodeTable {
  alignas(64) int8_t signed_weight[64], magnitude[64];
  CodeTable() {
    for (int i = 0; i < 64; ++i) {
      const int lo = i & 15, mag = (i & 32) ? lo : kHighMagnitudes[lo];
      magnitude[i] = static_cast<int8_t>(mag);
      signed_weight[i] = static_cast<int8_t>((i & 16) ? -mag : mag);
    }
  }
};
const CodeTable kCodes;

// Bit offsets for VBMI's multishift, per output byte (code c of a column: 64-bit lane c / 8, byte c % 8):
// its low nibble (codes 0-15: byte c of the 16 nibble bytes; 16-31: the high nibble of byte c - 16), and
// its pair of top bits (bits 8 (c % 8) + 2 (c / 8) of the 8 pair bytes) moved to bits 4-5 (the offset
// wraps around the 64-bit lane).
struct ShiftTable {
  alignas(64) uint8_t nibble[64], pair[64];
  ShiftTable() {
    for (int b = 0; b < 64; ++b) {
      const int lane = (b / 8) % 4, i = b % 8;
      nibble[b] = static_cast<uint8_t>(8 * i + (lane >= 2 ? 4 : 0));
      pair[b] = static_cast<uint8_t>((8 * i + 2 * lane - 4 + 64) % 64);
    }
  }
};
const ShiftTable kShifts;

// The codes of one block of columns c and c + 1 (lanes 0-31 and 32-63) as indexes into CodeTable: two
// multishifts gather each code's bits, one ternary-logic op joins them (bits 6-7 are left as they come:
// the permute ignores them).
__attribute__((target(MXSPD_AVX512_VBMI))) inline __m512i code_index(const uint8_t* c0, const uint8_t* c1) {
  const __m512i nibbles = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c0)))),
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c1))), 1);
  int64_t p0, p1;
  std::memcpy(&p0, c0 + 16, 8);
  std::memcpy(&p1, c1 + 16, 8);
  const __m512i pairs = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi64x(p0)), _mm256_set1_epi64x(p1), 1);
  const __m512i lo = _mm512_multishift_epi64_epi8(_mm512_load_si512(kShifts.nibble), nibbles);
  const __m512i hi = _mm512_multishift_epi64_epi8(_mm512_load_si512(kShifts.pair), pairs);
  return _mm512_ternarylogic_epi32(lo, hi, _mm512_set1_epi8(15), 0xE4);  // lo where the mask is set, else hi
}

// MXINT8: the int8 codes of columns c and c + 1 (lanes 0-31 and 32-63) are their integer weights.
__attribute__((target(MXSPD_AVX512_VBMI))) inline __m512i int8_codes(const uint8_t* c0, const uint8_t* c1) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c0))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c1)), 1);
}

template <int WBits, int Bits, int Rows>
__attribute__((target(MXSPD_AVX512_VBMI))) void column_pair_avx512(const Problem<WBits, Bits>& p, int64_t col,
                                                               int64_t row0) {
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t bytes = p.kb * kBlockBytes<WBits>;
  const uint8_t* blk = p.w + col * bytes;
  const uint8_t* sc = p.s + col * p.kb;
  const float* table = scales<WBits>();
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t b = 0; b < p.kb; ++b, blk += kBlockBytes<WBits>) {
    // Two streams that end after a column each leave the hardware prefetcher no time to learn them
    // (2.7x slower at one row on AMD EPYC, 24 layers of 8 MB): fetch 8 pairs ahead.
    _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead * bytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + (kAhead + 1) * bytes), _MM_HINT_T0);
    const __m512 wscale = _mm512_insertf32x8(_mm512_set1_ps(table[sc[b]]), _mm256_set1_ps(table[sc[p.kb + b]]), 1);
    const auto* xb = p.x(row0, b);  // row r's 32 activations at xb + 32 r
    const float* xs = p.x_scale(row0, b);
    if constexpr (Bits == 8) {  // dpbusd: unsigned weights, each weight's sign moved onto x
      __m512i mag;
      __mmask64 neg;
      if constexpr (WBits == 8) {
        const __m512i v = int8_codes(blk, blk + bytes);
        mag = _mm512_abs_epi8(v);
        neg = _mm512_movepi8_mask(v);
      } else {
        const __m512i idx = code_index(blk, blk + bytes);
        mag = _mm512_permutexvar_epi8(idx, _mm512_load_si512(kCodes.magnitude));
        neg = _mm512_test_epi8_mask(idx, _mm512_set1_epi8(16));
      }
      for (int r = 0; r < Rows; ++r) {
        const __m512i x = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + r * kBlock)));
        const __m512i s = _mm512_dpbusd_epi32(zero, mag, _mm512_mask_sub_epi8(x, neg, zero, x));
        const __m512 scale = _mm512_mul_ps(wscale, _mm512_set1_ps(xs[r]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r]);
      }
    } else {  // int16 weights: codes 0-15 of both columns, then 16-31
      const __m512i v = WBits == 8 ? int8_codes(blk, blk + bytes)
                                   : _mm512_permutexvar_epi8(code_index(blk, blk + bytes), _mm512_load_si512(kCodes.signed_weight));
      const __m512i halves = _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0));
      const __m512i w0 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(halves));
      const __m512i w1 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(halves, 1));
      for (int r = 0; r < Rows; ++r) {
        const int16_t* x = xb + r * kBlock;
        const __m512i x0 = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
        const __m512i x1 = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)));
        const __m512i s = _mm512_dpwssd_epi32(_mm512_madd_epi16(w0, x0), w1, x1);
        const __m512 scale = _mm512_mul_ps(wscale, _mm512_set1_ps(xs[r]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, acc[r]);
    p.y[(row0 + r) * p.n + col] = lane_sum(lanes);
    p.y[(row0 + r) * p.n + col + 1] = lane_sum(lanes + 8);
  }
}

template <int WBits, int Bits, size_t... Rows>
constexpr auto by_rows(std::index_sequence<Rows...>) {
  return std::array<void (*)(const Problem<WBits, Bits>&, int64_t, int64_t), sizeof...(Rows)>{
      column_pair_avx512<WBits, Bits, static_cast<int>(Rows + 1)>...};
}

// Columns [col, end) in pairs; returns the first column left (an odd one). Rows go in as few passes
// over the weights as 12 at a time allows, split evenly (9 rows: one pass of 9, not 8 and 1).
template <int WBits, int Bits>
int64_t pairs_avx512(const Problem<WBits, Bits>& p, int64_t col, int64_t end) {
  static constexpr auto kByRows = by_rows<WBits, Bits>(std::make_index_sequence<kRowGroup512>());
  const int64_t passes = (p.m + kRowGroup512 - 1) / kRowGroup512;
  for (; col + 2 <= end; col += 2)
    for (int64_t i = 0, row = 0; i < passes; ++i) {
      const int64_t rows = (p.m - row) / (passes - i);  // the rows left, shared by the passes left
      kByRows[rows - 1](p, col, row);
      row += rows;
    }
  return col;
}

#endif

template <int WBits, int Bits>
void tile(void* user, size_t index) {
  const Problem<WBits, Bits>& p = *static_cast<const Problem<WBits, Bits>*>(user);
  const int64_t end = std::min<int64_t>(p.n, (static_cast<int64_t>(index) + 1) * kTileColumns);
  int64_t first = static_cast<int64_t>(index) * kTileColumns;
#ifdef MXSPD_X86
  // One row of MXINT8 is all bandwidth: the AVX2 path's single stream reads it faster (4.4-4.8 ms
  // against 5.2-6.1 for 208 MB, AMD EPYC, 2 threads; benchmarks.matmul_rows).
  if (kHasAvx512Vbmi && (WBits == 6 || p.m > 1)) first = pairs_avx512(p, first, end);
#endif
  for (int64_t col = first; col < end; ++col) {
    for (int64_t row = 0; row < p.m; row += kRowGroup) {
      const int rows = static_cast<int>(std::min<int64_t>(kRowGroup, p.m - row));
#ifdef MXSPD_X86
      if (kHasAvx2) {
        constexpr void (*kByRows[kRowGroup])(const Problem<WBits, Bits>&, int64_t, int64_t) = {
            column_avx2<WBits, Bits, 1>, column_avx2<WBits, Bits, 2>, column_avx2<WBits, Bits, 3>,
            column_avx2<WBits, Bits, 4>};
        kByRows[rows - 1](p, col, row);
        continue;
      }
#endif
      column_scalar(p, col, row, rows);
    }
  }
}

template <int WBits, int Bits>
OrtStatus* run(OrtKernelContext* ctx, const float* a, const void* w, const void* s, float* y, int64_t m, int64_t k,
               int64_t n, int64_t kb) {
  thread_local Activations<Bits> x;  // reused call after call by the thread that runs the op
  x.fill(a, m, k, kb);
  Problem<WBits, Bits> p{x.q.data(), x.scale.data(), static_cast<const uint8_t*>(w), static_cast<const uint8_t*>(s),
                         y, m, n, kb};
  return g_api.parallel_for(ctx, tile<WBits, Bits>, static_cast<size_t>((n + kTileColumns - 1) / kTileColumns), &p);
}

// ---- the op ---------------------------------------------------------------------------------------

struct Kernel {
  int64_t k, n, activation_bits, weight_bits;
};

OrtStatus* create_kernel(const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** out) {
  int64_t k = 0, n = 0;
  if (OrtStatus* s = g_api.attribute(info, "K", &k)) return s;
  if (OrtStatus* s = g_api.attribute(info, "N", &n)) return s;
  int64_t bits = 16, wbits = 6;
  g_api.optional_attribute(info, "activation_bits", 16, &bits);
  g_api.optional_attribute(info, "weight_bits", 6, &wbits);
  if (k <= 0 || n <= 0) return g_api.error("MXMatMul: attributes K and N must be positive");
  if (bits != 8 && bits != 16) return g_api.error("MXMatMul: activation_bits must be 8 or 16");
  if (wbits != 6 && wbits != 8) return g_api.error("MXMatMul: weight_bits must be 6 (MXFP6 E2M3) or 8 (MXINT8)");
  *out = new (std::nothrow) Kernel{k, n, bits, wbits};
  return *out ? nullptr : g_api.error("MXMatMul: out of memory");
}

OrtStatus* compute(void* op_kernel, OrtKernelContext* ctx) {
  const Kernel& kernel = *static_cast<Kernel*>(op_kernel);
  const OrtValue *a = nullptr, *w = nullptr, *s = nullptr;
  for (auto [i, v] : {std::pair<size_t, const OrtValue**>{0, &a}, {1, &w}, {2, &s}})
    if (OrtStatus* st = g_api.input(ctx, i, v)) return st;
  std::vector<int64_t> adims, wdims, sdims;
  for (auto [v, d] : {std::pair<const OrtValue*, std::vector<int64_t>*>{a, &adims}, {w, &wdims}, {s, &sdims}})
    if (OrtStatus* st = g_api.shape(v, d)) return st;
  const int64_t kb = (kernel.k + kBlock - 1) / kBlock;
  if (adims.empty() || adims.back() != kernel.k)
    return g_api.error("MXMatMul: the last dimension of A must equal attribute K");
  const int64_t block_bytes = kernel.weight_bits == 8 ? kBlockBytes<8> : kBlockBytes<6>;
  if (wdims != std::vector<int64_t>{kernel.n, kb, block_bytes} || sdims != std::vector<int64_t>{kernel.n, kb})
    return g_api.error("MXMatMul: W must be uint8 [N, ceil(K/32), 24 (weight_bits 6) or 32 (8)] and S uint8 "
                       "[N, ceil(K/32)]");
  int64_t m = 1;
  for (size_t i = 0; i + 1 < adims.size(); ++i) m *= adims[i];
  std::vector<int64_t> ydims = adims;
  ydims.back() = kernel.n;
  OrtValue* y = nullptr;
  if (OrtStatus* st = g_api.output(ctx, 0, ydims.data(), ydims.size(), &y)) return st;
  void *pa = nullptr, *pw = nullptr, *ps = nullptr, *py = nullptr;
  for (auto [v, d] : {std::pair<const OrtValue*, void**>{a, &pa}, {w, &pw}, {s, &ps}, {y, &py}})
    if (OrtStatus* st = g_api.data(v, d)) return st;
  if (m == 0) return nullptr;
  const auto* rows = static_cast<const float*>(pa);
  auto* out = static_cast<float*>(py);
  constexpr OrtStatus* (*kRun[2][2])(OrtKernelContext*, const float*, const void*, const void*, float*, int64_t,
                                     int64_t, int64_t, int64_t) = {{run<6, 8>, run<6, 16>}, {run<8, 8>, run<8, 16>}};
  return kRun[kernel.weight_bits == 8][kernel.activation_bits == 16](ctx, rows, pw, ps, out, m, kernel.k, kernel.n, kb);
}

}  // namespace

const OrtCustomOp* mx_matmul_op() {
  static const OrtCustomOp op = make_op(
      [](const OrtCustomOp*) { return "MXMatMul"; }, [](const OrtCustomOp*, size_t i) { return i == 0 ? kFloat : kUint8; },
      [](const OrtCustomOp*) -> size_t { return 3; }, create_kernel, compute,
      [](void* k) { delete static_cast<Kernel*>(k); });
  return &op;
}

}  // namespace mxspd
