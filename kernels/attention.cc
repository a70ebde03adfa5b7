// ai.mxspd::Attention: softmax(q k^T * scale + mask) v for one layer, over the KV cache and the call's new
// tokens, with a result that does not depend on where a key sits or what else shares the call.
//
// Inputs: query [B, Hq, T, D]; past_key, past_value [B, Hkv, C, D]; new_key, new_value [B, Hkv, T, D];
// mask float32 [B, 1 or Hq, T, C + T], added to the scores (transformers' form: 0 where visible, the
// float minimum where not; entries at or below -1e30 are skipped). Attribute `scale`. Output [B, Hq, T, D],
// or with attribute tokens_major = 1 [B, T, Hq * D] (the heads' transpose the next projection reads,
// written in place; compiler/layouts.py). Query head h reads KV head h / (Hq / Hkv).
//
// Why: a token's key may be a cache slot in one call (autoregressive decoding) and a new row in another
// (its speculation round), and ONNX Runtime's matmuls and softmax sum in an order that follows storage
// and call shape. Here every score is one fixed-order dot product, and the two sums over keys (the
// softmax denominator and the weighted values) are exact: each term is rounded once to a fixed-point
// integer and the integers are added, so the order of keys cannot matter. The same set of visible keys
// therefore gives the same bits, wherever they are stored. Denominator terms are p * 2^40 (int64);
// value terms p * v as one float32 product rounded to 2^-26 of the row's largest |v| (int32 lanes, 8 or
// 16 per instruction, moved into int64 before they could overflow): float32's own precision, at a third of the
// instructions of int64 terms. A score's dot product runs in 16 lanes (lane l sums elements
// i = l mod 16 by fma; then lanes l and l + 8 are added and the 8 sums reduced as lane_sum), one
// 512-bit register's order, kept by AVX2 in two registers.
// exp is one fixed polynomial (the same operations on every path), not the C library's. All of this
// needs the build's -ffp-contract=off: a fused multiply-add where the source has a product and a sum
// would round once where the scalar path rounds twice.
//
// Work: one task per (batch, KV head's query heads or one head, rows). On AVX-512 (head sizes a multiple of
// 64) a task's query vectors, up to kTile, run through tile kernels together: each key and value piece
// loaded once for all of them. The vectors are a KV head's query heads, and in a call whose rows see
// nearly the same keys (a prefill chunk) three rows of a one-head group, over the union of their keys
// (found once per call), a key a row does not see scored -infinity, so p = 0 and terms of 0. Each vector's
// arithmetic is the one it gets alone.
//
// ai.mxspd::AttentionHalfKV and RotaryAttentionHalfKV: the same ops over a float16 KV cache (past_key,
// past_value float16): the call's new keys and values are rounded to float16 first (to nearest, ties to
// even: F16C's conversion and its scalar twin here) and written as outputs 1 and 2 (float16), which the
// runtime stores, and attention reads those rounded values; so a key attended as a new row and later as
// a cache slot is the same number, and every row's output is the float32 kernel's on the rounded keys
// and values (each row of 16-bit K and V widened to float32: 16 elements in a register by the tile kernels,
// else in L1 a block of keys at a time; rows several query rows share, once per call).
//
// ai.mxspd::RotaryAttention: RotaryQKV (kernels/rotary.cc) and Attention in one op, where the packed
// q/k/v projection feeds nothing else: inputs qkv [B, T, (Hq + 2 Hkv) * D], cos and sin [B or 1, 1, T,
// D], past_key, past_value, mask; outputs the attention's output, and the rotated new keys and the
// new values [B, Hkv, T, D] (the step's KV, which the runtime stores); attributes q_heads, kv_heads,
// scale, tokens_major. The same bits as the two ops (kernels/rotary.h), a node less per layer
// (compiler/rotary_attention.py).

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <thread>
#include <utility>

#include "exp.h"
#include "ort_api.h"
#include "rotary.h"

namespace mxspd {
namespace {

constexpr float kHidden = -1e30f;           // mask values at or below: the key is not attended
constexpr int kFraction = 40;               // denominator terms: p * 2^40 <= 2^40
constexpr int kValueFraction = 26;          // value terms: |p * v| * 2^(26 - e) <= 2^26, with |v| < 2^e
constexpr int kMinExponent = -100;          // e at least this (tinier values): 2^(26 - e) stays a float
constexpr double kDenominatorScale = 1099511627776.0;  // 2^40 (kFraction)
constexpr size_t kFlush = 16;               // keys per int32 partial sum: 16 * 2^26 = 2^30 < 2^31
// ... or 32 (the tile kernels), whatever the probabilities: with p <= 1 and |v| at most 2^e (1 - 2^-24), the
// largest float below 2^e, a term is at most 2^26 - 4 (a float, so the product rounds to no more), and 32 of
// them at most 2^31 - 128.
constexpr size_t kTileFlush = 32;
constexpr double kMagic = 6755399441055744.0;  // 1.5 * 2^52: x + kMagic holds round(x) in its low bits
constexpr int64_t kMagicBits = 0x4338000000000000;

// round-to-nearest-even(x) for |x| < 2^51, by adding kMagic (also what the vector path does, 4 at a time).
inline int64_t fixed(double x) {
  const double t = x + kMagic;
  int64_t bits;
  std::memcpy(&bits, &t, sizeof bits);
  return bits - kMagicBits;
}

using Half = uint16_t;

// float16 -> float32: exact (vcvtph2ps's values).
inline float half_to_float(Half h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in float
    const float f = static_cast<float>(m) * 5.9604644775390625e-08f;
    return sign ? -f : f;
  }
  const uint32_t bits = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// float32 -> float16, to nearest with ties to even, as vcvtps2ph with rounding 0 does it: above 65504 by
// half a step or more infinity, below 2^-14 a subnormal, a NaN quiet with its payload's top bits.
inline Half float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000, mag = x & 0x7fffffff;
  if (mag >= 0x7f800000)  // infinity, or NaN
    return static_cast<Half>(sign | 0x7c00 | (mag > 0x7f800000 ? 0x200 | ((mag >> 13) & 0x3ff) : 0));
  if (mag >= 0x477ff000) return static_cast<Half>(sign | 0x7c00);  // 65520 and up
  if (mag < 0x38800000) {  // below 2^-14: round(|f| * 2^24) (the product exact), 1024 being 2^-14 itself
    float a;
    std::memcpy(&a, &mag, sizeof a);
    return static_cast<Half>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  const uint32_t m = mag - 0x38000000;  // the exponent rebiased (127 -> 15), then 13 bits rounded off
  return static_cast<Half>(sign | ((m + 0xfff + ((m >> 13) & 1)) >> 13));
}

void to_half_scalar(const float* x, Half* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = float_to_half(x[i]);
}

void to_float_scalar(const Half* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = half_to_float(x[i]);
}

// Rows of visible keys sit at scattered cache slots, which the hardware prefetcher cannot predict: ask
// for the row `kAhead` keys on while working on this one.
constexpr size_t kAhead = 8;
inline void prefetch_row(const float* row, int64_t d) {
  for (int64_t i = 0; i < d; i += 16) __builtin_prefetch(row + i);
}
inline void prefetch_half_row(const uint16_t* row, int64_t d) {
  for (int64_t i = 0; i < d; i += 32) __builtin_prefetch(row + i);
}

// The largest |v[i]| over float16 rows (their magnitudes' bits order as the values do), and so whether any
// is Inf or NaN (magnitude bits 0x7c00 and up).
uint16_t half_magnitude_scalar(const Half* const* rows, size_t count, int64_t d, int64_t from = 0) {
  uint16_t top = 0;
  for (size_t n = 0; n < count; ++n)
    for (int64_t i = from; i < d; ++i) top = std::max<uint16_t>(top, rows[n][i] & 0x7fff);
  return top;
}

#ifdef MXSPD_X86
__attribute__((target("avx2,fma,f16c"))) void to_half_avx2(const float* x, Half* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  to_half_scalar(x + i, y + i, n - i);
}

__attribute__((target("avx2,fma,f16c"))) void to_float_avx2(const Half* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
  to_float_scalar(x + i, y + i, n - i);
}

// One running maximum across the rows, reduced once (a row's reduction had cost more than its 4 loads at head
// size 64), the rows prefetched ahead (a server's rows sit at scattered slots).
__attribute__((target("avx2,fma"))) uint16_t half_magnitude_avx2(const Half* const* rows, size_t count, int64_t d) {
  const __m256i magnitude = _mm256_set1_epi16(0x7fff);
  __m256i top = _mm256_setzero_si256();
  const int64_t whole = d / 16 * 16;
  for (size_t n = 0; n < count; ++n) {
    if (n + kAhead < count) prefetch_half_row(rows[n + kAhead], d);
    for (int64_t i = 0; i < whole; i += 16)
      top = _mm256_max_epu16(
          top, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[n] + i)), magnitude));
  }
  alignas(32) uint16_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), top);
  uint16_t out = half_magnitude_scalar(rows, count, d, whole);
  for (uint16_t x : lanes) out = std::max(out, x);
  return out;
}

inline const bool kHasF16c = kHasAvx2 && __builtin_cpu_supports("f16c");
#endif

void to_half(const float* x, Half* y, int64_t n) {
#ifdef MXSPD_X86
  if (kHasF16c) return to_half_avx2(x, y, n);
#endif
  to_half_scalar(x, y, n);
}

void to_float(const Half* x, float* y, int64_t n) {
#ifdef MXSPD_X86
  if (kHasF16c) return to_float_avx2(x, y, n);
#endif
  to_float_scalar(x, y, n);
}

uint16_t half_magnitude(const Half* const* rows, size_t count, int64_t d) {
#ifdef MXSPD_X86
  if (kHasAvx2) return half_magnitude_avx2(rows, count, d);
#endif
  return half_magnitude_scalar(rows, count, d);
}

struct Problem {
  const float *q, *past_key, *past_value, *new_key, *new_value, *mask;
  float* y;
  int64_t b, hq, hkv, t, c, d, mask_heads;
  float scale;
  bool tokens_major;  // y is [B, T, Hq, D], not [B, Hq, T, D]
  const int32_t* lists = nullptr;    // each mask row's visible keys (list_task)
  const uint32_t* counts = nullptr;
  const float* key_range = nullptr;  // [B, Hkv, C + T]: each key's value range (value_range), or none
  int64_t tile_rows = 1;             // rows per task (see tile_unions)
  const int32_t* tile_keys = nullptr;  // each tile's keys: [B * mask heads * tiles, C + T] (tile_unions)
  const int64_t* tile_counts = nullptr;  // how many, or -1: the tile's rows run one at a time

  const float* key(int64_t batch, int64_t head, int64_t j) const {
    return j < c ? past_key + ((batch * hkv + head) * c + j) * d : new_key + ((batch * hkv + head) * t + j - c) * d;
  }
  const float* value(int64_t batch, int64_t head, int64_t j) const {
    return j < c ? past_value + ((batch * hkv + head) * c + j) * d
                 : new_value + ((batch * hkv + head) * t + j - c) * d;
  }
  // The float16 cache and the call's rounded new rows (the HalfKV ops), or none.
  const Half *past_key16 = nullptr, *past_value16 = nullptr, *new_key16 = nullptr, *new_value16 = nullptr;
  bool half_kv = false;
  bool half() const { return half_kv; }
  const Half* key16(int64_t batch, int64_t head, int64_t j) const {
    return j < c ? past_key16 + ((batch * hkv + head) * c + j) * d
                 : new_key16 + ((batch * hkv + head) * t + j - c) * d;
  }
  const Half* value16(int64_t batch, int64_t head, int64_t j) const {
    return j < c ? past_value16 + ((batch * hkv + head) * c + j) * d
                 : new_value16 + ((batch * hkv + head) * t + j - c) * d;
  }
};

// 16 lanes of fma sums (lane l: elements i = l mod 16 from `from` on) reduced to one float: lanes l and
// l + 8 added, then lane_sum.
float finish_dot(float lanes[16], const float* x, const float* y, int64_t from, int64_t d) {
  for (int64_t i = from; i < d; ++i) lanes[i % 16] = std::fma(x[i], y[i], lanes[i % 16]);
  float half[8];
  for (int l = 0; l < 8; ++l) half[l] = lanes[l] + lanes[l + 8];
  return lane_sum(half);
}

float dot_scalar(const float* x, const float* y, int64_t d) {
  float lanes[16] = {};
  return finish_dot(lanes, x, y, 0, d);
}

// The largest |v[i]| (a max: the same in any order) and whether any v[i] is Inf or NaN.
void scan_scalar(const float* v, int64_t d, float* largest, bool* bad) {
  for (int64_t i = 0; i < d; ++i) {
    *bad = *bad || !std::isfinite(v[i]);
    if (std::fabs(v[i]) > *largest) *largest = std::fabs(v[i]);
  }
}

// acc[i] += round(v[i] * factor): one float product, rounded to an integer (ties to even).
void accumulate_scalar(int32_t* acc, const float* v, float factor, int64_t d) {
  for (int64_t i = 0; i < d; ++i) acc[i] += static_cast<int32_t>(std::nearbyint(v[i] * factor));
}

// The int32 partial sums into the int64 ones (exact), and zeroed.
void flush(int32_t* part, int64_t* num, int64_t d) {
  for (int64_t i = 0; i < d; ++i) num[i] += part[i];
  std::fill(part, part + d, 0);
}

// A row's visible keys for one KV head as its passes read them (the values' range, each head's scores,
// each head's weighted sums; one call each, so that the vector paths' per-key steps inline): each key's
// and value's row and mask entry, gathered once per task for every head of its group and every pass.
struct Visible {
  const float* const* key;
  const float* const* value;
  const float* bias;  // the row's mask entry for each key
  size_t n;
  size_t ahead;  // keys from here on that may be prefetched (0: the rows are in cache)
  int64_t d;
  float scale;
  const Half* const* key16 = nullptr;  // the tile kernels: a float16 cache's rows, widened in registers
  const Half* const* value16 = nullptr;
};

void scan_values_scalar(const Visible& v, float* largest, bool* bad) {
  for (size_t n = 0; n < v.n; ++n) scan_scalar(v.value[n], v.d, largest, bad);
}

void scores_scalar(const Visible& v, const float* q, float* score) {
  for (size_t n = 0; n < v.n; ++n)
    score[n] = dot_scalar(q, v.key[n], v.d) * v.scale + v.bias[n];
}

// The softmax's two sums over the visible keys: den += p * 2^40, num += p * v * `scale` (2^(26 - e)).
void sums_scalar(const Visible& v, const float* prob, float scale, int32_t* part, int64_t* num, int64_t* den) {
  for (size_t n = 0; n < v.n; ++n) {
    *den += fixed(static_cast<double>(prob[n]) * kDenominatorScale);
    accumulate_scalar(part, v.value[n], prob[n] * scale, v.d);
    if ((n + 1) % kFlush == 0) flush(part, num, v.d);
  }
  flush(part, num, v.d);
}

// Up to kTile query vectors that see the same keys (the query heads of a KV head's group, rows of a call
// that share keys) work through them together on AVX-512: each key row's 16-float pieces loaded once for
// all of them, each vector keeping its own arithmetic, the bits it gets alone.
constexpr int kTile = 3;
constexpr int kSumTile = 4;  // the weighted sums, 4 registers a vector: 4 vectors (a KV head's 4 query heads)

// Tiles of at most `most` for `vectors`, as even as they go (4 vectors: 2 and 2, not 3 and 1).
int64_t balanced(int64_t vectors, int64_t most) {
  const int64_t tiles = (vectors + most - 1) / most;
  return (vectors + tiles - 1) / tiles;
}
constexpr int64_t kTileWaste = 8;  // rows share a tile while their union adds at most 1/8 to a row's keys

#ifdef MXSPD_X86
// finish_dot's additions without a tail, in registers: lanes l + (l + 8), then lane_sum's tree.
__attribute__((target("avx2,fma"))) inline float reduce16(__m256 lo, __m256 hi) {
  const __m256 h = _mm256_add_ps(lo, hi);
  const __m128 t = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));  // t0..t3
  const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));                                  // t0 + t2, t1 + t3
  return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
}

// The 16 lanes as two registers: elements i with i mod 16 < 8 in acc[0], the others in acc[1].
__attribute__((target("avx2,fma"))) inline float dot_avx2(const float* x, const float* y, int64_t d) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), acc[0]);
    acc[1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8), acc[1]);
  }
  if (i == d) return reduce16(acc[0], acc[1]);
  if (i + 8 <= d) {
    acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), acc[0]);
    i += 8;
  }
  alignas(32) float lanes[16];
  _mm256_store_ps(lanes, acc[0]);
  _mm256_store_ps(lanes + 8, acc[1]);
  return finish_dot(lanes, x, y, i, d);
}

__attribute__((target("avx2,fma"))) inline void scan_avx2(const float* v, int64_t d, float* largest, bool* bad) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 top = _mm256_setzero_ps(), nonfinite = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(v + i), magnitude);
    nonfinite = _mm256_or_ps(nonfinite, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // Inf, or NaN (unordered)
    top = _mm256_max_ps(top, a);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  for (float x : lanes) *largest = std::max(*largest, x);
  *bad = *bad || _mm256_movemask_ps(nonfinite) != 0;
  scan_scalar(v + i, d - i, largest, bad);
}

__attribute__((target("avx2,fma"))) inline void accumulate_avx2(int32_t* acc, const float* v, float factor,
                                                                int64_t d) {
  const __m256 f = _mm256_set1_ps(factor);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    __m256i* a = reinterpret_cast<__m256i*>(acc + i);
    const __m256i term = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i), f));
    _mm256_storeu_si256(a, _mm256_add_epi32(_mm256_loadu_si256(a), term));
  }
  accumulate_scalar(acc + i, v + i, factor, d - i);
}

__attribute__((target("avx2,fma"))) void scan_values_avx2(const Visible& v, float* largest, bool* bad) {
  for (size_t n = 0; n < v.n; ++n) {
    if (n + kAhead < v.ahead) prefetch_row(v.value[n + kAhead], v.d);
    scan_avx2(v.value[n], v.d, largest, bad);
  }
}

// dot_avx2 for 4 keys at once: the same operations per key, interleaved (one fma chain per key would
// otherwise wait on the previous fma's latency).
__attribute__((target("avx2,fma"))) inline void dot4_avx2(const float* x, const float* const* y, int64_t d,
                                                          float out[4]) {
  __m256 acc[4][2];
  for (auto& a : acc) a[0] = a[1] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    for (int half = 0; half < 2; ++half) {
      const __m256 xi = _mm256_loadu_ps(x + i + 8 * half);
      for (int k = 0; k < 4; ++k) acc[k][half] = _mm256_fmadd_ps(xi, _mm256_loadu_ps(y[k] + i + 8 * half), acc[k][half]);
    }
  }
  if (i + 8 <= d) {
    const __m256 xi = _mm256_loadu_ps(x + i);
    for (int k = 0; k < 4; ++k) acc[k][0] = _mm256_fmadd_ps(xi, _mm256_loadu_ps(y[k] + i), acc[k][0]);
    i += 8;
  }
  for (int k = 0; k < 4; ++k) {
    if (i == d) {
      out[k] = reduce16(acc[k][0], acc[k][1]);
      continue;
    }
    alignas(32) float lanes[16];
    _mm256_store_ps(lanes, acc[k][0]);
    _mm256_store_ps(lanes + 8, acc[k][1]);
    out[k] = finish_dot(lanes, x, y[k], i, d);
  }
}

// Eight keys' dot products (head sizes a multiple of 16), each in dot_avx2's order: two groups of 4 keys'
// fma chains, lanes l and l + 8 added per key; then lane_sum's additions (h[i] + h[i + 4], then
// (t0 + t2) + (t1 + t3)) done for the 8 keys together across registers, where reduce16 spends 7
// instructions on each key. Returns the 8 sums in key order.
__attribute__((target("avx2,fma"))) inline __m256 dot8_avx2(const float* x, const float* const* y, int64_t d) {
  __m256 h[8];
  for (int g = 0; g < 8; g += 4) {
    __m256 acc[4][2];
    for (auto& a : acc) a[0] = a[1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
      const __m256 lo = _mm256_loadu_ps(x + i), hi = _mm256_loadu_ps(x + i + 8);
      for (int k = 0; k < 4; ++k) {
        acc[k][0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(y[g + k] + i), acc[k][0]);
        acc[k][1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(y[g + k] + i + 8), acc[k][1]);
      }
    }
    for (int k = 0; k < 4; ++k) h[g + k] = _mm256_add_ps(acc[k][0], acc[k][1]);
  }
  __m256 t[4];  // t[j]: keys 2j and 2j + 1, lanes (h[i] + h[i + 4]) ordered i = 0, 2, 1, 3
  for (int j = 0; j < 4; ++j) {
    const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(h[2 * j], h[2 * j + 1], 0x20),
                                     _mm256_permute2f128_ps(h[2 * j], h[2 * j + 1], 0x31));
    t[j] = _mm256_permute_ps(sum, _MM_SHUFFLE(3, 1, 2, 0));
  }
  // hadd adds neighbours: first t0 + t2 and t1 + t3 per key, then those two; keys come out 0 2 4 6 1 3 5 7
  const __m256 r = _mm256_hadd_ps(_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
  return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

__attribute__((target("avx2,fma"))) void scores_avx2(const Visible& v, const float* q, float* score) {
  size_t n = 0;
  if (v.d % 16 == 0) {
    const __m256 scale = _mm256_set1_ps(v.scale);
    for (; n + 8 <= v.n; n += 8) {
      for (size_t k = n + kAhead; k < std::min(n + kAhead + 8, v.ahead); ++k) prefetch_row(v.key[k], v.d);
      const __m256 dots = dot8_avx2(q, v.key + n, v.d);
      _mm256_storeu_ps(score + n, _mm256_add_ps(_mm256_mul_ps(dots, scale), _mm256_loadu_ps(v.bias + n)));
    }
  }
  for (; n + 4 <= v.n; n += 4) {
    for (size_t k = n + kAhead; k < std::min(n + kAhead + 4, v.ahead); ++k) prefetch_row(v.key[k], v.d);
    dot4_avx2(q, v.key + n, v.d, score + n);
    for (int k = 0; k < 4; ++k) score[n + k] = score[n + k] * v.scale + v.bias[n + k];
  }
  for (; n < v.n; ++n) score[n] = dot_avx2(q, v.key[n], v.d) * v.scale + v.bias[n];
}

// Head sizes 64 and 128 (Chunks = 1 or 2): the weighted sums 64 columns at a time, their int32 partial
// sums in 8 registers across keys (moved into int64 every kFlush keys). The denominator's terms are added
// in the first chunk's loop: scalar double work beside the vector work (measured: a separate vector
// loop over them was slower).
template <int Chunks>
__attribute__((target("avx2,fma"))) void sums_in_registers(const Visible& v, const float* prob, float scale,
                                                           int64_t* num, int64_t* den) {
  for (int c = 0; c < 64 * Chunks; c += 64) {
    __m256i acc[8];
    for (auto& a : acc) a = _mm256_setzero_si256();
    for (size_t n = 0; n < v.n; ++n) {
      const float* x = v.value[n] + c;
      if (c == 0) *den += fixed(static_cast<double>(prob[n]) * kDenominatorScale);
      if (c == 0 && n + kAhead < v.ahead) prefetch_row(v.value[n + kAhead], v.d);
      const __m256 f = _mm256_set1_ps(prob[n] * scale);
      for (int j = 0; j < 8; ++j)
        acc[j] = _mm256_add_epi32(acc[j], _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), f)));
      if ((n + 1) % kFlush == 0 || n + 1 == v.n) {  // into the int64 sums, widened 4 lanes at a time
        for (int j = 0; j < 8; ++j) {
          for (int half = 0; half < 2; ++half) {
            __m256i* sum = reinterpret_cast<__m256i*>(num + c + 8 * j + 4 * half);
            const __m128i lanes = half ? _mm256_extracti128_si256(acc[j], 1) : _mm256_castsi256_si128(acc[j]);
            _mm256_storeu_si256(sum, _mm256_add_epi64(_mm256_loadu_si256(sum), _mm256_cvtepi32_epi64(lanes)));
          }
          acc[j] = _mm256_setzero_si256();
        }
      }
    }
  }
}

__attribute__((target("avx2,fma"))) void sums_avx2(const Visible& v, const float* prob, float scale, int32_t* part,
                                                   int64_t* num, int64_t* den) {
  if (v.d == 64) return sums_in_registers<1>(v, prob, scale, num, den);
  if (v.d == 128) return sums_in_registers<2>(v, prob, scale, num, den);
  for (size_t n = 0; n < v.n; ++n) {
    *den += fixed(static_cast<double>(prob[n]) * kDenominatorScale);
    if (n + kAhead < v.ahead) prefetch_row(v.value[n + kAhead], v.d);
    accumulate_avx2(part, v.value[n], prob[n] * scale, v.d);
    if ((n + 1) % kFlush == 0) flush(part, num, v.d);
  }
  flush(part, num, v.d);
}

// ---- AVX-512: the same per-lane operations, 16 lanes at a time (the dot product's 16 lanes in one
// register; the values' scan and sums elementwise, so their width cannot change a bit). exp stays on
// the AVX2 path: it is a small part of a key's work.
__attribute__((target(MXSPD_AVX512))) void scan_values_avx512(const Visible& v, float* largest, bool* bad) {
  if (v.d % 16) return scan_values_avx2(v, largest, bad);
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __m512 top[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  __mmask16 nonfinite = 0;
  for (size_t n = 0; n < v.n; ++n) {
    const float* x = v.value[n];
    if (n + kAhead < v.ahead) prefetch_row(v.value[n + kAhead], v.d);
    for (int64_t i = 0; i < v.d; i += 64)  // four maxima chains (a max is exact: any order, the same)
      for (int k = 0; k < 4 && i + 16 * k < v.d; ++k) {
        const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + i + 16 * k));
        nonfinite |= _mm512_cmp_ps_mask(a, inf, _CMP_NLT_UQ);  // Inf, or NaN (unordered)
        top[k] = _mm512_max_ps(top[k], a);
      }
  }
  const __m512 all = _mm512_max_ps(_mm512_max_ps(top[0], top[1]), _mm512_max_ps(top[2], top[3]));
  *largest = std::max(*largest, _mm512_reduce_max_ps(all));
  *bad = *bad || nonfinite != 0;
}

// Eight keys' dot products at once, each in one 16-lane register (finish_dot's order): eight fma chains,
// so that each fma's latency is hidden behind the other keys' (four left half of the issue slots idle).
constexpr int kDotKeys = 8;
__attribute__((target(MXSPD_AVX512))) inline void dot8_avx512(const float* x, const float* const y[kDotKeys],
                                                              int64_t d, float out[kDotKeys]) {
  __m512 acc[kDotKeys];
  for (auto& a : acc) a = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const __m512 xi = _mm512_loadu_ps(x + i);
    for (int k = 0; k < kDotKeys; ++k) acc[k] = _mm512_fmadd_ps(xi, _mm512_loadu_ps(y[k] + i), acc[k]);
  }
  for (int k = 0; k < kDotKeys; ++k) {
    if (i == d) {
      out[k] = reduce16(_mm512_castps512_ps256(acc[k]), _mm512_extractf32x8_ps(acc[k], 1));
      continue;
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, acc[k]);
    out[k] = finish_dot(lanes, x, y[k], i, d);
  }
}

__attribute__((target(MXSPD_AVX512))) void scores_avx512(const Visible& v, const float* q, float* score) {
  size_t n = 0;
  for (; n + kDotKeys <= v.n; n += kDotKeys) {
    const float* keys[kDotKeys];
    for (int k = 0; k < kDotKeys; ++k) keys[k] = v.key[n + k];
    for (size_t k = n + kAhead; k < std::min(n + kAhead + kDotKeys, v.ahead); ++k)
      prefetch_row(v.key[k], v.d);
    dot8_avx512(q, keys, v.d, score + n);
    for (int k = 0; k < kDotKeys; ++k) score[n + k] = score[n + k] * v.scale + v.bias[n + k];
  }
  for (; n < v.n; ++n)
    score[n] = dot_avx2(q, v.key[n], v.d) * v.scale + v.bias[n];
}

// reduce16 for 8 keys at once: acc[k]'s lanes l and l + 8 added, then lane_sum's tree, the same additions
// across registers (stage by stage: two keys per register, then four, then eight). Returns the 8 sums in
// key order.
__attribute__((target(MXSPD_AVX512))) inline __m256 reduce8x16(const __m512 (&acc)[8]) {
  __m512 h[4], t[2];  // h[m]: keys 2m, 2m + 1, lanes l + (l + 8); t[m]: keys 4m..4m + 3, h[i] + h[i + 4]
  for (int m = 0; m < 4; ++m)
    h[m] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * m], acc[2 * m + 1], 0x44),
                         _mm512_shuffle_f32x4(acc[2 * m], acc[2 * m + 1], 0xee));
  for (int m = 0; m < 2; ++m)
    t[m] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * m], h[2 * m + 1], 0x88),
                         _mm512_shuffle_f32x4(h[2 * m], h[2 * m + 1], 0xdd));
  // per 128 bits: key L then key L + 4, each (t0 + t2, t1 + t3); then their sum, keys L and L + 4 first
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(t[0]), _mm512_castps_pd(t[1]));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(t[0]), _mm512_castps_pd(t[1]));
  const __m512 u = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(u, u, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(u, u, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, s));
}

// Q vectors' scores (head sizes a multiple of 16), 8 keys at a time: each (vector, key) one 16-lane fma
// chain (dot8_avx512's order), reduced by reduce8x16; then * scale + bias. A bias of -infinity marks a key
// the vector does not see (a row of a tile whose other rows see it): its score is -infinity, whatever the
// key holds.
// A row's 16 elements from i on: float32, or float16 widened (exactly: the float32 a widened copy holds).
__attribute__((target(MXSPD_AVX512))) inline __m512 load16(const float* row, int64_t i) {
  return _mm512_loadu_ps(row + i);
}
__attribute__((target(MXSPD_AVX512))) inline __m512 load16(const Half* row, int64_t i) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i)));
}
// The same, kept in a register for the tile's products: GCC folded a plain load into each vector's multiply
// as its memory operand, loading the piece once per vector (27 loads a step of 3 vectors and 8 keys, where 11
// do): on a Zen 5 the scores of 3 vectors from L1 then took 2x as long.
template <typename T>
__attribute__((target(MXSPD_AVX512))) inline __m512 load16_once(const T* row, int64_t i) {
  __m512 y = load16(row, i);
  __asm__("" : "+v"(y));
  return y;
}
inline void prefetch_any(const float* row, int64_t d) { prefetch_row(row, d); }
inline void prefetch_any(const Half* row, int64_t d) { prefetch_half_row(row, d); }

template <int Q, typename T>
__attribute__((target(MXSPD_AVX512))) void tile_scores_avx512(const Visible& v, const T* const* key,
                                                              const float* const* q, const float* const* bias,
                                                              float* const* score) {
  const __m256 scale = _mm256_set1_ps(v.scale), hidden = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  size_t n = 0;
  for (; n + 8 <= v.n; n += 8) {
    for (size_t k = n + kAhead; k < std::min(n + kAhead + 8, v.ahead); ++k) prefetch_any(key[k], v.d);
    __m512 acc[Q][8];
    for (auto& a : acc)
      for (auto& x : a) x = _mm512_setzero_ps();
    for (int64_t i = 0; i < v.d; i += 16) {
      __m512 x[Q];
      for (int j = 0; j < Q; ++j) x[j] = _mm512_loadu_ps(q[j] + i);
      for (int k = 0; k < 8; ++k) {
        const __m512 y = load16_once(key[n + k], i);
        for (int j = 0; j < Q; ++j) acc[j][k] = _mm512_fmadd_ps(x[j], y, acc[j][k]);
      }
    }
    for (int j = 0; j < Q; ++j) {
      const __m256 b = _mm256_loadu_ps(bias[j] + n);
      const __m256 s = _mm256_add_ps(_mm256_mul_ps(reduce8x16(acc[j]), scale), b);
      _mm256_storeu_ps(score[j] + n, _mm256_mask_mov_ps(s, _mm256_cmp_ps_mask(b, hidden, _CMP_EQ_OQ), hidden));
    }
  }
  for (; n < v.n; ++n)  // the last keys one at a time, each in the same 16 lanes and reduce16
    for (int j = 0; j < Q; ++j) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < v.d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q[j] + i), load16(key[n], i), acc);
      const float dot = reduce16(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
      score[j][n] = bias[j][n] == -std::numeric_limits<float>::infinity() ? bias[j][n] : dot * v.scale + bias[j][n];
    }
}

// A vector's denominator terms, fixed(p * 2^40), 8 at a time (lane by lane; integer sums in any order).
__attribute__((target(MXSPD_AVX512))) int64_t denominator_avx512(const float* prob, size_t count) {
  const __m512d scale40 = _mm512_set1_pd(kDenominatorScale), magic = _mm512_set1_pd(kMagic);
  __m512i terms = _mm512_setzero_si512();
  size_t n = 0;
  for (; n + 8 <= count; n += 8) {
    const __m512d t = _mm512_add_pd(_mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(prob + n)), scale40), magic);
    terms = _mm512_add_epi64(terms, _mm512_sub_epi64(_mm512_castpd_si512(t), _mm512_set1_epi64(kMagicBits)));
  }
  int64_t sum = _mm512_reduce_add_epi64(terms);
  for (; n < count; ++n) sum += fixed(static_cast<double>(prob[n]) * kDenominatorScale);
  return sum;
}

// Q vectors' weighted sums over the same value rows, 16 W columns at a time (head sizes a multiple of
// that): the int32 partial sums in registers across keys (W a vector), each value piece loaded once for all
// Q (a key a vector does not see has p = 0: its terms are 0).
template <int Q, int W, typename T>
__attribute__((target(MXSPD_AVX512))) void tile_sums_avx512(const Visible& v, const T* const* value,
                                                            const float* const* prob, const float* step,
                                                            int64_t* const* num, int64_t* const* den) {
  for (int j = 0; j < Q; ++j) *den[j] += denominator_avx512(prob[j], v.n);
  for (int64_t c = 0; c < v.d; c += 16 * W)
    for (size_t n0 = 0; n0 < v.n; n0 += kTileFlush) {
      __m512i acc[Q][W];
      for (auto& a : acc)
        for (auto& x : a) x = _mm512_setzero_si512();
      for (size_t n = n0; n < std::min(n0 + kTileFlush, v.n); ++n) {
        const T* x = value[n] + c;
        if (c == 0 && n + kAhead < v.ahead) prefetch_any(value[n + kAhead], v.d);
        __m512 f[Q];
        for (int j = 0; j < Q; ++j) f[j] = _mm512_set1_ps(prob[j][n] * step[j]);
        for (int i = 0; i < W; ++i) {
          const __m512 y = load16_once(x, 16 * i);
          for (int j = 0; j < Q; ++j)
            acc[j][i] = _mm512_add_epi32(acc[j][i], _mm512_cvtps_epi32(_mm512_mul_ps(y, f[j])));
        }
      }
      for (int j = 0; j < Q; ++j)  // into the int64 sums
        for (int i = 0; i < W; ++i)
          for (int half = 0; half < 2; ++half) {
            int64_t* sum = num[j] + c + 16 * i + 8 * half;
            const __m256i lanes = _mm512_extracti64x4_epi64(acc[j][i], half);
            _mm512_storeu_si512(sum, _mm512_add_epi64(_mm512_loadu_si512(sum), _mm512_cvtepi32_epi64(lanes)));
          }
    }
}
#endif

// q vectors (1 to kTile) through the tile kernels (the AVX-512 path's: see tiled()), over v's float32 rows
// or its float16 ones.
#ifdef MXSPD_X86
template <typename T>
void tile_scores_rows(const Visible& v, const T* const* key, int q, const float* const* query,
                      const float* const* bias, float* const* score) {
  switch (q) {
    case 1: return tile_scores_avx512<1>(v, key, query, bias, score);
    case 2: return tile_scores_avx512<2>(v, key, query, bias, score);
    default: return tile_scores_avx512<3>(v, key, query, bias, score);
  }
}

template <typename T>
void tile_sums_rows(const Visible& v, const T* const* value, int q, const float* const* prob, const float* step,
                    int64_t* const* num, int64_t* const* den) {
  switch (q) {  // one vector: 128 columns a pass where they divide the head (8 registers, not 2 passes of 4)
    case 1: return v.d % 128 ? tile_sums_avx512<1, 4>(v, value, prob, step, num, den)
                             : tile_sums_avx512<1, 8>(v, value, prob, step, num, den);
    case 2: return tile_sums_avx512<2, 4>(v, value, prob, step, num, den);
    case 3: return tile_sums_avx512<3, 4>(v, value, prob, step, num, den);
    default: return tile_sums_avx512<4, 4>(v, value, prob, step, num, den);
  }
}
#endif

void tile_scores(const Visible& v, int q, const float* const* query, const float* const* bias, float* const* score) {
#ifdef MXSPD_X86
  if (v.key16) return tile_scores_rows(v, v.key16, q, query, bias, score);
  tile_scores_rows(v, v.key, q, query, bias, score);
#endif
}

void tile_sums(const Visible& v, int q, const float* const* prob, const float* step, int64_t* const* num,
               int64_t* const* den) {
#ifdef MXSPD_X86
  if (v.value16) return tile_sums_rows(v, v.value16, q, prob, step, num, den);
  tile_sums_rows(v, v.value, q, prob, step, num, den);
#endif
}

void scan_values(const Visible& v, float* largest, bool* bad) {
#ifdef MXSPD_X86
  if (kHasAvx512) return scan_values_avx512(v, largest, bad);
  if (kHasAvx2) return scan_values_avx2(v, largest, bad);
#endif
  scan_values_scalar(v, largest, bad);
}

// One key's value range: its largest |v[i]|, or infinity where it holds an Inf or NaN (a row that sees
// it is then NaN). The largest over a row's visible keys is the largest |v| scan_values finds.
float value_range(const float* v, int64_t d) {
  float largest = 0.0f;
  bool bad = false;
#ifdef MXSPD_X86
  if (kHasAvx2)
    scan_avx2(v, d, &largest, &bad);
  else
#endif
    scan_scalar(v, d, &largest, &bad);
  return bad ? std::numeric_limits<float>::infinity() : largest;
}

void scores(const Visible& v, const float* q, float* score) {
#ifdef MXSPD_X86
  if (kHasAvx512) return scores_avx512(v, q, score);
  if (kHasAvx2) return scores_avx2(v, q, score);
#endif
  scores_scalar(v, q, score);
}

// The indices first + j of the keys a row sees (mask[j] above kHidden), in order; returns how many.
size_t visible_scalar(const float* mask, int64_t keys, int32_t* out, int64_t first = 0) {
  size_t n = 0;
  for (int64_t j = 0; j < keys; ++j)
    if (mask[j] > kHidden) out[n++] = static_cast<int32_t>(first + j);
  return n;
}

#ifdef MXSPD_X86
__attribute__((target("avx2,fma"))) size_t visible_avx2(const float* mask, int64_t keys, int32_t* out) {
  const __m256 hidden = _mm256_set1_ps(kHidden);
  size_t n = 0;
  int64_t j = 0;
  for (; j + 8 <= keys; j += 8) {
    unsigned bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(mask + j), hidden, _CMP_GT_OQ));
    for (; bits; bits &= bits - 1) out[n++] = static_cast<int32_t>(j + __builtin_ctz(bits));
  }
  return n + visible_scalar(mask + j, keys - j, out + n, j);
}
#endif

#ifdef MXSPD_X86
__attribute__((target(MXSPD_AVX512))) size_t visible_avx512(const float* mask, int64_t keys, int32_t* out) {
  const __m512 hidden = _mm512_set1_ps(kHidden);
  size_t n = 0;
  int64_t j = 0;
  for (; j + 16 <= keys; j += 16)
    for (unsigned bits = _mm512_cmp_ps_mask(_mm512_loadu_ps(mask + j), hidden, _CMP_GT_OQ); bits; bits &= bits - 1)
      out[n++] = static_cast<int32_t>(j + __builtin_ctz(bits));
  return n + visible_scalar(mask + j, keys - j, out + n, j);
}
#endif

size_t visible_keys(const float* mask, int64_t keys, int32_t* out) {
#ifdef MXSPD_X86
  if (kHasAvx512) return visible_avx512(mask, keys, out);
  if (kHasAvx2) return visible_avx2(mask, keys, out);
#endif
  return visible_scalar(mask, keys, out);
}

// y = num / den * 2^shift, each rounded once to float (the product by 2^shift is exact in double).
void normalise_scalar(const int64_t* num, int64_t den, int shift, float* y, int64_t d) {
  const double power = std::ldexp(1.0, shift);  // a normal double: the product is ldexp's, without a call
  const bool exact = std::isnormal(power);
  for (int64_t i = 0; i < d; ++i) {
    const double q = static_cast<double>(num[i]) / static_cast<double>(den);
    y[i] = static_cast<float>(exact ? q * power : std::ldexp(q, shift));
  }
}

#ifdef MXSPD_X86
__attribute__((target(MXSPD_AVX512))) void normalise_avx512(const int64_t* num, int64_t den, int shift, float* y,
                                                            int64_t d) {
  const __m512d divisor = _mm512_set1_pd(static_cast<double>(den)), power = _mm512_set1_pd(std::ldexp(1.0, shift));
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m512d q = _mm512_div_pd(_mm512_cvtepi64_pd(_mm512_loadu_si512(num + i)), divisor);
    _mm256_storeu_ps(y + i, _mm512_cvtpd_ps(_mm512_mul_pd(q, power)));
  }
  normalise_scalar(num + i, den, shift, y + i, d - i);
}
#endif

#ifdef MXSPD_X86
// Each int64 sum turned into a double exactly by the magic-number trick (|num| < 2^51: see normalise).
__attribute__((target("avx2,fma"))) void normalise_avx2(const int64_t* num, int64_t den, int shift, float* y,
                                                        int64_t d) {
  const __m256d divisor = _mm256_set1_pd(static_cast<double>(den)), power = _mm256_set1_pd(std::ldexp(1.0, shift));
  const __m256d magic = _mm256_set1_pd(kMagic);
  int64_t i = 0;
  for (; i + 4 <= d; i += 4) {
    const __m256i bits = _mm256_add_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(num + i)),
                                          _mm256_set1_epi64x(kMagicBits));
    const __m256d q = _mm256_div_pd(_mm256_sub_pd(_mm256_castsi256_pd(bits), magic), divisor);
    _mm_storeu_ps(y + i, _mm256_cvtpd_ps(_mm256_mul_pd(q, power)));
  }
  normalise_scalar(num + i, den, shift, y + i, d - i);
}
#endif

// `terms` keys' sums: each term is at most 2^26 in magnitude, so below 2^24 terms every sum is below 2^50
// and the AVX2 path's conversion is exact.
void normalise(const int64_t* num, int64_t den, int shift, float* y, int64_t d, size_t terms) {
#ifdef MXSPD_X86
  if (kHasAvx512) return normalise_avx512(num, den, shift, y, d);
  if (kHasAvx2 && terms < (size_t{1} << 24) && std::isnormal(std::ldexp(1.0, shift)))
    return normalise_avx2(num, den, shift, y, d);
#endif
  normalise_scalar(num, den, shift, y, d);
}

// The largest score (a max: the same in any order; NaN scores skipped) and whether any is NaN.
float largest_score_scalar(const float* score, size_t n, bool* bad) {
  float top = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < n; ++i) {
    top = std::max(top, score[i]);
    *bad = *bad || std::isnan(score[i]);
  }
  return top;
}

#ifdef MXSPD_X86
__attribute__((target(MXSPD_AVX512))) float largest_score_avx512(const float* score, size_t n, bool* bad) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 s = _mm512_loadu_ps(score + i);
    nan |= _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q);
    top = _mm512_max_ps(s, top);  // a NaN s gives the second operand, top
  }
  *bad = *bad || nan != 0;
  return std::max(_mm512_reduce_max_ps(top), largest_score_scalar(score + i, n - i, bad));
}
#endif

float largest_score(const float* score, size_t n, bool* bad) {
#ifdef MXSPD_X86
  if (kHasAvx512) return largest_score_avx512(score, n, bad);
#endif
  return largest_score_scalar(score, n, bad);
}

void sums(const Visible& v, const float* prob, float scale, int32_t* part, int64_t* num, int64_t* den) {
#ifdef MXSPD_X86
  if (kHasAvx2) return sums_avx2(v, prob, scale, part, num, den);
#endif
  sums_scalar(v, prob, scale, part, num, den);
}

// A tile row's scores' biases: its mask entry for each of the tile's keys, or (`hide`: a tile of several
// rows) -infinity where the row does not see the key; and the largest value range over the row's own keys.
void row_bias_scalar(const float* mask, const int32_t* list, size_t count, bool hide, float* bias) {
  for (size_t n = 0; n < count; ++n)
    bias[n] = !hide || mask[list[n]] > kHidden ? mask[list[n]] : -std::numeric_limits<float>::infinity();
}

float largest_range_scalar(const float* range, const int32_t* own, size_t count) {
  float top = 0.0f;  // (ranges are never NaN: a key with a NaN value has range infinity)
  for (size_t n = 0; n < count; ++n) top = std::max(top, range[own[n]]);
  return top;
}

#ifdef MXSPD_X86
__attribute__((target(MXSPD_AVX512))) void row_bias_avx512(const float* mask, const int32_t* list, size_t count,
                                                           bool hide, float* bias) {
  const __m512 hidden = _mm512_set1_ps(kHidden), minus = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  size_t n = 0;
  for (; n + 16 <= count; n += 16) {
    const __m512 m = _mm512_i32gather_ps(_mm512_loadu_si512(list + n), mask, 4);
    _mm512_storeu_ps(bias + n, hide ? _mm512_mask_mov_ps(minus, _mm512_cmp_ps_mask(m, hidden, _CMP_GT_OQ), m) : m);
  }
  row_bias_scalar(mask, list + n, count - n, hide, bias + n);
}

__attribute__((target(MXSPD_AVX512))) float largest_range_avx512(const float* range, const int32_t* own,
                                                                 size_t count) {
  __m512 top = _mm512_setzero_ps();
  size_t n = 0;
  for (; n + 16 <= count; n += 16) top = _mm512_max_ps(top, _mm512_i32gather_ps(_mm512_loadu_si512(own + n), range, 4));
  return std::max(_mm512_reduce_max_ps(top), largest_range_scalar(range, own + n, count - n));
}
#endif

// Each listed key's row among one KV head's keys or values: key j < c is cache slot j of `past`, else row
// j - c of the call's `fresh` ones (addresses as integers: `fresh` less c rows may lie before the array).
template <typename T>
void key_rows_scalar(const T* past, const T* fresh, int64_t c, int64_t d, const int32_t* list, size_t count,
                     const T** rows) {
  for (size_t n = 0; n < count; ++n) rows[n] = list[n] < c ? past + list[n] * d : fresh + (list[n] - c) * d;
}

#ifdef MXSPD_X86
template <typename T>
__attribute__((target(MXSPD_AVX512))) void key_rows_avx512(const T* past, const T* fresh, int64_t c, int64_t d,
                                                           const int32_t* list, size_t count, const T** rows) {
  const int64_t size = d * static_cast<int64_t>(sizeof(T));
  const __m512i from_past = _mm512_set1_epi64(static_cast<int64_t>(reinterpret_cast<uintptr_t>(past)));
  const __m512i from_fresh = _mm512_set1_epi64(static_cast<int64_t>(reinterpret_cast<uintptr_t>(fresh)) - c * size);
  const __m512i slots = _mm512_set1_epi64(c), row = _mm512_set1_epi64(size);
  size_t n = 0;
  for (; n + 8 <= count; n += 8) {
    const __m512i j = _mm512_cvtepi32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(list + n)));
    const __m512i base = _mm512_mask_mov_epi64(from_fresh, _mm512_cmplt_epi64_mask(j, slots), from_past);
    _mm512_storeu_si512(rows + n, _mm512_add_epi64(base, _mm512_mullo_epi64(j, row)));
  }
  key_rows_scalar(past, fresh, c, d, list + n, count - n, rows + n);
}
#endif

template <typename T>
void key_rows(const T* past, const T* fresh, int64_t c, int64_t d, const int32_t* list, size_t count, const T** rows) {
#ifdef MXSPD_X86
  if (kHasAvx512) return key_rows_avx512(past, fresh, c, d, list, count, rows);
#endif
  key_rows_scalar(past, fresh, c, d, list, count, rows);
}

void row_bias(const float* mask, const int32_t* list, size_t count, bool hide, float* bias) {
#ifdef MXSPD_X86
  if (kHasAvx512) return row_bias_avx512(mask, list, count, hide, bias);
#endif
  row_bias_scalar(mask, list, count, hide, bias);
}

float largest_range(const float* range, const int32_t* own, size_t count) {
#ifdef MXSPD_X86
  if (kHasAvx512) return largest_range_avx512(range, own, count);
#endif
  return largest_range_scalar(range, own, count);
}

// Query heads per task: a KV head's whole group when every head shares the mask (the values' range
// and the visible list are then found once for the group) and there are tasks enough for the cores;
// else one. A head's arithmetic is the same either way. On 2 cores SmolLM2's decode step then runs 3
// tasks instead of 9: 25% less attention time (7% less call time at 400 keys, none lost at 100).
const int64_t kCores = std::max(1u, std::thread::hardware_concurrency());
int64_t group(const Problem& p) {
  return p.mask_heads == 1 && (p.t >= 4 || p.b * p.hkv * p.t >= kCores) ? p.hq / p.hkv : 1;
}

// Each mask row's visible keys, found once per call (every head group of the row reads the list, where
// each group used to scan the row's whole mask again: 3 scans of 8,256 slots a row at SmolLM2's 8,192-slot
// server cache). Row r's indices sit at index + r * (C + T), count[r] of them.
struct Lists {
  const Problem* p;
  int32_t* index;
  uint32_t* count;
};

void list_task(void* user, size_t row) {
  const Lists& l = *static_cast<const Lists*>(user);
  const int64_t keys = l.p->c + l.p->t, r = static_cast<int64_t>(row);
  l.count[row] = static_cast<uint32_t>(visible_keys(l.p->mask + r * keys, keys, l.index + r * keys));
}

// Calls whose rows share keys (a prefill chunk, a scoring call: each visible key seen by kShared rows or
// more on average) find each key's value range once (range_task, for the keys some row sees), where each
// row would scan its visible values again: a row then reads one float per key, not D. Rows of different
// sequences (a server's step) scan their own keys, which their sums then read again from cache.
constexpr int64_t kShared = 2;

struct Ranges {
  const Problem* p;
  const uint8_t* seen;  // [B, C + T]: some row of the batch sees the key
  float* out;           // [B, Hkv, C + T]
  const Problem* wide;  // a float16 cache: where its seen rows are widened to float32 for every row's use
};

// One task: (batch, KV head) -> the value ranges of the keys its rows see (a float16 cache's rows
// widened first: the rows that share them then read float32, as a float32 cache's would, instead of each
// widening them again).
void range_task(void* user, size_t index) {
  const Ranges& r = *static_cast<const Ranges*>(user);
  const Problem& p = *r.p;
  const int64_t keys = p.c + p.t, bb = static_cast<int64_t>(index) / p.hkv, kv = static_cast<int64_t>(index) % p.hkv;
  const uint8_t* seen = r.seen + bb * keys;
  float* out = r.out + static_cast<int64_t>(index) * keys;
  for (int64_t j = 0; j < keys; ++j) {
    if (!seen[j]) continue;
    if (r.wide) {
      to_float(p.key16(bb, kv, j), const_cast<float*>(r.wide->key(bb, kv, j)), p.d);
      to_float(p.value16(bb, kv, j), const_cast<float*>(r.wide->value(bb, kv, j)), p.d);
    }
    out[j] = value_range((r.wide ? r.wide : &p)->value(bb, kv, j), p.d);
  }
}

// Keys per block: each vector of a task works through a block in turn, so that the first brings the
// block's key (or value) rows into L1, prefetching ahead, and the others read them there. (Vector by vector
// over all keys, each read every row again from L2 or memory, and prefetched it again.)
constexpr size_t kBlock = 32;

// The tile kernels' path: AVX-512, head sizes a multiple of 64 (others run vector by vector).
bool tiled(const Problem& p) {
#ifdef MXSPD_X86
  return kHasAvx512 && p.d % 64 == 0;
#else
  return false;
#endif
}

// For a call whose rows share keys (each key's value range found once) where the tile kernels run: rows
// per task, as many as fill a tile beside the group's query heads, and each tile's keys (the union of its
// rows' lists, in key order), found once per call; a tile whose union adds more than 1/kTileWaste to one of
// its rows' keys (rows of different sequences) is marked -1.
int64_t tile_unions(const Problem& p, std::vector<int32_t>& keys_out, std::vector<int64_t>& counts_out) {
  const int64_t rows = std::max<int64_t>(1, kTile / group(p)), keys = p.c + p.t;
  if (!tiled(p) || rows == 1) return 1;
  const int64_t tiles = (p.t + rows - 1) / rows, all = p.b * p.mask_heads * tiles;
  if (keys_out.size() < static_cast<size_t>(all * keys)) keys_out.resize(all * keys);
  counts_out.resize(all);
  std::vector<int32_t> merged, next;
  for (int64_t i = 0; i < all; ++i) {
    merged.clear();
    size_t most = 0;
    const int64_t first = i / tiles * p.t + i % tiles * rows;  // its first mask row
    for (int64_t r = first; r < first + rows && r < (i / tiles + 1) * p.t; ++r) {
      const int32_t* own = p.lists + r * keys;
      most = std::max<size_t>(most, p.counts[r]);
      next.resize(merged.size() + p.counts[r]);
      next.erase(std::set_union(merged.begin(), merged.end(), own, own + p.counts[r], next.begin()), next.end());
      merged.swap(next);
    }
    std::copy(merged.begin(), merged.end(), keys_out.begin() + i * keys);
    const auto size = static_cast<int64_t>(merged.size());
    counts_out[i] = size * kTileWaste > static_cast<int64_t>(most) * (kTileWaste + 1) ? -1 : size;
  }
  return rows;
}

int64_t tasks(const Problem& p) {
  const int64_t rows = p.tile_rows;
  return p.b * (p.hq / group(p)) * ((p.t + rows - 1) / rows);
}

// Rows tt0 .. tt0 + n - 1 of batch bb, query heads h0 .. h0 + group - 1 (one KV head's), as one tile of
// vectors (row-major, heads within a row) over the union of the rows' visible keys (`union_keys`; one row:
// its own list); each vector's arithmetic is what it gets alone: its scores key by key, a key it does not
// see -infinity and p = 0 (terms of 0), its sums exact integers added in any grouping. Returns false, having written nothing,
// where a row of several would meet an Inf or NaN value it does not see (0 times it is no 0): the rows then
// run one at a time.
bool attend_tile(const Problem& p, int64_t bb, int64_t h0, int64_t tt0, int64_t n_rows,
                 const int32_t* union_keys = nullptr, size_t union_count = 0) {
  const int64_t g = group(p), keys = p.c + p.t, kv = h0 / (p.hq / p.hkv), vectors = n_rows * g;
  const auto mask_row = [&](int64_t r) {
    return (bb * p.mask_heads + (p.mask_heads == 1 ? 0 : h0)) * p.t + tt0 + r;
  };
  thread_local std::vector<int64_t> num, den;
  thread_local std::vector<int32_t> part;
  thread_local std::vector<float> score, prob, bias, largest, step;
  thread_local std::vector<int> exponent;
  thread_local std::vector<const float*> rows;  // each visible key's row, then each value's (float32 cache)
  thread_local std::vector<const Half*> rows16;  // the same, float16 cache
  thread_local std::vector<float> wide;         // a block of float16 rows widened: kBlock keys, then values
  thread_local std::vector<const float*> wide_rows;
  thread_local std::vector<uint8_t> bad_values;
  thread_local std::vector<int64_t> live;
  const int32_t* list = p.lists + mask_row(0) * keys;
  size_t count = p.counts[mask_row(0)];
  const float* range = p.key_range ? p.key_range + (bb * p.hkv + kv) * keys : nullptr;
  if (union_keys) {  // the tile's keys
    if (std::isinf(largest_range(range, union_keys, union_count))) return false;
    list = union_keys, count = union_count;
  }
  bias.resize(n_rows * count);
  largest.assign(n_rows, 0.0f);
  bad_values.assign(n_rows, 0);  // an Inf or NaN value the row sees: its output is NaN
  for (int64_t r = 0; r < n_rows; ++r) {
    row_bias(p.mask + mask_row(r) * keys, list, count, n_rows > 1, bias.data() + r * count);
    if (range) {
      const float top = largest_range(range, p.lists + mask_row(r) * keys, p.counts[mask_row(r)]);
      largest[r] = top, bad_values[r] = std::isinf(top);
    }
  }
  const int64_t past = (bb * p.hkv + kv) * p.c * p.d, fresh = (bb * p.hkv + kv) * p.t * p.d;
  if (p.half()) {
    rows16.resize(2 * count);
    key_rows(p.past_key16 + past, p.new_key16 + fresh, p.c, p.d, list, count, rows16.data());
    key_rows(p.past_value16 + past, p.new_value16 + fresh, p.c, p.d, list, count, rows16.data() + count);
    wide.resize(2 * kBlock * p.d);
    wide_rows.resize(2 * kBlock);
    for (size_t r = 0; r < 2 * kBlock; ++r) wide_rows[r] = wide.data() + r * p.d;
  } else {
    rows.resize(2 * count);
    key_rows(p.past_key + past, p.new_key + fresh, p.c, p.d, list, count, rows.data());
    key_rows(p.past_value + past, p.new_value + fresh, p.c, p.d, list, count, rows.data() + count);
  }
  const Visible v{rows.data(), rows.data() + count, bias.data(), count, count, p.d, p.scale};
  if (!range) {  // one row, scanning its own values
    bool bad = false;
    if (p.half()) {
      const uint16_t top = half_magnitude(rows16.data() + count, count, p.d);
      bad = top >= 0x7c00;
      largest[0] = bad ? std::numeric_limits<float>::infinity() : half_to_float(top);
    } else {
      scan_values(v, &largest[0], &bad);
    }
    bad_values[0] = bad;
  }
  // Keys n0.. of a block: their rows in place (float32; prefetched ahead for one row: the rows a tile
  // shares are a prefill chunk's, in order; float16 for the tile kernels, which widen them in registers),
  // or widened into L1 first (float16 on the other paths: `values` picks the value rows), once for all
  // the tile's vectors.
  const auto block = [&](size_t n0, bool first, bool values = false) {
    const size_t len = std::min(kBlock, v.n - n0);
    if (p.half() && tiled(p))
      return Visible{nullptr, nullptr, v.bias + n0, len, first ? v.n - n0 : 0, v.d, v.scale, rows16.data() + n0,
                     rows16.data() + count + n0};
    if (!p.half() || !first)
      return p.half() ? Visible{wide_rows.data(), wide_rows.data() + kBlock, v.bias + n0, len, 0, v.d, v.scale}
                      : Visible{v.key + n0, v.value + n0, v.bias + n0, len, first && n_rows == 1 ? v.n - n0 : 0, v.d,
                                v.scale};
    const Half* const* from = rows16.data() + (values ? count : 0);
    float* to = wide.data() + (values ? kBlock * p.d : 0);
    for (size_t r = 0; r < len; ++r) {
      if (n0 + r + kAhead < count) prefetch_half_row(from[n0 + r + kAhead], p.d);
      to_float(from[n0 + r], to + r * p.d, p.d);
    }
    return Visible{wide_rows.data(), wide_rows.data() + kBlock, v.bias + n0, len, 0, v.d, v.scale};
  };
  const auto query = [&](int64_t vec) { return p.q + ((bb * p.hq + h0 + vec % g) * p.t + tt0 + vec / g) * p.d; };
  const auto output = [&](int64_t vec) {
    const int64_t h = h0 + vec % g, tt = tt0 + vec / g;
    return p.y + (p.tokens_major ? (bb * p.t + tt) * p.hq + h : (bb * p.hq + h) * p.t + tt) * p.d;
  };
  const float *qs[kTile], *bs[kTile];
  float* ss[kTile];
  score.resize(vectors * count);
  prob.resize(vectors * count);
  for (size_t n0 = 0; n0 < v.n; n0 += kBlock) {
    if (tiled(p)) {
      const int64_t each = balanced(vectors, kTile);
      for (int64_t a = 0; a < vectors; a += each) {
        const int q = static_cast<int>(std::min<int64_t>(each, vectors - a));
        for (int j = 0; j < q; ++j)
          qs[j] = query(a + j), bs[j] = bias.data() + (a + j) / g * count + n0, ss[j] = score.data() + (a + j) * count + n0;
        tile_scores(block(n0, a == 0), q, qs, bs, ss);
      }
    } else {
      for (int64_t i = 0; i < vectors; ++i) scores(block(n0, i == 0), query(i), score.data() + i * count + n0);
    }
  }
  live.clear();
  for (int64_t i = 0; i < vectors; ++i) {
    const int64_t r = i / g;
    bool bad = bad_values[r];
    const float top = largest_score(score.data() + i * count, count, &bad);
    const bool none = p.counts[mask_row(r)] == 0;
    bad = bad || (!none && !std::isfinite(top));
    if (none || largest[r] == 0.0f || bad) {
      std::fill(output(i), output(i) + p.d, bad ? std::numeric_limits<float>::quiet_NaN() : 0.0f);
      continue;
    }
    live.push_back(i);
    probabilities(score.data() + i * count, count, top, prob.data() + i * count);
  }
  if (live.empty()) return true;
  exponent.resize(n_rows);
  step.resize(n_rows);
  for (int64_t r = 0; r < n_rows; ++r) {
    int e = 0;
    std::frexp(largest[r], &e);  // every |value| < 2^e
    exponent[r] = std::max(e, kMinExponent);
    step[r] = std::ldexp(1.0f, kValueFraction - exponent[r]);
  }
  num.assign(vectors * p.d, 0);
  den.assign(vectors, 0);
  if (!tiled(p)) part.assign(vectors * p.d, 0);
  const float* ps[kSumTile];
  float fs[kSumTile];
  int64_t *ns[kSumTile], *ds[kSumTile];
  for (size_t n0 = 0; n0 < v.n; n0 += kBlock) {
    if (tiled(p)) {
      const auto each = static_cast<size_t>(balanced(static_cast<int64_t>(live.size()), kSumTile));
      for (size_t a = 0; a < live.size(); a += each) {
        const int q = static_cast<int>(std::min<size_t>(each, live.size() - a));
        for (int j = 0; j < q; ++j) {
          const int64_t i = live[a + j];
          ps[j] = prob.data() + i * count + n0, fs[j] = step[i / g], ns[j] = num.data() + i * p.d, ds[j] = &den[i];
        }
        tile_sums(block(n0, a == 0, true), q, ps, fs, ns, ds);
      }
    } else {
      for (size_t a = 0; a < live.size(); ++a) {
        const int64_t i = live[a];
        sums(block(n0, a == 0, true), prob.data() + i * count + n0, step[i / g], part.data() + i * p.d,
             num.data() + i * p.d, &den[i]);
      }
    }
  }
  for (int64_t i : live)
    normalise(num.data() + i * p.d, den[i], exponent[i / g] - kValueFraction + kFraction, output(i), p.d,
              p.counts[mask_row(i / g)]);
  return true;
}

// One task: (batch, group of query heads, tile of rows) -> their output vectors.
void task(void* user, size_t index) {
  const Problem& p = *static_cast<const Problem*>(user);
  const int64_t rows = p.tile_rows, tiles = (p.t + rows - 1) / rows, groups = p.hq / group(p);
  const int64_t tt0 = static_cast<int64_t>(index) % tiles * rows;
  const int64_t h0 = static_cast<int64_t>(index) / tiles % groups * group(p);
  const int64_t bb = static_cast<int64_t>(index) / (tiles * groups), n = std::min(rows, p.t - tt0);
  const int64_t tile = (bb * p.mask_heads + (p.mask_heads == 1 ? 0 : h0)) * tiles + tt0 / rows;
  if (n > 1 && p.tile_counts[tile] >= 0 &&
      attend_tile(p, bb, h0, tt0, n, p.tile_keys + tile * (p.c + p.t), static_cast<size_t>(p.tile_counts[tile])))
    return;
  for (int64_t r = 0; r < n; ++r) attend_tile(p, bb, h0, tt0 + r, 1);
}

struct Kernel {
  float scale;
  bool tokens_major;
  int64_t q_heads, kv_heads;  // RotaryAttention's packed projection
};

OrtStatus* create(const OrtKernelInfo* info, bool rotary, void** out) {
  float scale = 0.0f;
  int64_t tokens_major = 0, q_heads = 0, kv_heads = 0;
  if (OrtStatus* s = g_api.attribute(info, "scale", &scale)) return s;
  g_api.optional_attribute(info, "tokens_major", 0, &tokens_major);
  if (rotary) {
    if (OrtStatus* s = g_api.attribute(info, "q_heads", &q_heads)) return s;
    if (OrtStatus* s = g_api.attribute(info, "kv_heads", &kv_heads)) return s;
    if (q_heads <= 0 || kv_heads <= 0) return g_api.error("RotaryAttention: q_heads and kv_heads must be positive");
  }
  *out = new (std::nothrow) Kernel{scale, tokens_major != 0, q_heads, kv_heads};
  return *out ? nullptr : g_api.error("Attention: out of memory");
}

// The attention proper: in = query, past_key, past_value, new_key, new_value, mask, with their dims.
// `half`: the float16 past keys and values and the call's rounded new ones (the HalfKV ops), or none.
OrtStatus* attend(OrtKernelContext* ctx, const Kernel& kernel, const float* const (&in)[6],
                  const std::vector<int64_t> (&dims)[6], const Half* const* half = nullptr) {
  const auto& qd = dims[0];
  if (qd.size() != 4 || dims[1].size() != 4 || dims[3].size() != 4 || dims[5].size() != 4)
    return g_api.error("Attention: query, keys, values and mask must be 4-D");
  const int64_t b = qd[0], hq = qd[1], t = qd[2], d = qd[3], hkv = dims[1][1], c = dims[1][2];
  const std::vector<int64_t> past{b, hkv, c, d}, fresh{b, hkv, t, d};
  if (hkv <= 0 || hq % hkv != 0 || dims[1] != past || dims[2] != past || dims[3] != fresh || dims[4] != fresh ||
      dims[5][0] != b || (dims[5][1] != 1 && dims[5][1] != hq) || dims[5][2] != t || dims[5][3] != c + t)
    return g_api.error("Attention: shapes must be query [B,Hq,T,D], past [B,Hkv,C,D], new [B,Hkv,T,D], "
                       "mask [B,1|Hq,T,C+T], with Hq a multiple of Hkv");
  float* y = nullptr;
  if (OrtStatus* s = g_api.output_data(ctx, 0, kernel.tokens_major ? std::vector<int64_t>{b, t, hq * d} : qd, &y))
    return s;
  if (b * hq * t * d == 0) return nullptr;
  Problem p{in[0], in[1], in[2], in[3], in[4], in[5], y, b, hq, hkv, t, c, d, dims[5][1], kernel.scale,
            kernel.tokens_major};
  if (half) {
    p.past_key16 = half[0], p.past_value16 = half[1], p.new_key16 = half[2], p.new_value16 = half[3];
    p.half_kv = true;
  }
  thread_local std::vector<int32_t> lists;  // reused call after call by the thread that runs the op
  thread_local std::vector<uint32_t> counts;
  thread_local std::vector<uint8_t> seen;
  thread_local std::vector<float> ranges;
  thread_local std::vector<int32_t> tile_keys;
  thread_local std::vector<int64_t> tile_counts;
  thread_local std::unique_ptr<float[]> widened;  // uninitialised: only the rows some row sees are written
  thread_local size_t widened_size = 0;
  const int64_t keys = c + t, rows = p.mask_heads * t;
  if (lists.size() < static_cast<size_t>(b * rows * keys)) lists.resize(b * rows * keys);
  counts.resize(b * rows);
  Lists found{&p, lists.data(), counts.data()};
  if (OrtStatus* s = g_api.parallel_for(ctx, list_task, static_cast<size_t>(b * rows), &found)) return s;
  p.lists = lists.data(), p.counts = counts.data();
  if (rows > 1) {
    seen.assign(b * keys, 0);
    int64_t pairs = 0, distinct = 0;
    for (int64_t r = 0; r < b * rows; ++r) {
      uint8_t* any = seen.data() + r / rows * keys;
      const int32_t* list = p.lists + r * keys;
      const uint32_t count = counts[r];  // (a byte store may alias anything: counts[r] would be reloaded, a
      pairs += count;                    // thread_local's pointer through __tls_get_addr, at every key)
      for (uint32_t n = 0; n < count; ++n) {
        distinct += !any[list[n]];
        any[list[n]] = 1;
      }
    }
    if (pairs >= kShared * distinct) {
      ranges.resize(b * hkv * keys);
      Problem wide = p;  // a float16 cache's seen rows in float32: [B, Hkv, C, D] and [B, Hkv, T, D], K then V
      if (p.half()) {
        const size_t size = 2 * b * hkv * keys * d;
        if (widened_size < size) widened.reset(new (std::nothrow) float[size]), widened_size = widened ? size : 0;
        if (!widened) return g_api.error("Attention: out of memory widening the float16 cache");
        float* at = widened.get();
        wide.past_key = at, wide.new_key = at + b * hkv * c * d;
        wide.past_value = at + b * hkv * keys * d, wide.new_value = wide.past_value + b * hkv * c * d;
        wide.half_kv = false;
      }
      Ranges work{&p, seen.data(), ranges.data(), p.half() ? &wide : nullptr};
      if (OrtStatus* s = g_api.parallel_for(ctx, range_task, static_cast<size_t>(b * hkv), &work)) return s;
      p = wide;
      p.key_range = ranges.data();
      p.tile_rows = tile_unions(p, tile_keys, tile_counts);
      p.tile_keys = tile_keys.data(), p.tile_counts = tile_counts.data();
    }
  }
  return g_api.parallel_for(ctx, task, static_cast<size_t>(tasks(p)), &p);
}

OrtStatus* compute(void* op_kernel, OrtKernelContext* ctx) {
  const float* in[6] = {};
  std::vector<int64_t> dims[6];
  for (size_t i = 0; i < 6; ++i)
    if (OrtStatus* s = g_api.tensor(ctx, i, &in[i], &dims[i])) return s;
  return attend(ctx, *static_cast<Kernel*>(op_kernel), in, dims);
}

int64_t elements(const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t x : dims) n *= x;
  return n;
}

// The call's new keys and values (float32, `fresh` [B, Hkv, T, D]) rounded into outputs 1 and 2 (float16).
OrtStatus* round_new_rows(OrtKernelContext* ctx, const float* const (&fresh)[2], const std::vector<int64_t>& dims,
                          Half* (&out)[2]) {
  for (size_t i = 0; i < 2; ++i) {
    if (OrtStatus* s = g_api.output_data(ctx, 1 + i, dims, &out[i])) return s;
    to_half(fresh[i], out[i], elements(dims));
  }
  return nullptr;
}

// AttentionHalfKV: inputs as Attention's, past_key and past_value float16; outputs the attention's output
// and the new keys and values rounded to float16.
OrtStatus* compute_half(void* op_kernel, OrtKernelContext* ctx) {
  const float* in[6] = {};
  const Half* past[2] = {};
  std::vector<int64_t> dims[6];
  for (size_t i : {0, 3, 4, 5})
    if (OrtStatus* s = g_api.tensor(ctx, i, &in[i], &dims[i])) return s;
  for (size_t i : {1, 2})
    if (OrtStatus* s = g_api.tensor(ctx, i, &past[i - 1], &dims[i])) return s;
  if (dims[3].size() != 4 || dims[4] != dims[3])
    return g_api.error("AttentionHalfKV: new_key and new_value must be 4-D, [B,Hkv,T,D] alike");
  Half* fresh[2] = {};
  if (OrtStatus* s = round_new_rows(ctx, {in[3], in[4]}, dims[3], fresh)) return s;
  const Half* half[4] = {past[0], past[1], fresh[0], fresh[1]};
  return attend(ctx, *static_cast<Kernel*>(op_kernel), in, dims, half);
}

// RotaryAttention: the packed projection into heads (the queries in a buffer the call reuses, the new
// keys and values into outputs 1 and 2, or with a float16 cache into buffers and then rounded into the
// outputs), then the attention over them.
OrtStatus* rotary(void* op_kernel, OrtKernelContext* ctx, bool half_kv) {
  const Kernel& kernel = *static_cast<Kernel*>(op_kernel);
  const int64_t hq = kernel.q_heads, hkv = kernel.kv_heads, heads = hq + 2 * hkv;
  const float* in[6] = {};
  const Half* past[2] = {};
  std::vector<int64_t> dims[6], xd;
  if (OrtStatus* s = g_api.tensor(ctx, 0, &in[0], &xd)) return s;
  if (xd.size() != 3 || xd[2] % heads != 0 || (xd[2] / heads) % 2 != 0)
    return g_api.error("RotaryAttention: qkv must be [B, T, (q_heads + 2 kv_heads) * D] with D even");
  const int64_t b = xd[0], t = xd[1], d = xd[2] / heads;
  const float *cos = nullptr, *sin = nullptr;
  bool per_batch = false;
  if (OrtStatus* s = angles(ctx, 1, b, t, d, "RotaryAttention: cos and sin must be [B or 1, 1, T, D]", &cos, &sin,
                            &per_batch))
    return s;
  for (auto [from, to] : {std::pair<size_t, size_t>{3, 1}, {4, 2}})  // past_key, past_value
    if (OrtStatus* s = half_kv ? g_api.tensor(ctx, from, &past[to - 1], &dims[to])
                               : g_api.tensor(ctx, from, &in[to], &dims[to]))
      return s;
  if (OrtStatus* s = g_api.tensor(ctx, 5, &in[5], &dims[5])) return s;  // mask
  thread_local std::vector<float> query, fresh;  // reused call after call by the thread that runs the op
  query.resize(b * hq * t * d);
  float* out[3] = {query.data(), nullptr, nullptr};
  const std::vector<int64_t> shape{b, hkv, t, d};
  if (half_kv) {
    fresh.resize(2 * b * hkv * t * d);
    out[1] = fresh.data(), out[2] = fresh.data() + b * hkv * t * d;
  } else {
    for (size_t i = 1; i < 3; ++i)
      if (OrtStatus* s = g_api.output_data(ctx, i, shape, &out[i])) return s;
  }
  qkv_heads(in[0], b, t, hq, hkv, d, cos, sin, per_batch, out);
  in[0] = out[0], in[3] = out[1], in[4] = out[2];
  dims[0] = {b, hq, t, d};
  dims[3] = dims[4] = shape;
  if (!half_kv) return attend(ctx, kernel, in, dims);
  Half* rounded[2] = {};
  if (OrtStatus* s = round_new_rows(ctx, {out[1], out[2]}, shape, rounded)) return s;
  const Half* half[4] = {past[0], past[1], rounded[0], rounded[1]};
  return attend(ctx, kernel, in, dims, half);
}

OrtStatus* compute_rotary(void* op_kernel, OrtKernelContext* ctx) { return rotary(op_kernel, ctx, false); }
OrtStatus* compute_rotary_half(void* op_kernel, OrtKernelContext* ctx) { return rotary(op_kernel, ctx, true); }

// The HalfKV ops' types: inputs 3 and 4 (RotaryAttention) or 1 and 2 (Attention) and outputs 1 and 2 float16.
OrtCustomOp half_kv_types(OrtCustomOp op, bool rotary) {
  op.GetInputType = rotary ? [](const OrtCustomOp*, size_t i) { return i == 3 || i == 4 ? kFloat16 : kFloat; }
                           : [](const OrtCustomOp*, size_t i) { return i == 1 || i == 2 ? kFloat16 : kFloat; };
  op.GetOutputType = [](const OrtCustomOp*, size_t i) { return i == 0 ? kFloat : kFloat16; };
  return op;
}

OrtStatus* create_plain(const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** out) {
  return create(info, false, out);
}
OrtStatus* create_rotary(const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** out) {
  return create(info, true, out);
}
void destroy(void* k) { delete static_cast<Kernel*>(k); }
int float_input(const OrtCustomOp*, size_t) { return kFloat; }
size_t six(const OrtCustomOp*) { return 6; }
size_t three(const OrtCustomOp*) { return 3; }

}  // namespace

const OrtCustomOp* attention_op() {
  static const OrtCustomOp op =
      make_op([](const OrtCustomOp*) { return "Attention"; }, float_input, six, create_plain, compute, destroy);
  return &op;
}

const OrtCustomOp* rotary_attention_op() {
  static const OrtCustomOp op = make_op([](const OrtCustomOp*) { return "RotaryAttention"; }, float_input, six,
                                        create_rotary, compute_rotary, destroy, three);
  return &op;
}

const OrtCustomOp* attention_half_kv_op() {
  static const OrtCustomOp op = half_kv_types(
      make_op([](const OrtCustomOp*) { return "AttentionHalfKV"; }, float_input, six, create_plain, compute_half,
              destroy, three),
      false);
  return &op;
}

const OrtCustomOp* rotary_attention_half_kv_op() {
  static const OrtCustomOp op = half_kv_types(
      make_op([](const OrtCustomOp*) { return "RotaryAttentionHalfKV"; }, float_input, six, create_rotary,
              compute_rotary_half, destroy, three),
      true);
  return &op;
}

}  // namespace mxspd
