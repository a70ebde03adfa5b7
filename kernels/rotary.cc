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
// ai.mxspd::RotaryQKV: the same for a packed q/k/v projection (compiler/pack_matmuls.py), X [B, T,
// (q_heads + 2 kv_heads) * D]: outputs the rotated queries [B, q_heads, T, D], the rotated keys and the
// values [B, kv_heads, T, D], in place of the Split, two Rotary ops and the values' Reshape and
// Transpose (compiler/split_heads.py).
//
// Semantics: the same float operations as the nodes it replaces, each rounded once (two products and
// a sum; the library is built with -ffp-contract=off, so no fused multiply-add), so the output has the
// same bits as the unfused graph, and every row is computed alone (batch invariance).

#include <new>

#include "ort_api.h"
#include "rotary.h"

namespace mxspd {
namespace {

struct Kernel {
  int64_t heads;     // Rotary: 0: X is [B, T, H, D]; else X is [B, T, heads * D]. RotaryQKV: the query heads
  int64_t kv_heads;  // RotaryQKV: the key and value heads
};

OrtStatus* compute(void* op_kernel, OrtKernelContext* ctx) {
  const float* x = nullptr;
  std::vector<int64_t> xd;
  if (OrtStatus* s = g_api.tensor(ctx, 0, &x, &xd)) return s;
  if (const int64_t heads = static_cast<Kernel*>(op_kernel)->heads; heads > 0) {
    if (xd.size() != 3 || xd[2] % heads != 0) return g_api.error("Rotary: X must be [B, T, heads * D]");
    xd = {xd[0], xd[1], heads, xd[2] / heads};
  }
  if (xd.size() != 4 || xd[3] % 2 != 0)
    return g_api.error("Rotary: X must be [B, T, H, D] with D even");
  const int64_t b = xd[0], t = xd[1], h = xd[2], d = xd[3];
  const float *cos = nullptr, *sin = nullptr;
  bool per_batch = false;
  if (OrtStatus* s = angles(ctx, 1, b, t, d, "Rotary: cos and sin must be [B or 1, 1, T, D] for X [B, T, H, D]",
                            &cos, &sin, &per_batch))
    return s;
  float* y = nullptr;
  if (OrtStatus* s = g_api.output_data(ctx, 0, {b, h, t, d}, &y)) return s;
  to_heads({x, b, t, h * d, 0, h, d}, cos, sin, per_batch, true, y);
  return nullptr;
}

OrtStatus* compute_qkv(void* op_kernel, OrtKernelContext* ctx) {
  const Kernel& k = *static_cast<Kernel*>(op_kernel);
  const float* x = nullptr;
  std::vector<int64_t> xd;
  if (OrtStatus* s = g_api.tensor(ctx, 0, &x, &xd)) return s;
  const int64_t heads = k.heads + 2 * k.kv_heads;
  if (xd.size() != 3 || xd[2] % heads != 0 || (xd[2] / heads) % 2 != 0)
    return g_api.error("RotaryQKV: X must be [B, T, (q_heads + 2 kv_heads) * D] with D even");
  const int64_t b = xd[0], t = xd[1], d = xd[2] / heads;
  const float *cos = nullptr, *sin = nullptr;
  bool per_batch = false;
  if (OrtStatus* s = angles(ctx, 1, b, t, d, "RotaryQKV: cos and sin must be [B or 1, 1, T, D] for X [B, T, H * D]",
                            &cos, &sin, &per_batch))
    return s;
  float* out[3] = {};
  for (size_t i = 0; i < 3; ++i)
    if (OrtStatus* s = g_api.output_data(ctx, i, {b, i == 0 ? k.heads : k.kv_heads, t, d}, &out[i])) return s;
  qkv_heads(x, b, t, k.heads, k.kv_heads, d, cos, sin, per_batch, out);
  return nullptr;
}

OrtStatus* create(const OrtKernelInfo* info, bool qkv, void** out) {
  int64_t heads = 0, kv_heads = 0;
  if (qkv) {
    if (OrtStatus* s = g_api.attribute(info, "q_heads", &heads)) return s;
    if (OrtStatus* s = g_api.attribute(info, "kv_heads", &kv_heads)) return s;
    if (heads <= 0 || kv_heads <= 0) return g_api.error("RotaryQKV: q_heads and kv_heads must be positive");
  } else {
    g_api.optional_attribute(info, "heads", 0, &heads);
  }
  *out = new (std::nothrow) Kernel{heads, kv_heads};
  return *out ? nullptr : g_api.error("Rotary: out of memory");
}

}  // namespace

const OrtCustomOp* rotary_op() {
  static const OrtCustomOp op = make_op(
      [](const OrtCustomOp*) { return "Rotary"; }, [](const OrtCustomOp*, size_t) { return kFloat; },
      [](const OrtCustomOp*) -> size_t { return 3; },
      [](const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** out) { return create(info, false, out); },
      compute, [](void* k) { delete static_cast<Kernel*>(k); });
  return &op;
}

const OrtCustomOp* rotary_qkv_op() {
  static const OrtCustomOp op = make_op(
      [](const OrtCustomOp*) { return "RotaryQKV"; }, [](const OrtCustomOp*, size_t) { return kFloat; },
      [](const OrtCustomOp*) -> size_t { return 3; },
      [](const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** out) { return create(info, true, out); },
      compute_qkv, [](void* k) { delete static_cast<Kernel*>(k); },
      [](const OrtCustomOp*) -> size_t { return 3; });
  return &op;
}

}  // namespace mxspd
