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
// value terms p * v as one float32 product rounded to 2^-26 of the row's largest |v| (int32 lanes, 8 per
// instruction, moved into int64 every 16 keys): float32's own precision, at a third of the instructions
// of int64 terms.
// exp is one fixed polynomial (the same operations on every path), not the C library's.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "ort_api.h"

namespace mxspd {
namespace {

constexpr float kHidden = -1e30f;           // mask values at or below: the key is not attended
constexpr int kFraction = 40;               // denominator terms: p * 2^40 <= 2^40
constexpr int kValueFraction = 26;          // value terms: |p * v| * 2^(26 - e) <= 2^26, with |v| < 2^e
constexpr int kMinExponent = -100;          // e at least this (tinier values): 2^(26 - e) stays a float
constexpr double kDenominatorScale = 1099511627776.0;  // 2^40 (kFraction)
constexpr size_t kFlush = 16;               // keys per int32 partial sum: 16 * 2^26 = 2^30 < 2^31
constexpr double kMagic = 6755399441055744.0;  // 1.5 * 2^52: x + kMagic holds round(x) in its low bits
constexpr int64_t kMagicBits = 0x4338000000000000;

// round-to-nearest-even(x) for |x| < 2^51, by adding kMagic (also what the vector path does, 4 at a time).
inline int64_t fixed(double x) {
  const double t = x + kMagic;
  int64_t bits;
  std::memcpy(&bits, &t, sizeof bits);
  return bits - kMagicBits;
}

struct Problem {
  const float *q, *past_key, *past_value, *new_key, *new_value, *mask;
  float* y;
  int64_t b, hq, hkv, t, c, d, mask_heads;
  float scale;
  bool tokens_major;  // y is [B, T, Hq, D], not [B, Hq, T, D]

  const float* key(int64_t batch, int64_t head, int64_t j) const {
    return j < c ? past_key + ((batch * hkv + head) * c + j) * d : new_key + ((batch * hkv + head) * t + j - c) * d;
  }
  const float* value(int64_t batch, int64_t head, int64_t j) const {
    return j < c ? past_value + ((batch * hkv + head) * c + j) * d
                 : new_value + ((batch * hkv + head) * t + j - c) * d;
  }
};

// Lane l accumulates elements i = l mod 8 by fma, then lane_sum: the vector path's order.
float dot_scalar(const float* x, const float* y, int64_t d) {
  float lanes[8] = {};
  for (int64_t i = 0; i < d; ++i) lanes[i % 8] = std::fma(x[i], y[i], lanes[i % 8]);
  return lane_sum(lanes);
}

// The largest |v[i]| (a max: the same in any order) and whether any v[i] is Inf or NaN.
void scan_scalar(const float* v, int64_t d, float* largest, bool* bad) {
  for (int64_t i = 0; i < d; ++i) {
    *bad = *bad || !std::isfinite(v[i]);
    if (std::fabs(v[i]) > *largest) *largest = std::fabs(v[i]);
  }
}

// ---- exp(x) for x <= 0: Cephes' expf polynomial, every step an explicit fma, mul or add (so the
// vector path, lane by lane, gives the same bits); 0 below -86 (where 2^n would leave the normals).
constexpr float kExpFloor = -86.0f, kLog2e = 1.44269504088896341f, kRound = 12582912.0f;  // 1.5 * 2^23
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

float exp_scalar(float x) {
  if (!(x >= kExpFloor)) return 0.0f;
  const float n = std::fma(x, kLog2e, kRound) - kRound;  // round(x * log2 e)
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, r, kExpPoly[i]);
  const float z = r * r;
  const float y = std::fma(p, z, r) + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &y, sizeof bits);
  bits += static_cast<int32_t>(n) * (1 << 23);  // * 2^n
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

void probabilities_scalar(const float* score, size_t n, float top, float* prob) {
  for (size_t i = 0; i < n; ++i) prob[i] = exp_scalar(score[i] - top);
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

// A row's work over its visible keys, in three passes, each one call per row (so that the vector
// path's per-key steps inline): the values' range, each head's scores, each head's weighted sums.
struct Visible {
  const Problem& p;
  int64_t batch, head;      // KV head
  const int64_t* keys;      // visible key indices, cache slots first
  size_t n;
  const float* mask;        // the row's mask
};

void scan_values_scalar(const Visible& v, float* largest, bool* bad) {
  for (size_t n = 0; n < v.n; ++n) scan_scalar(v.p.value(v.batch, v.head, v.keys[n]), v.p.d, largest, bad);
}

void scores_scalar(const Visible& v, const float* q, float* score) {
  for (size_t n = 0; n < v.n; ++n)
    score[n] = dot_scalar(q, v.p.key(v.batch, v.head, v.keys[n]), v.p.d) * v.p.scale + v.mask[v.keys[n]];
}

// The softmax's two sums over the visible keys: den += p * 2^40, num += p * v * `scale` (2^(26 - e)).
void sums_scalar(const Visible& v, const float* prob, float scale, int32_t* part, int64_t* num, int64_t* den) {
  for (size_t n = 0; n < v.n; ++n) {
    *den += fixed(static_cast<double>(prob[n]) * kDenominatorScale);
    accumulate_scalar(part, v.p.value(v.batch, v.head, v.keys[n]), prob[n] * scale, v.p.d);
    if ((n + 1) % kFlush == 0) flush(part, num, v.p.d);
  }
  flush(part, num, v.p.d);
}

#ifdef MXSPD_X86
__attribute__((target("avx2,fma"))) inline float dot_avx2(const float* x, const float* y, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (; i < d; ++i) lanes[i % 8] = std::fma(x[i], y[i], lanes[i % 8]);
  return lane_sum(lanes);
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

__attribute__((target("avx2,fma"))) void probabilities_avx2(const float* score, size_t n, float top, float* prob) {
  const __m256 floor = _mm256_set1_ps(kExpFloor), log2e = _mm256_set1_ps(kLog2e), round = _mm256_set1_ps(kRound);
  const __m256 hi = _mm256_set1_ps(-kLn2Hi), lo = _mm256_set1_ps(-kLn2Lo), one = _mm256_set1_ps(1.0f);
  const __m256 t = _mm256_set1_ps(top);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(score + i), t);
    const __m256 keep = _mm256_cmp_ps(x, floor, _CMP_GE_OQ);
    const __m256 k = _mm256_sub_ps(_mm256_fmadd_ps(x, log2e, round), round);
    __m256 r = _mm256_fmadd_ps(k, hi, x);
    r = _mm256_fmadd_ps(k, lo, r);
    __m256 p = _mm256_set1_ps(kExpPoly[0]);
    for (int j = 1; j < 6; ++j) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[j]));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), one);
    const __m256i scaled = _mm256_add_epi32(_mm256_castps_si256(y), _mm256_slli_epi32(_mm256_cvtps_epi32(k), 23));
    _mm256_storeu_ps(prob + i, _mm256_and_ps(_mm256_castsi256_ps(scaled), keep));
  }
  probabilities_scalar(score + i, n - i, top, prob + i);
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
  for (size_t n = 0; n < v.n; ++n) scan_avx2(v.p.value(v.batch, v.head, v.keys[n]), v.p.d, largest, bad);
}

// dot_avx2 for 4 keys at once: the same operations per key, interleaved (one fma chain per key would
// otherwise wait on the previous fma's latency).
__attribute__((target("avx2,fma"))) inline void dot4_avx2(const float* x, const float* const y[4], int64_t d,
                                                          float out[4]) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m256 xi = _mm256_loadu_ps(x + i);
    for (int k = 0; k < 4; ++k) acc[k] = _mm256_fmadd_ps(xi, _mm256_loadu_ps(y[k] + i), acc[k]);
  }
  for (int k = 0; k < 4; ++k) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[k]);
    for (int64_t j = i; j < d; ++j) lanes[j % 8] = std::fma(x[j], y[k][j], lanes[j % 8]);
    out[k] = lane_sum(lanes);
  }
}

__attribute__((target("avx2,fma"))) void scores_avx2(const Visible& v, const float* q, float* score) {
  size_t n = 0;
  for (; n + 4 <= v.n; n += 4) {
    const float* keys[4];
    for (int k = 0; k < 4; ++k) keys[k] = v.p.key(v.batch, v.head, v.keys[n + k]);
    dot4_avx2(q, keys, v.p.d, score + n);
    for (int k = 0; k < 4; ++k) score[n + k] = score[n + k] * v.p.scale + v.mask[v.keys[n + k]];
  }
  for (; n < v.n; ++n)
    score[n] = dot_avx2(q, v.p.key(v.batch, v.head, v.keys[n]), v.p.d) * v.p.scale + v.mask[v.keys[n]];
}

// Head size 64 (D8 = 8 vectors): the int32 partial sums stay in registers across keys.
template <int D8>
__attribute__((target("avx2,fma"))) void sums_in_registers(const Visible& v, const float* prob, float scale,
                                                           int32_t* part, int64_t* num, int64_t* den) {
  __m256i acc[D8];
  for (int j = 0; j < D8; ++j) acc[j] = _mm256_setzero_si256();
  for (size_t n = 0; n < v.n; ++n) {
    *den += fixed(static_cast<double>(prob[n]) * kDenominatorScale);
    const float* x = v.p.value(v.batch, v.head, v.keys[n]);
    const __m256 f = _mm256_set1_ps(prob[n] * scale);
    for (int j = 0; j < D8; ++j)
      acc[j] = _mm256_add_epi32(acc[j], _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), f)));
    if ((n + 1) % kFlush == 0 || n + 1 == v.n) {  // into the int64 sums, widened 4 lanes at a time
      for (int j = 0; j < D8; ++j) {
        for (int half = 0; half < 2; ++half) {
          __m256i* sum = reinterpret_cast<__m256i*>(num + 8 * j + 4 * half);
          const __m128i lanes = half ? _mm256_extracti128_si256(acc[j], 1) : _mm256_castsi256_si128(acc[j]);
          _mm256_storeu_si256(sum, _mm256_add_epi64(_mm256_loadu_si256(sum), _mm256_cvtepi32_epi64(lanes)));
        }
        acc[j] = _mm256_setzero_si256();
      }
    }
  }
}

__attribute__((target("avx2,fma"))) void sums_avx2(const Visible& v, const float* prob, float scale, int32_t* part,
                                                   int64_t* num, int64_t* den) {
  if (v.p.d == 64) return sums_in_registers<8>(v, prob, scale, part, num, den);
  for (size_t n = 0; n < v.n; ++n) {
    *den += fixed(static_cast<double>(prob[n]) * kDenominatorScale);
    accumulate_avx2(part, v.p.value(v.batch, v.head, v.keys[n]), prob[n] * scale, v.p.d);
    if ((n + 1) % kFlush == 0) flush(part, num, v.p.d);
  }
  flush(part, num, v.p.d);
}
#endif

void scan_values(const Visible& v, float* largest, bool* bad) {
#ifdef MXSPD_X86
  if (kHasAvx2) return scan_values_avx2(v, largest, bad);
#endif
  scan_values_scalar(v, largest, bad);
}

void scores(const Visible& v, const float* q, float* score) {
#ifdef MXSPD_X86
  if (kHasAvx2) return scores_avx2(v, q, score);
#endif
  scores_scalar(v, q, score);
}

// The indices j of the keys a row sees (mask[j] above kHidden), in order; returns how many.
size_t visible_scalar(const float* mask, int64_t keys, int64_t* out) {
  size_t n = 0;
  for (int64_t j = 0; j < keys; ++j)
    if (mask[j] > kHidden) out[n++] = j;
  return n;
}

#ifdef MXSPD_X86
__attribute__((target("avx2,fma"))) size_t visible_avx2(const float* mask, int64_t keys, int64_t* out) {
  const __m256 hidden = _mm256_set1_ps(kHidden);
  size_t n = 0;
  int64_t j = 0;
  for (; j + 8 <= keys; j += 8) {
    unsigned bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(mask + j), hidden, _CMP_GT_OQ));
    for (; bits; bits &= bits - 1) out[n++] = j + __builtin_ctz(bits);
  }
  for (; j < keys; ++j)
    if (mask[j] > kHidden) out[n++] = j;
  return n;
}
#endif

size_t visible_keys(const float* mask, int64_t keys, int64_t* out) {
#ifdef MXSPD_X86
  if (kHasAvx2) return visible_avx2(mask, keys, out);
#endif
  return visible_scalar(mask, keys, out);
}

void probabilities(const float* score, size_t n, float top, float* prob) {
#ifdef MXSPD_X86
  if (kHasAvx2) return probabilities_avx2(score, n, top, prob);
#endif
  probabilities_scalar(score, n, top, prob);
}

void sums(const Visible& v, const float* prob, float scale, int32_t* part, int64_t* num, int64_t* den) {
#ifdef MXSPD_X86
  if (kHasAvx2) return sums_avx2(v, prob, scale, part, num, den);
#endif
  sums_scalar(v, prob, scale, part, num, den);
}

// Query heads per task: a KV head's whole group when every head shares the mask (the values' range
// and the visible list are then found once for the group) and there are rows enough to keep every
// thread busy; else one. A head's arithmetic is the same either way.
int64_t group(const Problem& p) { return p.mask_heads == 1 && p.t >= 4 ? p.hq / p.hkv : 1; }

// One task: (batch, group of query heads, row) -> their output vectors.
void task(void* user, size_t index) {
  const Problem& p = *static_cast<const Problem*>(user);
  const int64_t g = group(p), groups = p.hq / g, keys = p.c + p.t;
  const int64_t tt = static_cast<int64_t>(index) % p.t, h0 = static_cast<int64_t>(index) / p.t % groups * g;
  const int64_t bb = static_cast<int64_t>(index) / (p.t * groups), kv = h0 / (p.hq / p.hkv);
  const float* mask = p.mask + ((bb * p.mask_heads + (p.mask_heads == 1 ? 0 : h0)) * p.t + tt) * keys;
  thread_local std::vector<int64_t> visible, num;
  thread_local std::vector<int32_t> part;
  thread_local std::vector<float> score, prob;
  visible.resize(keys);
  visible.resize(visible_keys(mask, keys, visible.data()));
  const Visible v{p, bb, kv, visible.data(), visible.size(), mask};
  float largest = 0.0f;
  bool values_bad = false;  // an Inf or NaN value: the output is NaN
  scan_values(v, &largest, &values_bad);
  score.resize(visible.size());
  prob.resize(visible.size());
  for (int64_t h = h0; h < h0 + g; ++h) {
    const float* q = p.q + ((bb * p.hq + h) * p.t + tt) * p.d;
    float* y = p.y + (p.tokens_major ? (bb * p.t + tt) * p.hq + h : (bb * p.hq + h) * p.t + tt) * p.d;
    scores(v, q, score.data());
    float top = -std::numeric_limits<float>::infinity();
    bool bad = values_bad;
    for (float s : score) {
      top = std::max(top, s);
      bad = bad || std::isnan(s);
    }
    bad = bad || (!visible.empty() && !std::isfinite(top));
    if (visible.empty() || largest == 0.0f || bad) {
      std::fill(y, y + p.d, bad ? std::numeric_limits<float>::quiet_NaN() : 0.0f);
      continue;
    }
    int e = 0;
    std::frexp(largest, &e);  // every |value| < 2^e
    e = std::max(e, kMinExponent);
    num.assign(p.d, 0);
    part.assign(p.d, 0);
    int64_t den = 0;
    probabilities(score.data(), visible.size(), top, prob.data());
    sums(v, prob.data(), std::ldexp(1.0f, kValueFraction - e), part.data(), num.data(), &den);
    for (int64_t i = 0; i < p.d; ++i)
      y[i] = static_cast<float>(std::ldexp(static_cast<double>(num[i]) / static_cast<double>(den),
                                           e - kValueFraction + kFraction));
  }
}

struct Kernel {
  float scale;
  bool tokens_major;
};

OrtStatus* create_kernel(const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** out) {
  float scale = 0.0f;
  int64_t tokens_major = 0;
  if (OrtStatus* s = g_api.attribute(info, "scale", &scale)) return s;
  g_api.optional_attribute(info, "tokens_major", 0, &tokens_major);
  *out = new (std::nothrow) Kernel{scale, tokens_major != 0};
  return *out ? nullptr : g_api.error("Attention: out of memory");
}

OrtStatus* compute(void* op_kernel, OrtKernelContext* ctx) {
  const float* in[6] = {};
  std::vector<int64_t> dims[6];
  for (size_t i = 0; i < 6; ++i)
    if (OrtStatus* s = g_api.tensor(ctx, i, &in[i], &dims[i])) return s;
  const auto& qd = dims[0];
  if (qd.size() != 4 || dims[1].size() != 4 || dims[3].size() != 4 || dims[5].size() != 4)
    return g_api.error("Attention: query, keys, values and mask must be 4-D");
  const int64_t b = qd[0], hq = qd[1], t = qd[2], d = qd[3], hkv = dims[1][1], c = dims[1][2];
  const std::vector<int64_t> past{b, hkv, c, d}, fresh{b, hkv, t, d};
  if (hkv <= 0 || hq % hkv != 0 || dims[1] != past || dims[2] != past || dims[3] != fresh || dims[4] != fresh ||
      dims[5][0] != b || (dims[5][1] != 1 && dims[5][1] != hq) || dims[5][2] != t || dims[5][3] != c + t)
    return g_api.error("Attention: shapes must be query [B,Hq,T,D], past [B,Hkv,C,D], new [B,Hkv,T,D], "
                       "mask [B,1|Hq,T,C+T], with Hq a multiple of Hkv");
  const Kernel& kernel = *static_cast<Kernel*>(op_kernel);
  float* y = nullptr;
  if (OrtStatus* s = g_api.output_data(ctx, 0, kernel.tokens_major ? std::vector<int64_t>{b, t, hq * d} : qd, &y))
    return s;
  if (b * hq * t * d == 0) return nullptr;
  Problem p{in[0], in[1], in[2], in[3], in[4], in[5], y, b, hq, hkv, t, c, d, dims[5][1], kernel.scale,
            kernel.tokens_major};
  return g_api.parallel_for(ctx, task, static_cast<size_t>(b * (hq / group(p)) * t), &p);
}

}  // namespace

const OrtCustomOp* attention_op() {
  static const OrtCustomOp op = make_op(
      [](const OrtCustomOp*) { return "Attention"; }, [](const OrtCustomOp*, size_t) { return kFloat; },
      [](const OrtCustomOp*) -> size_t { return 6; }, create_kernel, compute,
      [](void* k) { delete static_cast<Kernel*>(k); });
  return &op;
}

}  // namespace mxspd
