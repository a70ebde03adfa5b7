// ai.mxspd::MXMatMulGPU's attributes and shape contract, defined once for the kernel the GPU runs
// (kernels/cuda/mx_matmul_gpu.cu) and its CPU reference (kernels/mx_matmul_gpu.cc), so the two can
// never accept different graphs.
//
// Attributes K, N, weight_bits (6: MXFP6 E2M3, the default; 8: MXINT8). Inputs A [..., K],
// W uint8 [N, ceil(K/32), 24 or 32] and S uint8 [N, ceil(K/32)] (kernels/layout.py, pack_gpu);
// output [..., N].

#pragma once

#include <cstdint>
#include <new>
#include <vector>

#include "mx_gpu_layout.h"
#include "ort_api.h"

namespace mxspd {
namespace gpu_op {

struct Kernel {
  int64_t k, n, weight_bits;
};

inline OrtStatus* create_kernel(const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** out) {
  int64_t k = 0, n = 0, wbits = 6;
  if (OrtStatus* s = g_api.attribute(info, "K", &k)) return s;
  if (OrtStatus* s = g_api.attribute(info, "N", &n)) return s;
  g_api.optional_attribute(info, "weight_bits", 6, &wbits);
  if (k <= 0 || n <= 0) return g_api.error("MXMatMulGPU: attributes K and N must be positive");
  if (wbits != 6 && wbits != 8) return g_api.error("MXMatMulGPU: weight_bits must be 6 (MXFP6 E2M3) or 8 (MXINT8)");
  *out = new (std::nothrow) Kernel{k, n, wbits};
  return *out ? nullptr : g_api.error("MXMatMulGPU: out of memory");
}

inline void delete_kernel(void* kernel) { delete static_cast<Kernel*>(kernel); }

// The call's shapes against the attributes: on success, A's rows (`m`), the blocks per column (`kb`)
// and Y's shape.
inline OrtStatus* check_shapes(const Kernel& kernel, const std::vector<int64_t>& adims,
                               const std::vector<int64_t>& wdims, const std::vector<int64_t>& sdims, int64_t* m,
                               int64_t* kb, std::vector<int64_t>* ydims) {
  using gpu_layout::kBlock;
  using gpu_layout::kBlockBytes;
  *kb = (kernel.k + kBlock - 1) / kBlock;
  const int64_t bytes = kernel.weight_bits == 8 ? kBlockBytes<8> : kBlockBytes<6>;
  if (adims.empty() || adims.back() != kernel.k)
    return g_api.error("MXMatMulGPU: the last dimension of A must equal attribute K");
  if (wdims != std::vector<int64_t>{kernel.n, *kb, bytes} || sdims != std::vector<int64_t>{kernel.n, *kb})
    return g_api.error("MXMatMulGPU: W must be uint8 [N, ceil(K/32), 24 (weight_bits 6) or 32 (8)] and S uint8 "
                       "[N, ceil(K/32)] (kernels/layout.py, pack_gpu)");
  *m = 1;
  for (size_t i = 0; i + 1 < adims.size(); ++i) *m *= adims[i];
  *ydims = adims;
  ydims->back() = kernel.n;
  return nullptr;
}

}  // namespace gpu_op
}  // namespace mxspd
