// ai.mxspd::MXMatMulGPU on ONNX Runtime's CUDA execution provider: Y = A @ W for float16 A [..., K] and
// MX weights that stay MXFP6 (6.25 bits per weight read) or MXINT8 (8.25) in GPU memory, decoded in
// registers (kernels/mx_gpu_layout.h has the layout and the values; kernels/mx_matmul_gpu.cc the CPU
// reference the compiler and the tests use). Built by `python -m kernels.cuda_build` with CUDA's compiler
// into its own library (the CPU kernels' library is built by pip, without nvcc); the runtime registers
// it for ort-cuda sessions.
//
// Why: ONNX Runtime's CUDA provider runs MX weights as 8-bit MatMulNBits (8.5 bits read per weight), and a
// one-row decode step reads every weight once: bytes per token set its pace. 16 / 6.25 = 2.56x float16
// is MXFP6's ceiling at one row.
//
// One warp per output column: lane l decodes blocks l, l + 32, ... of that column (the warp reads 32
// consecutive blocks, 768 contiguous bytes, at a time), multiplies each by the rows' 32 activations in
// float32 and adds the block's dot product, scaled by its power of two, to its per-row sums; the lanes'
// sums meet in a shuffle reduction. Up to 8 rows per launch (decode: 1; scoring: 2-9 in one or two
// launches; a prefill chunk: launches of 8 rows, each reading the weights again from L2 or memory: a
// tensor-core path for many rows is not written yet). Launched on the provider's compute stream
// (KernelContext_GetGPUComputeStream), with no allocation or synchronisation, so CUDA graphs capture it.

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <new>
#include <utility>
#include <vector>

#define MXSPD_NO_X86  // the CPU dispatch in ort_api.h is the CPU library's
#include "../mx_gpu_layout.h"
#include "../mx_gpu_op.h"
#include "../ort_api.h"

namespace mxspd {
namespace {

using namespace gpu_layout;

constexpr int kFloat16 = 10;  // ONNXTensorElementDataType
constexpr int kWarps = 8;     // warps (output columns) per thread block
constexpr int kMaxRows = 8;   // rows per launch

template <int WBits>
__device__ __forceinline__ void load_block(const uint8_t* p, uint64_t words[4]) {
  const uint2* q = reinterpret_cast<const uint2*>(p);  // 8-byte aligned: blocks are 24 or 32 bytes
#pragma unroll
  for (int i = 0; i < kBlockBytes<WBits> / 8; ++i) {
    const uint2 v = __ldg(q + i);
    words[i] = (static_cast<uint64_t>(v.y) << 32) | v.x;
  }
}

template <int WBits, int Rows>
__global__ void __launch_bounds__(kWarps * 32) mx_gemv(const __half* __restrict__ a, const uint8_t* __restrict__ w,
                                                       const uint8_t* __restrict__ s, __half* __restrict__ y,
                                                       int64_t k, int64_t n, int64_t kb) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (col >= n) return;
  float acc[Rows];
#pragma unroll
  for (int r = 0; r < Rows; ++r) acc[r] = 0.0f;
  const uint8_t* wc = w + col * kb * kBlockBytes<WBits>;
  const bool vector_rows = k % 8 == 0;  // every row's blocks start 16-byte aligned
  for (int64_t b = lane; b < kb; b += 32) {
    uint64_t words[4] = {0, 0, 0, 0};
    load_block<WBits>(wc + b * kBlockBytes<WBits>, words);
    const int e = s[col * kb + b];
    const float scale = e == 255 ? __int_as_float(0x7fc00000) : ldexpf(1.0f, e - 127 - kShift<WBits>);
    float wv[kBlock];
#pragma unroll
    for (int i = 0; i < kBlock; ++i) wv[i] = static_cast<float>(block_weight<WBits>(words, i));
    const int64_t valid = k - b * kBlock < kBlock ? k - b * kBlock : kBlock;
#pragma unroll
    for (int r = 0; r < Rows; ++r) {
      const __half* x = a + r * k + b * kBlock;
      float dot = 0.0f;
      if (valid == kBlock && vector_rows) {
        const uint4* xv = reinterpret_cast<const uint4*>(x);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint4 v = __ldg(xv + j);
          const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            const float2 f = __half22float2(h[t]);
            dot = fmaf(f.x, wv[8 * j + 2 * t], dot);
            dot = fmaf(f.y, wv[8 * j + 2 * t + 1], dot);
          }
        }
      } else {
        for (int i = 0; i < valid; ++i) dot = fmaf(__half2float(x[i]), wv[i], dot);
      }
      acc[r] = fmaf(dot, scale, acc[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < Rows; ++r) {
    float v = acc[r];
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) y[r * n + col] = __float2half(v);
  }
}

using Launch = void (*)(const __half*, const uint8_t*, const uint8_t*, __half*, int64_t, int64_t, int64_t);

template <int WBits, size_t... R>
constexpr std::array<Launch, sizeof...(R)> by_rows(std::index_sequence<R...>) {
  return {mx_gemv<WBits, static_cast<int>(R + 1)>...};
}

OrtStatus* compute(void* op_kernel, OrtKernelContext* ctx) {
  const gpu_op::Kernel& kernel = *static_cast<gpu_op::Kernel*>(op_kernel);
  const OrtValue *av = nullptr, *wv = nullptr, *sv = nullptr;
  std::vector<int64_t> adims, wdims, sdims;
  for (auto [i, v] : {std::pair<size_t, const OrtValue**>{0, &av}, {1, &wv}, {2, &sv}})
    if (OrtStatus* st = g_api.input(ctx, i, v)) return st;
  for (auto [v, d] : {std::pair<const OrtValue*, std::vector<int64_t>*>{av, &adims}, {wv, &wdims}, {sv, &sdims}})
    if (OrtStatus* st = g_api.shape(v, d)) return st;
  int64_t m = 0, kb = 0;
  std::vector<int64_t> ydims;
  if (OrtStatus* st = gpu_op::check_shapes(kernel, adims, wdims, sdims, &m, &kb, &ydims)) return st;
  OrtValue* yv = nullptr;
  if (OrtStatus* st = g_api.output(ctx, 0, ydims.data(), ydims.size(), &yv)) return st;
  void *pa = nullptr, *pw = nullptr, *ps = nullptr, *py = nullptr, *stream = nullptr;
  for (auto [v, p] : {std::pair<const OrtValue*, void**>{av, &pa}, {wv, &pw}, {sv, &ps}, {yv, &py}})
    if (OrtStatus* st = g_api.data(v, p)) return st;
  if (OrtStatus* st = g_api.gpu_stream(ctx, &stream)) return st;
  static constexpr auto k6 = by_rows<6>(std::make_index_sequence<kMaxRows>());
  static constexpr auto k8 = by_rows<8>(std::make_index_sequence<kMaxRows>());
  const auto& kernels = kernel.weight_bits == 8 ? k8 : k6;
  const dim3 grid(static_cast<unsigned>((kernel.n + kWarps - 1) / kWarps)), block(kWarps * 32);
  for (int64_t row = 0; row < m; row += kMaxRows) {
    const int rows = static_cast<int>(m - row < kMaxRows ? m - row : kMaxRows);
    kernels[rows - 1]<<<grid, block, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const __half*>(pa) + row * kernel.k, static_cast<const uint8_t*>(pw),
        static_cast<const uint8_t*>(ps), static_cast<__half*>(py) + row * kernel.n, kernel.k, kernel.n, kb);
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : g_api.error(cudaGetErrorString(err));
}

const OrtCustomOp* mx_matmul_gpu_cuda_op() {
  static const OrtCustomOp op = [] {
    OrtCustomOp o = make_op([](const OrtCustomOp*) { return "MXMatMulGPU"; },
                            [](const OrtCustomOp*, size_t i) { return i == 0 ? kFloat16 : kUint8; },
                            [](const OrtCustomOp*) -> size_t { return 3; }, gpu_op::create_kernel, compute,
                            gpu_op::delete_kernel);
    o.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return "CUDAExecutionProvider"; };
    o.GetOutputType = [](const OrtCustomOp*, size_t) { return kFloat16; };
    return o;
  }();
  return &op;
}

}  // namespace
}  // namespace mxspd

using namespace mxspd;

// ONNX Runtime's SessionOptions.register_custom_ops_library(path) calls this: the ai.mxspd domain with
// the GPU op (the runtime registers this library instead of the CPU one for ort-cuda sessions).
extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                                const OrtApiBase* base) {
  static OrtCustomOpDomain* domain = nullptr;
  static OrtStatus* failed = nullptr;
  static bool once = [&] {
    g_api.table = base->GetApi(kApiVersion);
    if (!g_api.table) return true;
    failed = g_api.fn<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(kCreateCustomOpDomain)("ai.mxspd", &domain);
    if (!failed)
      failed = g_api.fn<OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*)>(kCustomOpDomainAdd)(
          domain, mx_matmul_gpu_cuda_op());
    return true;
  }();
  (void)once;
  if (!g_api.table) return nullptr;
  if (failed) return g_api.error("mxspd CUDA kernels: registering the ai.mxspd domain failed");
  return g_api.fn<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(kAddCustomOpDomain)(options, domain);
}
