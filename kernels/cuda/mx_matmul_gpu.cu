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
// launches). From 16 rows (a prefill chunk, a serving batch) `mx_gemm` runs instead on the tensor cores:
// a thread block decodes a tile of 64 columns' MX blocks once into shared memory (the integer weights as
// float16, exact) and multiplies 64 rows by it with mma.sync m16n8k16 (float16 in, float32 sums), one MX
// block of K at a time, scaling each block's product by its column's power of two as the CPU reference
// does. Launched on the provider's compute stream (KernelContext_GetGPUComputeStream), with no
// allocation or synchronisation, so CUDA graphs capture it.

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
constexpr int kMaxRows = 8;   // rows per launch of mx_gemv
constexpr int kTensorRows = 16;  // from this many rows, mx_gemm (tensor cores)
constexpr int kTile = 64;        // mx_gemm: rows and columns per thread block (4 warps of 32 x 32)
constexpr int kPad = kBlock + 8;  // a shared tile row's halves: 80 bytes, so a warp's fragment loads hit 32 banks

template <int WBits>
__device__ __forceinline__ void load_block(const uint8_t* p, uint64_t words[4]) {
  const uint2* q = reinterpret_cast<const uint2*>(p);  // 8-byte aligned: blocks are 24 or 32 bytes
#pragma unroll
  for (int i = 0; i < kBlockBytes<WBits> / 8; ++i) {
    const uint2 v = __ldg(q + i);
    words[i] = (static_cast<uint64_t>(v.y) << 32) | v.x;
  }
}

__device__ __forceinline__ float block_scale(int e, int shift) {
  return e == 255 ? __int_as_float(0x7fc00000) : ldexpf(1.0f, e - 127 - shift);
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
    const float scale = block_scale(s[col * kb + b], kShift<WBits>);
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

// D += A (16 x 16, row major) x B (16 x 8, column major), float16 in, float32 sums (sm_80 and later).
__device__ __forceinline__ void mma_16x8x16(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t pair(const __half* p) { return *reinterpret_cast<const uint32_t*>(p); }

// Many rows on the tensor cores: the thread block's 64 x 64 tile of Y, one MX block of K (32) per step.
// Each step stages the rows' 32 activations and the columns' decoded integer weights in shared memory;
// warp (wm, wn) multiplies its 32 rows by its 32 columns (2 x 4 mma tiles, two k16 halves), and adds the
// block's products times the column's scale to its sums. The fragment layouts are PTX's for m16n8k16:
// lane = 4 g + t holds A (g, 2t..2t+1), (g + 8, ..), (g, 2t + 8..), (g + 8, 2t + 8..); B (k 2t..2t+1, n g),
// (k 2t + 8.., n g); C (g, 2t..2t+1), (g + 8, 2t..2t+1).
template <int WBits>
__global__ void __launch_bounds__(128) mx_gemm(const __half* __restrict__ a, const uint8_t* __restrict__ w,
                                               const uint8_t* __restrict__ s, __half* __restrict__ y, int64_t m,
                                               int64_t k, int64_t n, int64_t kb) {
  __shared__ __align__(16) __half as[kTile][kPad];
  __shared__ __align__(16) __half ws[kTile][kPad];  // [column][k]: B's k pairs are contiguous
  __shared__ float scale[kTile];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
  const int wm = warp / 2, wn = warp % 2;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTile, n0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const bool vector_rows = k % 8 == 0;
  float acc[2][4][4] = {};
  for (int64_t b = 0; b < kb; ++b) {
    __syncthreads();  // the last step's tiles are read
    {  // activations: thread tid stages half a row (16 of its 32)
      const int r = tid / 2, c = (tid % 2) * 16;
      const int64_t row = m0 + r, col = b * kBlock + c;
      __half* dst = &as[r][c];
      if (row < m && col + 16 <= k && vector_rows) {
        const uint4* src = reinterpret_cast<const uint4*>(a + row * k + col);
        reinterpret_cast<uint4*>(dst)[0] = __ldg(src);
        reinterpret_cast<uint4*>(dst)[1] = __ldg(src + 1);
      } else {
        for (int i = 0; i < 16; ++i) dst[i] = row < m && col + i < k ? a[row * k + col + i] : __float2half(0.0f);
      }
    }
    {  // weights: thread tid decodes half a column's block (K past the end holds code 0: weight 0)
      const int j = tid / 2, first = (tid % 2) * 16;
      const int64_t col = n0 + j;
      uint64_t words[4] = {0, 0, 0, 0};
      if (col < n) load_block<WBits>(w + (col * kb + b) * kBlockBytes<WBits>, words);
#pragma unroll
      for (int i = first; i < first + 16; ++i) ws[j][i] = __int2half_rn(block_weight<WBits>(words, i));
      if (first == 0) scale[j] = col < n ? block_scale(s[col * kb + b], kShift<WBits>) : 0.0f;
    }
    __syncthreads();
    float part[2][4][4] = {};
#pragma unroll
    for (int kk = 0; kk < kBlock; kk += 16) {
      uint32_t af[2][4], bf[4][2];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        const int r = wm * 32 + mi * 16 + g;
        af[mi][0] = pair(&as[r][kk + 2 * t]);
        af[mi][1] = pair(&as[r + 8][kk + 2 * t]);
        af[mi][2] = pair(&as[r][kk + 2 * t + 8]);
        af[mi][3] = pair(&as[r + 8][kk + 2 * t + 8]);
      }
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int c = wn * 32 + ni * 8 + g;
        bf[ni][0] = pair(&ws[c][kk + 2 * t]);
        bf[ni][1] = pair(&ws[c][kk + 2 * t + 8]);
      }
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) mma_16x8x16(part[mi][ni], af[mi], bf[ni]);
    }
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      const float s0 = scale[wn * 32 + ni * 8 + 2 * t], s1 = scale[wn * 32 + ni * 8 + 2 * t + 1];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[mi][ni][q] = fmaf(part[mi][ni][q], q % 2 ? s1 : s0, acc[mi][ni][q]);
    }
  }
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int64_t row = m0 + wm * 32 + mi * 16 + g + (q >= 2 ? 8 : 0);
        const int64_t col = n0 + wn * 32 + ni * 8 + 2 * t + q % 2;
        if (row < m && col < n) y[row * n + col] = __float2half(acc[mi][ni][q]);
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
  const auto a = static_cast<const __half*>(pa);
  const auto w = static_cast<const uint8_t*>(pw);
  const auto sc = static_cast<const uint8_t*>(ps);
  const auto cu = static_cast<cudaStream_t>(stream);
  if (m >= kTensorRows) {
    const dim3 tiles(static_cast<unsigned>((kernel.n + kTile - 1) / kTile),
                     static_cast<unsigned>((m + kTile - 1) / kTile));
    (kernel.weight_bits == 8 ? mx_gemm<8> : mx_gemm<6>)<<<tiles, 128, 0, cu>>>(a, w, sc, static_cast<__half*>(py), m,
                                                                                kernel.k, kernel.n, kb);
  }
  const dim3 grid(static_cast<unsigned>((kernel.n + kWarps - 1) / kWarps)), block(kWarps * 32);
  for (int64_t row = 0; row < m && m < kTensorRows; row += kMaxRows) {
    const int rows = static_cast<int>(m - row < kMaxRows ? m - row : kMaxRows);
    kernels[rows - 1]<<<grid, block, 0, cu>>>(a + row * kernel.k, w, sc, static_cast<__half*>(py) + row * kernel.n,
                                              kernel.k, kernel.n, kb);
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
