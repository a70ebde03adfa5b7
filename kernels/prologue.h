// What MXMatMul and RowMatMul may compute on their input rows before multiplying them (their
// `prologue`; kernels/mx_matmul.cc, kernels/row_matmul.cc), with the same bits as the standalone ops
// they replace: a node less per fusion.
//
// Why: a decode step of SmolLM2 runs 60 residual norms and 30 gates on 576 and 1536 floats each; as
// nodes of their own they cost more in dispatch than in arithmetic (compiler/matmul_prologue.py).
// Every row is computed alone (batch invariance).

#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "exp.h"
#include "ort_api.h"

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

// prologue: 0 none (A [..., K]); 1 SwiGLU (A [..., 2K], a packed gate and up projection); 2 residual RMS
// norm (inputs `skip` (A's shape) and `skip` + 1 (gamma [K]), attribute epsilon; output 1 is A + skip).
enum Prologue : int64_t { kNone = 0, kSwiGLU = 1, kSkipRms = 2 };

// The attributes prologue and (for the norm) epsilon; `refusal`: the error for an unknown prologue.
inline OrtStatus* read_prologue(const OrtKernelInfo* info, const char* refusal, int64_t* prologue, float* epsilon) {
  g_api.optional_attribute(info, "prologue", kNone, prologue);
  *epsilon = 0.0f;
  if (*prologue < kNone || *prologue > kSkipRms) return g_api.error(refusal);
  return *prologue == kSkipRms ? g_api.attribute(info, "epsilon", epsilon) : nullptr;
}

// Rows from which a matmul's prologue runs row by row on the op's threads: each row is computed alone, so
// the bits are the same whoever runs it. (On the calling thread alone it cost a 64-row serving step ~4% on 2
// threads; the activations' rounding after it stays on the calling thread: spread over the op's threads it
// was 0.92-1.05x, docs/benchmarks.md.)
constexpr int64_t kParallelRows = 8;

// f(user, row) for every row in [0, m): on the op's threads from kParallelRows rows, else on this one.
inline OrtStatus* each_row(OrtKernelContext* ctx, void (*f)(void*, size_t), int64_t m, void* user) {
  if (m >= kParallelRows) return g_api.parallel_for(ctx, f, static_cast<size_t>(m), user);
  for (int64_t r = 0; r < m; ++r) f(user, static_cast<size_t>(r));
  return nullptr;
}

struct PrologueRows {
  int64_t prologue, k;
  float epsilon;
  const float *a, *residual, *gamma;
  float *sum, *x;
};

inline void prologue_row(void* user, size_t row) {
  const PrologueRows& p = *static_cast<const PrologueRows*>(user);
  const int64_t r = static_cast<int64_t>(row), k = p.k;
  if (p.prologue == kSwiGLU) {
    thread_local std::vector<float> scratch;  // each thread's own
    scratch.resize(k);
    swiglu_row(p.a + r * 2 * k, k, p.x + r * k, scratch.data());
  } else {
    skip_rms_row(p.a + r * k, p.residual + r * k, p.gamma, k, p.epsilon, p.sum + r * k, p.x + r * k);
  }
}

// The rows a matmul multiplies where a prologue runs: its rows of A [..., K or 2K] (and skip, gamma),
// in a buffer reused call after call by the thread that runs the op; output 1 written for the norm.
inline OrtStatus* prologue_rows(int64_t prologue, int64_t k, float epsilon, OrtKernelContext* ctx, size_t skip,
                                const float* a, const std::vector<int64_t>& adims, int64_t m, const float** rows) {
  thread_local std::vector<float> x;
  x.resize(m * k);
  PrologueRows work{prologue, k, epsilon, a, nullptr, nullptr, nullptr, x.data()};
  if (prologue == kSkipRms) {
    std::vector<int64_t> sdims, gdims;
    if (OrtStatus* st = g_api.tensor(ctx, skip, &work.residual, &sdims)) return st;
    if (OrtStatus* st = g_api.tensor(ctx, skip + 1, &work.gamma, &gdims)) return st;
    if (sdims != adims || gdims != std::vector<int64_t>{k})
      return g_api.error("matmul prologue 2 (residual RMS norm): skip must have A's shape and gamma be [K]");
    if (OrtStatus* st = g_api.output_data(ctx, 1, adims, &work.sum)) return st;
  }
  if (OrtStatus* st = each_row(ctx, prologue_row, m, &work)) return st;
  *rows = x.data();
  return nullptr;
}

}  // namespace mxspd
