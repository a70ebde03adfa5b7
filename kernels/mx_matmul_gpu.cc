// ai.mxspd::MXMatMulGPU on the CPU: the reference for the GPU target's MX matmul (kernels/mx_gpu_layout.h
// says its layout and values; kernels/cuda/mx_matmul_gpu.cu is the kernel the GPU runs). The compiler
// needs an implementation on the machine that builds an ort-cuda artifact (ONNX Runtime's offline
// optimiser opens a CPU session on the graph), and the tests check the layout and the lowering with it.
//
// Inputs: A float32 [..., K], W uint8 [N, ceil(K/32), 24 (weight_bits 6) or 32 (8)], S uint8 [N, ceil(K/32)];
// attributes K, N, weight_bits. Output float32 [..., N]: for every row and column, acc = 0; for each block
// b: dot = the fma chain over its codes in order of a[32b + i] * w_i; acc = fma(dot, 2^(S - 127 - shift), acc).

#include <cmath>
#include <cstring>

#include "mx_gpu_layout.h"
#include "mx_gpu_op.h"
#include "ort_api.h"

namespace mxspd {
namespace {

using namespace gpu_layout;

struct Problem {
  const float* a;
  const uint8_t* w;
  const uint8_t* s;
  float* y;
  int64_t m, k, n, kb;
};

template <int WBits>
void column(void* user, size_t index) {
  const Problem& p = *static_cast<const Problem*>(user);
  const auto col = static_cast<int64_t>(index);
  for (int64_t r = 0; r < p.m; ++r) {
    float acc = 0.0f;
    for (int64_t b = 0; b < p.kb; ++b) {
      uint64_t words[4] = {};
      std::memcpy(words, p.w + (col * p.kb + b) * kBlockBytes<WBits>, kBlockBytes<WBits>);
      float dot = 0.0f;
      for (int64_t i = 0; i < kBlock && b * kBlock + i < p.k; ++i)
        dot = std::fma(p.a[r * p.k + b * kBlock + i], static_cast<float>(block_weight<WBits>(words, int(i))), dot);
      const int e = p.s[col * p.kb + b];
      acc = std::fma(dot, e == 255 ? NAN : std::ldexp(1.0f, e - 127 - kShift<WBits>), acc);
    }
    p.y[r * p.n + col] = acc;
  }
}

OrtStatus* compute(void* op_kernel, OrtKernelContext* ctx) {
  const gpu_op::Kernel& kernel = *static_cast<gpu_op::Kernel*>(op_kernel);
  const float* a = nullptr;
  std::vector<int64_t> adims, wdims, sdims;
  if (OrtStatus* st = g_api.tensor(ctx, 0, &a, &adims)) return st;
  const OrtValue *w = nullptr, *s = nullptr;
  if (OrtStatus* st = g_api.input(ctx, 1, &w)) return st;
  if (OrtStatus* st = g_api.input(ctx, 2, &s)) return st;
  if (OrtStatus* st = g_api.shape(w, &wdims)) return st;
  if (OrtStatus* st = g_api.shape(s, &sdims)) return st;
  int64_t m = 0, kb = 0;
  std::vector<int64_t> ydims;
  if (OrtStatus* st = gpu_op::check_shapes(kernel, adims, wdims, sdims, &m, &kb, &ydims)) return st;
  float* y = nullptr;
  if (OrtStatus* st = g_api.output_data(ctx, 0, ydims, &y)) return st;
  void *pw = nullptr, *ps = nullptr;
  if (OrtStatus* st = g_api.data(w, &pw)) return st;
  if (OrtStatus* st = g_api.data(s, &ps)) return st;
  if (m == 0) return nullptr;
  Problem p{a, static_cast<const uint8_t*>(pw), static_cast<const uint8_t*>(ps), y, m, kernel.k, kernel.n, kb};
  return g_api.parallel_for(ctx, kernel.weight_bits == 8 ? column<8> : column<6>, static_cast<size_t>(kernel.n), &p);
}

}  // namespace

const OrtCustomOp* mx_matmul_gpu_op() {
  static const OrtCustomOp op = make_op(
      [](const OrtCustomOp*) { return "MXMatMulGPU"; },
      [](const OrtCustomOp*, size_t i) { return i == 0 ? kFloat : kUint8; },
      [](const OrtCustomOp*) -> size_t { return 3; }, gpu_op::create_kernel, compute,
      gpu_op::delete_kernel);
  return &op;
}

}  // namespace mxspd
