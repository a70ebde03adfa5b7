// The library's entry point: ONNX Runtime's SessionOptions.register_custom_ops_library(path) calls
// RegisterCustomOps, which adds the ai.mxspd domain with every op of this library. The compiler asks
// mxspd_mx_preferred_layout_for (by ctypes) which MXFP6 weight layout to write for activations of that many
// bits (kernels/mx_matmul.cc); mxspd_mx_preferred_layout, for int16 activations, is what libraries before
// layout planes8 answered. mxspd_uses_amx says whether MXMatMul's many-row int8 path multiplies on AMX tiles
// here (tests and benchmarks name the path they ran).

#include <mutex>

#include "ort_api.h"

using namespace mxspd;

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                                const OrtApiBase* base) {
  static std::once_flag once;
  static OrtCustomOpDomain* domain = nullptr;
  static OrtStatus* failed = nullptr;
  std::call_once(once, [&] {
    g_api.table = base->GetApi(kApiVersion);
    if (!g_api.table) return;
    failed = g_api.fn<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(kCreateCustomOpDomain)("ai.mxspd", &domain);
    for (const OrtCustomOp* op :
         {mx_matmul_op(), mx_matmul_gpu_op(), row_matmul_op(), attention_op(), rotary_attention_op(), attention_half_kv_op(),
          rotary_attention_half_kv_op(), rotary_op(), rotary_qkv_op(), swiglu_op()})
      if (!failed) failed = g_api.fn<OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*)>(kCustomOpDomainAdd)(domain, op);
  });
  if (!g_api.table) return nullptr;  // cannot even report: ONNX Runtime older than 1.17
  if (failed) return g_api.error("mxspd kernels: registering the ai.mxspd domain failed");
  return g_api.fn<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(kAddCustomOpDomain)(options, domain);
}

extern "C" __attribute__((visibility("default"))) int64_t mxspd_mx_preferred_layout() { return mx_preferred_layout(16); }
extern "C" __attribute__((visibility("default"))) int64_t mxspd_mx_preferred_layout_for(int64_t activation_bits) {
  return mx_preferred_layout(activation_bits);
}
extern "C" __attribute__((visibility("default"))) int64_t mxspd_uses_amx() {
#ifdef MXSPD_X86
  return kHasAmx;
#else
  return 0;
#endif
}
