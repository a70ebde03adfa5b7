// What MXMatMul may compute on its input rows before rounding them (kernels/mx_matmul.cc's
// `prologue`), and the standalone op that computes the same thing: a node less per fusion.
//
// Why: a decode step of SmolLM2 runs 60 residual norms and 30 gates on 576 and 1536 floats each; as
// nodes of their own they cost more in dispatch than in arithmetic (compiler/matmul_prologue.py).
// Every row is computed alone (batch invariance).

#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "exp.h"

namespace mxspd {

// SwiGLU: out[i] = silu(g[i]) * u[i] for a row [g (f floats), u (f floats)]; silu(g) = g * sigmoid(g),
// sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(-|g|) from exp.h (the same bits on
// every code path); each product rounded once. `e` is scratch of f floats.
inline void swiglu_row(const float* gu, int64_t f, float* out, float* e) {
  const float *g = gu, *u = gu + f;
  for (int64_t i = 0; i < f; ++i) e[i] = -std::fabs(g[i]);
  probabilities(e, static_cast<size_t>(f), 0.0f, e);
  for (int64_t i = 0; i < f; ++i) {
    const float sigmoid = (g[i] >= 0.0f ? 1.0f : e[i]) / (1.0f + e[i]);
    out[i] = g[i] * sigmoid * u[i];
  }
}

// The residual sum and its RMS norm, as ONNX Runtime's CPU SkipSimplifiedLayerNormalization computes
// them (so a fused graph keeps the unfused graph's bits), all in float32: s = a + skip; the sum of s^2
// in order; rms = sqrt(sum / k + eps); out = s / rms * gamma.
inline void skip_rms_row(const float* a, const float* skip, const float* gamma, int64_t k, float epsilon, float* sum,
                         float* out) {
  float square = 0.0f;
  for (int64_t i = 0; i < k; ++i) {
    sum[i] = a[i] + skip[i];
    square += sum[i] * sum[i];
  }
  const float rms = std::sqrt(square / static_cast<float>(k) + epsilon);
  for (int64_t i = 0; i < k; ++i) out[i] = sum[i] / rms * gamma[i];
}

}  // namespace mxspd
