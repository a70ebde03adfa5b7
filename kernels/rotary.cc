// ai.mxspd::Rotary: a layer's rotary position embedding (Llama's rotate-half form) with the head
// transpose before it, in one op: for X [B, T, H, D] (the projection reshaped into heads) and
// cos, sin [B or 1, 1, T, D], Y [B, H, T, D] = x * cos + rotate_half(x) * sin, where x = X transposed
// to [B, H, T, D] and rotate_half(x) = concat(-x[..., D/2:], x[..., :D/2]).
//
// Why: exported, this is 7 ONNX nodes per query or key (Transpose, two Slices or a Split, Neg, Concat,
// two Muls, Add), 14 of a layer's 34, each a few microseconds of dispatch on vectors of 576 floats:
// about a fifth of a SmolLM2 decode step. The compiler fuses them (compiler/invariance.py).
//
// With attribute heads = H > 0, X may come as the projection itself, [B, T, H * D] (the same memory):
// the Reshape before it is fused too (compiler/layouts.py).
//
// Semantics: the same float operations as the nodes it replaces, each rounded once (two products and
// a sum; the library is built with -ffp-contract=off, so no fused multiply-add), so the output has the
// same bits as the unfused graph, and every row is computed alone (batch invariance).

#include <new>

#include "ort_api.h"

namespace mxspd {
namespace {

struct Kernel {
  int64_t heads;  // 0: X is [B, T, H, D]; else X is [B, T, heads * D]
};

OrtStatus* compute(void* op_kernel, OrtKernelContext* ctx) {
  const float *x = nullptr, *cos = nullptr, *sin = nullptr;
  std::vector<int64_t> xd, cd, sd;
  if (OrtStatus* s = g_api.tensor(ctx, 0, &x, &xd)) return s;
  if (OrtStatus* s = g_api.tensor(ctx, 1, &cos, &cd)) return s;
  if (OrtStatus* s = g_api.tensor(ctx, 2, &sin, &sd)) return s;
  if (const int64_t heads = static_cast<Kernel*>(op_kernel)->heads; heads > 0) {
    if (xd.size() != 3 || xd[2] % heads != 0) return g_api.error("Rotary: X must be [B, T, heads * D]");
    xd = {xd[0], xd[1], heads, xd[2] / heads};
  }
  if (xd.size() != 4 || xd[3] % 2 != 0)
    return g_api.error("Rotary: X must be [B, T, H, D] with D even");
  const int64_t b = xd[0], t = xd[1], h = xd[2], d = xd[3], half = d / 2;
  if (cd != sd || cd.size() != 4 || (cd[0] != 1 && cd[0] != b) || cd[1] != 1 || cd[2] != t || cd[3] != d)
    return g_api.error("Rotary: cos and sin must be [B or 1, 1, T, D] for X [B, T, H, D]");
  float* y = nullptr;
  if (OrtStatus* s = g_api.output_data(ctx, 0, {b, h, t, d}, &y)) return s;
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t hi = 0; hi < h; ++hi) {
      for (int64_t ti = 0; ti < t; ++ti) {
        const float* in = x + ((bi * t + ti) * h + hi) * d;
        const int64_t row = (cd[0] == 1 ? 0 : bi) * t + ti;
        const float *c = cos + row * d, *s = sin + row * d;
        float* out = y + ((bi * h + hi) * t + ti) * d;
        for (int64_t i = 0; i < half; ++i) out[i] = in[i] * c[i] + -in[i + half] * s[i];
        for (int64_t i = half; i < d; ++i) out[i] = in[i] * c[i] + in[i - half] * s[i];
      }
    }
  }
  return nullptr;
}

}  // namespace

const OrtCustomOp* rotary_op() {
  static const OrtCustomOp op = make_op(
      [](const OrtCustomOp*) { return "Rotary"; }, [](const OrtCustomOp*, size_t) { return kFloat; },
      [](const OrtCustomOp*) -> size_t { return 3; },
      [](const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** out) -> OrtStatus* {
        int64_t heads = 0;
        g_api.optional_attribute(info, "heads", 0, &heads);
        *out = new (std::nothrow) Kernel{heads};
        return *out ? nullptr : g_api.error("Rotary: out of memory");
      },
      compute, [](void* k) { delete static_cast<Kernel*>(k); });
  return &op;
}

}  // namespace mxspd
