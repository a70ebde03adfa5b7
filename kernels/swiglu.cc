// ai.mxspd::SwiGLU: a Llama MLP's gate, in one op: for X [..., 2F] (the packed gate/up projection,
// compiler/pack_matmuls.py), Y [..., F] = silu(X[..., :F]) * X[..., F:], where silu(g) = g * sigmoid(g).
//
// Why: after ONNX Runtime's own fusions this is a Split, a QuickGelu and a Mul per layer, each a few
// microseconds of dispatch on a decode step's 1536 floats (compiler/swiglu.py).
//
// Semantics: kernels/prologue.h's swiglu_row (its sigmoid is its own, not the C library's nor QuickGelu's,
// so the result differs from the unfused graph in the last bits). MXMatMul computes the same bits as its
// `prologue` where the gate feeds it alone.

#include <vector>

#include "ort_api.h"
#include "prologue.h"

namespace mxspd {
namespace {

OrtStatus* compute(void*, OrtKernelContext* ctx) {
  const float* x = nullptr;
  std::vector<int64_t> dims;
  if (OrtStatus* s = g_api.tensor(ctx, 0, &x, &dims)) return s;
  if (dims.empty() || dims.back() % 2 != 0) return g_api.error("SwiGLU: X must be [..., 2F]");
  const int64_t f = dims.back() / 2;
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) rows *= dims[i];
  dims.back() = f;
  float* y = nullptr;
  if (OrtStatus* s = g_api.output_data(ctx, 0, dims, &y)) return s;
  thread_local std::vector<float> e;  // reused call after call by the thread that runs the op
  e.resize(f);
  for (int64_t r = 0; r < rows; ++r) swiglu_row(x + r * 2 * f, f, y + r * f, e.data());
  return nullptr;
}

}  // namespace

const OrtCustomOp* swiglu_op() {
  static const OrtCustomOp op = make_op(
      [](const OrtCustomOp*) { return "SwiGLU"; }, [](const OrtCustomOp*, size_t) { return kFloat; },
      [](const OrtCustomOp*) -> size_t { return 1; },
      [](const OrtCustomOp*, const void*, const OrtKernelInfo*, void** out) -> OrtStatus* {
        *out = nullptr;
        return nullptr;
      },
      compute, [](void*) {});
  return &op;
}

}  // namespace mxspd
