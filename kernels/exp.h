// exp(x) for x <= 0, the same bits on every code path: Attention's softmax and SwiGLU's sigmoid share it.

#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "ort_api.h"

namespace mxspd {

// ---- exp(x) for x <= 0: Cephes' expf polynomial, every step an explicit fma, mul or add (so the
// vector path, lane by lane, gives the same bits); 0 below -86 (where 2^n would leave the normals).
constexpr float kExpFloor = -86.0f, kLog2e = 1.44269504088896341f, kRound = 12582912.0f;  // 1.5 * 2^23
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_scalar(float x) {
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

inline void probabilities_scalar(const float* score, size_t n, float top, float* prob) {
  for (size_t i = 0; i < n; ++i) prob[i] = exp_scalar(score[i] - top);
}

#ifdef MXSPD_X86
__attribute__((target("avx2,fma"))) inline void probabilities_avx2(const float* score, size_t n, float top, float* prob) {
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

#endif

// prob[i] = exp(score[i] - top), for score[i] <= top.
inline void probabilities(const float* score, size_t n, float top, float* prob) {
#ifdef MXSPD_X86
  if (kHasAvx2) return probabilities_avx2(score, n, top, prob);
#endif
  probabilities_scalar(score, n, top, prob);
}

}  // namespace mxspd
