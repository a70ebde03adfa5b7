// ai.mxspd::RowMatMul: Y = A @ B for float32 A [..., K] and a float32 weight B [K, N], where every output
// element is one chain of fused multiply-adds in k order: y = fma(a[K-1], b[K-1], ... fma(a[0], b[0], 0)).
// B comes packed in panels of 64 columns, P [ceil(N/64), K, 64] (zero-padded; kernels/layout.py), so a
// panel is one contiguous read; attribute N.
//
// Why: ONNX Runtime's MatMul runs one row through another kernel path than several (on AVX2 machines),
// so a token's logits changed with the number of rows sharing its call, and speculation stopped being
// lossless. Here an element's arithmetic depends on its row and column only: not on the rows beside it,
// the tiling, the thread count, or the CPU (the portable path gives the same bits: std::fma rounds once,
// as the vector FMA does).
//
// prologue (kernels/prologue.h), as MXMatMul's: 1 SwiGLU (A [..., 2K]); 2 residual RMS norm (inputs 2 skip
// and 3 gamma, attribute epsilon; output 1 the residual sum), computed on A's rows first.

#include <algorithm>
#include <cmath>
#include <new>

#include "ort_api.h"
#include "prologue.h"

namespace mxspd {
namespace {

constexpr int64_t kPanel = 64;

struct Problem {
  const float* a;  // [M, K]
  const float* b;  // [ceil(N / 64), K, 64]
  float* y;        // [M, N]
  int64_t m, k, n;

  const float* column(int64_t col) const { return b + (col / kPanel * k) * kPanel + col % kPanel; }
};

void element_scalar(const Problem& p, int64_t row, int64_t col) {
  const float* b = p.column(col);
  float acc = 0.0f;
  for (int64_t k = 0; k < p.k; ++k) acc = std::fma(p.a[row * p.k + k], b[k * kPanel], acc);
  p.y[row * p.n + col] = acc;
}

#ifdef MXSPD_X86
// A K-chunk of a panel (64 k: 16 KB) stays in L1 while every row of the call reads it. Reading a whole
// panel once per pair of rows and half its columns at a time (as before) made a 2-row scoring call cost
// 1.6x a decode step in float32 (half of every 256-byte panel row per pass defeats streaming); now the
// first row streams each chunk's whole lines and the others read it from L1: 2 rows cost 0.95-1.2x one
// (docs/benchmarks-history.md; asking for the next chunk while the other rows compute gained nothing measurable).
constexpr int64_t kChunkK = 64;

// R rows by V * 8 columns over k in [k0, k1), accumulators in registers, carried between chunks in Y;
// each element is the same fma chain as element_scalar.
template <int R, int V>
__attribute__((target("avx2,fma"))) void block_avx2(const Problem& p, int64_t row, int64_t col, int64_t k0,
                                                    int64_t k1) {
  __m256 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      acc[r][v] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(p.y + (row + r) * p.n + col + 8 * v);
  const float* b = p.column(col) + k0 * kPanel;
  for (int64_t k = k0; k < k1; ++k, b += kPanel) {
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(p.a + (row + r) * p.k + k);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 8 * v), acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(p.y + (row + r) * p.n + col + 8 * v, acc[r][v]);
}

// Rows [row0, m) by columns [c, end) in blocks of 8 * V columns and pairs of rows; returns where it stopped.
template <int V>
__attribute__((target("avx2,fma"))) int64_t blocks_avx2(const Problem& p, int64_t row0, int64_t c, int64_t end,
                                                        int64_t k0, int64_t k1) {
  for (; c + 8 * V <= end; c += 8 * V) {
    int64_t row = row0;
    for (; row + 2 <= p.m; row += 2) block_avx2<2, V>(p, row, c, k0, k1);
    if (row < p.m) block_avx2<1, V>(p, row, c, k0, k1);
  }
  return c;
}

// A panel's columns [c, end) chunk by chunk; returns the first column left to the scalar path.
__attribute__((target("avx2,fma"))) int64_t panel_avx2(const Problem& p, int64_t c, int64_t end) {
  int64_t stop = c;
  for (int64_t k0 = 0; k0 < p.k; k0 += kChunkK) {
    const int64_t k1 = std::min(p.k, k0 + kChunkK);
    int64_t row = 0;
    if (c + kPanel <= end) {  // a whole panel: row 0 streams the chunk's lines, 8 accumulators
      block_avx2<1, 8>(p, 0, c, k0, k1);
      row = 1;
    }
    stop = blocks_avx2<1>(p, row, blocks_avx2<4>(p, row, c, end, k0, k1), end, k0, k1);
  }
  return stop;
}
#endif

void task(void* user, size_t index) {
  const Problem& p = *static_cast<const Problem*>(user);
  int64_t c = static_cast<int64_t>(index) * kPanel;
  const int64_t end = std::min(p.n, c + kPanel);
#ifdef MXSPD_X86
  if (kHasAvx2) c = panel_avx2(p, c, end);
#endif
  for (; c < end; ++c)
    for (int64_t row = 0; row < p.m; ++row) element_scalar(p, row, c);
}

struct Kernel {
  int64_t n, prologue;
  float epsilon;
};

OrtStatus* create_kernel(const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** out) {
  int64_t n = 0, prologue = kNone;
  float epsilon = 0.0f;
  if (OrtStatus* s = g_api.attribute(info, "N", &n)) return s;
  if (n <= 0) return g_api.error("RowMatMul: attribute N must be positive");
  if (OrtStatus* s = read_prologue(info, "RowMatMul: prologue must be 0, 1 or 2", &prologue, &epsilon)) return s;
  *out = new (std::nothrow) Kernel{n, prologue, epsilon};
  return *out ? nullptr : g_api.error("RowMatMul: out of memory");
}

OrtStatus* compute(void* op_kernel, OrtKernelContext* ctx) {
  const Kernel& kernel = *static_cast<Kernel*>(op_kernel);
  const int64_t n = kernel.n;
  const float *a = nullptr, *b = nullptr;
  std::vector<int64_t> adims, bdims;
  if (OrtStatus* s = g_api.tensor(ctx, 0, &a, &adims)) return s;
  if (OrtStatus* s = g_api.tensor(ctx, 1, &b, &bdims)) return s;
  const int64_t panels = (n + kPanel - 1) / kPanel, width = kernel.prologue == kSwiGLU ? 2 : 1;
  if (adims.empty() || adims.back() % width != 0 || bdims != std::vector<int64_t>{panels, adims.back() / width, kPanel})
    return g_api.error("RowMatMul: B must be packed [ceil(N/64), K, 64], K the last dimension of A (half of it "
                       "with prologue 1, SwiGLU)");
  const int64_t k = bdims[1];
  int64_t m = 1;
  for (size_t i = 0; i + 1 < adims.size(); ++i) m *= adims[i];
  std::vector<int64_t> ydims = adims;
  ydims.back() = n;
  float* y = nullptr;
  if (OrtStatus* s = g_api.output_data(ctx, 0, ydims, &y)) return s;
  if (kernel.prologue != kNone)
    if (OrtStatus* s = prologue_rows(kernel.prologue, k, kernel.epsilon, ctx, 2, a, adims, m, &a)) return s;
  if (m == 0) return nullptr;
  Problem p{a, b, y, m, k, n};
  return g_api.parallel_for(ctx, task, static_cast<size_t>(panels), &p);
}

}  // namespace

const OrtCustomOp* row_matmul_op() {
  static const OrtCustomOp op = optional_from<2, 1>(make_op(
      [](const OrtCustomOp*) { return "RowMatMul"; }, [](const OrtCustomOp*, size_t) { return kFloat; },
      [](const OrtCustomOp*) -> size_t { return 4; }, create_kernel, compute,
      [](void* k) { delete static_cast<Kernel*>(k); }, [](const OrtCustomOp*) -> size_t { return 2; }));
  return &op;
}

}  // namespace mxspd
