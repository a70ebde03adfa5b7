// Rotary position embedding (Llama's rotate-half form) into heads: shared by ai.mxspd::Rotary and
// RotaryQKV (kernels/rotary.cc) and RotaryAttention (kernels/attention.cc), so that each gives the
// same bits. Built with -ffp-contract=off: two products and a sum, each rounded once.

#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "ort_api.h"

namespace mxspd {

// Heads [column, column + h * d) of each row of X [B, T, width] into Y [B, h, T, d], rotated or copied.
struct Heads {
  const float* x;
  int64_t b, t, width, column, h, d;
};

inline void to_heads(const Heads& in, const float* cos, const float* sin, bool per_batch, bool rotate, float* y) {
  const int64_t d = in.d, half = d / 2;
  for (int64_t bi = 0; bi < in.b; ++bi) {
    for (int64_t hi = 0; hi < in.h; ++hi) {
      for (int64_t ti = 0; ti < in.t; ++ti) {
        const float* x = in.x + (bi * in.t + ti) * in.width + in.column + hi * d;
        float* out = y + ((bi * in.h + hi) * in.t + ti) * d;
        if (!rotate) {
          std::memcpy(out, x, d * sizeof(float));
          continue;
        }
        const int64_t row = (per_batch ? bi : 0) * in.t + ti;
        const float *c = cos + row * d, *s = sin + row * d;
        for (int64_t i = 0; i < half; ++i) out[i] = x[i] * c[i] + -x[i + half] * s[i];
        for (int64_t i = half; i < d; ++i) out[i] = x[i] * c[i] + x[i - half] * s[i];
      }
    }
  }
}

// cos and sin [B or 1, 1, T, D] for X's B and T and head size D; whether they are per batch.
// Read from inputs `at` and `at` + 1.
inline OrtStatus* angles(OrtKernelContext* ctx, size_t at, int64_t b, int64_t t, int64_t d, const char* refusal,
                         const float** cos, const float** sin, bool* per_batch) {
  std::vector<int64_t> cd, sd;
  if (OrtStatus* s = g_api.tensor(ctx, at, cos, &cd)) return s;
  if (OrtStatus* s = g_api.tensor(ctx, at + 1, sin, &sd)) return s;
  if (cd != sd || cd.size() != 4 || (cd[0] != 1 && cd[0] != b) || cd[1] != 1 || cd[2] != t || cd[3] != d)
    return g_api.error(refusal);
  *per_batch = cd[0] != 1;
  return nullptr;
}

// A packed q/k/v projection X [B, T, (hq + 2 hkv) * d] into rotated query heads out[0] [B, hq, T, d],
// rotated key heads out[1] and value heads out[2] [B, hkv, T, d].
inline void qkv_heads(const float* x, int64_t b, int64_t t, int64_t hq, int64_t hkv, int64_t d, const float* cos,
                      const float* sin, bool per_batch, float* const out[3]) {
  const int64_t width = (hq + 2 * hkv) * d;
  to_heads({x, b, t, width, 0, hq, d}, cos, sin, per_batch, true, out[0]);
  to_heads({x, b, t, width, hq * d, hkv, d}, cos, sin, per_batch, true, out[1]);
  to_heads({x, b, t, width, (hq + hkv) * d, hkv, d}, cos, sin, per_batch, false, out[2]);
}

}  // namespace mxspd
