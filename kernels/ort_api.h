// What every mxspd op needs from ONNX Runtime, and the CPU dispatch they share.
//
// ONNX Runtime ships no C headers in its wheel. Its C API is a table of function pointers whose order
// only ever grows (OrtGetApiBase()->GetApi(version)); the few entries used here are declared below by
// their documented index, as ONNX Runtime's own C# binding declares its table.

#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(MXSPD_NO_X86)
// GCC 12's AVX-512 headers warn of their own _mm512_undefined_* values (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define MXSPD_X86 1
#endif

namespace mxspd {

struct OrtStatus;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtValue;
struct OrtShapeInfo;
struct OrtCustomOpDomain;
struct OrtSessionOptions;

constexpr uint32_t kApiVersion = 17;  // KernelContext_ParallelFor arrived in 1.17
constexpr int kOrtFail = 1;          // OrtErrorCode
constexpr int kFloat = 1, kUint8 = 2, kFloat16 = 10;  // ONNXTensorElementDataType
constexpr int kRequired = 0, kOptional = 1;  // OrtCustomOpInputOutputCharacteristic

struct OrtApiBase {
  const void* const* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

// Index of each function in the OrtApi table.
enum ApiIndex : int {
  kCreateStatus = 0,
  kCreateCustomOpDomain = 26,
  kCustomOpDomainAdd = 27,
  kAddCustomOpDomain = 28,
  kGetTensorMutableData = 51,
  kGetDimensionsCount = 61,
  kGetDimensions = 62,
  kGetTensorTypeAndShape = 65,
  kKernelInfoGetAttributeFloat = 85,
  kKernelInfoGetAttributeInt64 = 86,
  kKernelContextGetInput = 90,
  kKernelContextGetOutput = 91,
  kReleaseStatus = 93,
  kReleaseTensorTypeAndShapeInfo = 99,
  kKernelContextGetGPUComputeStream = 193,
  kKernelContextParallelFor = 274,
};

struct Api {
  const void* const* table = nullptr;
  template <typename F>
  F fn(ApiIndex i) const { return reinterpret_cast<F>(const_cast<void*>(table[i])); }

  OrtStatus* error(const char* msg) const {
    return fn<OrtStatus* (*)(int, const char*)>(kCreateStatus)(kOrtFail, msg);
  }
  OrtStatus* attribute(const OrtKernelInfo* info, const char* name, int64_t* out) const {
    return fn<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttributeInt64)(info, name,
                                                                                                            out);
  }
  // An optional integer attribute: `fallback` unless given.
  void optional_attribute(const OrtKernelInfo* info, const char* name, int64_t fallback, int64_t* out) const {
    if (OrtStatus* s = attribute(info, name, out)) {
      release(s);
      *out = fallback;
    }
  }
  OrtStatus* attribute(const OrtKernelInfo* info, const char* name, float* out) const {
    return fn<OrtStatus* (*)(const OrtKernelInfo*, const char*, float*)>(kKernelInfoGetAttributeFloat)(info, name,
                                                                                                          out);
  }
  // An optional input or output the node does not have comes back as null: an error, not a crash.
  OrtStatus* input(const OrtKernelContext* ctx, size_t i, const OrtValue** out) const {
    *out = nullptr;
    if (OrtStatus* s = fn<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(kKernelContextGetInput)(
            ctx, i, out))
      return s;
    return *out ? nullptr : error("mxspd op: a required input is missing from the node");
  }
  OrtStatus* output(OrtKernelContext* ctx, size_t i, const int64_t* dims, size_t n, OrtValue** out) const {
    *out = nullptr;
    if (OrtStatus* s = fn<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(
            kKernelContextGetOutput)(ctx, i, dims, n, out))
      return s;
    return *out ? nullptr : error("mxspd op: a required output is missing from the node");
  }
  OrtStatus* data(const OrtValue* v, void** out) const {
    return fn<OrtStatus* (*)(OrtValue*, void**)>(kGetTensorMutableData)(const_cast<OrtValue*>(v), out);
  }
  OrtStatus* shape(const OrtValue* v, std::vector<int64_t>* dims) const {
    OrtShapeInfo* info = nullptr;
    OrtStatus* s = fn<OrtStatus* (*)(const OrtValue*, OrtShapeInfo**)>(kGetTensorTypeAndShape)(v, &info);
    if (s) return s;
    size_t n = 0;
    s = fn<OrtStatus* (*)(const OrtShapeInfo*, size_t*)>(kGetDimensionsCount)(info, &n);
    if (!s) {
      dims->assign(n, 0);
      s = fn<OrtStatus* (*)(const OrtShapeInfo*, int64_t*, size_t)>(kGetDimensions)(info, dims->data(), n);
    }
    fn<void (*)(OrtShapeInfo*)>(kReleaseTensorTypeAndShapeInfo)(info);
    return s;
  }
  void release(OrtStatus* s) const { fn<void (*)(OrtStatus*)>(kReleaseStatus)(s); }
  // The CUDA provider's compute stream (a cudaStream_t), for a GPU op's kernels.
  OrtStatus* gpu_stream(const OrtKernelContext* ctx, void** out) const {
    return fn<OrtStatus* (*)(const OrtKernelContext*, void**)>(kKernelContextGetGPUComputeStream)(ctx, out);
  }
  OrtStatus* parallel_for(const OrtKernelContext* ctx, void (*f)(void*, size_t), size_t total, void* user) const {
    return fn<OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*)>(
        kKernelContextParallelFor)(ctx, f, total, 2, user);
  }

  // Input i's data and shape.
  template <typename T>
  OrtStatus* tensor(const OrtKernelContext* ctx, size_t i, const T** out, std::vector<int64_t>* dims) const {
    const OrtValue* v = nullptr;
    void* p = nullptr;
    if (OrtStatus* s = input(ctx, i, &v)) return s;
    if (OrtStatus* s = shape(v, dims)) return s;
    if (OrtStatus* s = data(v, &p)) return s;
    *out = static_cast<const T*>(p);
    return nullptr;
  }
  // Output i, allocated with `dims`.
  template <typename T>
  OrtStatus* output_data(OrtKernelContext* ctx, size_t i, const std::vector<int64_t>& dims, T** out) const {
    OrtValue* v = nullptr;
    void* p = nullptr;
    if (OrtStatus* s = output(ctx, i, dims.data(), dims.size(), &v)) return s;
    if (OrtStatus* s = data(v, &p)) return s;
    *out = static_cast<T*>(p);
    return nullptr;
  }
};

inline Api g_api;

// OrtCustomOp, field for field (ONNX Runtime reads the fields that exist at `version`).
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp*, const void*, const OrtKernelInfo*);
  const char* (*GetName)(const OrtCustomOp*);
  const char* (*GetExecutionProviderType)(const OrtCustomOp*);
  int (*GetInputType)(const OrtCustomOp*, size_t);
  size_t (*GetInputTypeCount)(const OrtCustomOp*);
  int (*GetOutputType)(const OrtCustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const OrtCustomOp*);
  void (*KernelCompute)(void*, OrtKernelContext*);
  void (*KernelDestroy)(void*);
  int (*GetInputCharacteristic)(const OrtCustomOp*, size_t);
  int (*GetOutputCharacteristic)(const OrtCustomOp*, size_t);
  int (*GetInputMemoryType)(const OrtCustomOp*, size_t);
  int (*GetVariadicInputMinArity)(const OrtCustomOp*);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp*);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp*);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp*);
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp*, const void*, const OrtKernelInfo*, void**);
  OrtStatus* (*KernelComputeV2)(void*, OrtKernelContext*);
  OrtStatus* (*InferOutputShapeFn)(const OrtCustomOp*, void*);
  int (*GetStartVersion)(const OrtCustomOp*);
  int (*GetEndVersion)(const OrtCustomOp*);
  size_t (*GetMayInplace)(int**, int**);
  void (*ReleaseMayInplace)(int*, int*);
  size_t (*GetAliasMap)(int**, int**);
  void (*ReleaseAliasMap)(int*, int*);
};

// A CPU op with float outputs (one, unless `outputs` says more); input i has type input_type(i).
inline OrtCustomOp make_op(const char* (*name)(const OrtCustomOp*), int (*input_type)(const OrtCustomOp*, size_t),
                           size_t (*inputs)(const OrtCustomOp*),
                           OrtStatus* (*create)(const OrtCustomOp*, const void*, const OrtKernelInfo*, void**),
                           OrtStatus* (*compute)(void*, OrtKernelContext*), void (*destroy)(void*),
                           size_t (*outputs)(const OrtCustomOp*) = [](const OrtCustomOp*) -> size_t { return 1; }) {
  OrtCustomOp op{};
  op.version = kApiVersion;
  op.GetName = name;
  op.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return "CPUExecutionProvider"; };
  op.GetInputType = input_type;
  op.GetInputTypeCount = inputs;
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return kFloat; };
  op.GetOutputTypeCount = outputs;
  op.KernelDestroy = destroy;
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return kRequired; };
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return kRequired; };
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return 0; };       // default (CPU)
  op.GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.CreateKernelV2 = create;
  op.KernelComputeV2 = compute;
  op.GetStartVersion = [](const OrtCustomOp*) { return 1; };
  op.GetEndVersion = [](const OrtCustomOp*) { return INT_MAX; };
  return op;
}

// `op` with its inputs from In on and its outputs from Out on optional (a prologue's, kernels/prologue.h).
template <size_t In, size_t Out>
OrtCustomOp optional_from(OrtCustomOp op) {
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t i) { return i >= In ? kOptional : kRequired; };
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t i) { return i >= Out ? kOptional : kRequired; };
  return op;
}

// 8 lanes summed in this fixed order, by the vector paths and their portable twins alike.
inline float lane_sum(const float* a) {
  const float t0 = a[0] + a[4], t1 = a[1] + a[5], t2 = a[2] + a[6], t3 = a[3] + a[7];
  return (t0 + t2) + (t1 + t3);
}

#ifdef MXSPD_X86
inline bool has_avx2() {
  __builtin_cpu_init();  // this may run before libgcc's own constructor has filled the CPU model in
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
// Every op's vector path, unless MXSPD_KERNELS_PORTABLE is set (tests run every path).
inline const bool kHasAvx2 = has_avx2() && !std::getenv("MXSPD_KERNELS_PORTABLE");

// The target of the AVX-512 paths (512-bit registers with byte/word ops and VNNI dot products): Intel
// Xeon since Cascade Lake, AMD EPYC since Zen 4.
#define MXSPD_AVX512 "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma"
// MXMatMul's AVX-512 path also decodes codes with VBMI's byte permutes: Intel since Ice Lake, AMD Zen 4.
#define MXSPD_AVX512_VBMI MXSPD_AVX512 ",avx512vbmi"
inline bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
}
// Ops with an AVX-512 path take it unless MXSPD_KERNELS_AVX2 is set (tests compare it with the AVX2 path).
inline const bool kHasAvx512 = kHasAvx2 && has_avx512() && !std::getenv("MXSPD_KERNELS_AVX2");
inline const bool kHasAvx512Vbmi = kHasAvx512 && __builtin_cpu_supports("avx512vbmi");
// AMX's int8 tiles (Intel Xeon since Sapphire Rapids): the CPU has them, the OS saves their state (XCR0 bits 17
// and 18: a VM may report AMX without enabling it, and then tile instructions fault) and grants this process
// their use (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, once: the permission is the process's).
inline bool has_amx_int8() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || (d & (3u << 24)) != (3u << 24)) return false;  // AMX-TILE, AMX-INT8
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE: xgetbv may run
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & (3u << 17)) == (3u << 17) && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}
// MXMatMul's many-row int8 path multiplies on AMX tiles unless MXSPD_KERNELS_NO_AMX is set (the same bits).
inline const bool kHasAmx = kHasAvx512Vbmi && !std::getenv("MXSPD_KERNELS_NO_AMX") && has_amx_int8();
#endif

// The ops, one per source file.
const OrtCustomOp* mx_matmul_op();
const OrtCustomOp* mx_matmul_gpu_op();
int64_t mx_preferred_layout(int64_t activation_bits);
const OrtCustomOp* row_matmul_op();
const OrtCustomOp* attention_op();
const OrtCustomOp* rotary_attention_op();
const OrtCustomOp* attention_half_kv_op();
const OrtCustomOp* rotary_attention_half_kv_op();
const OrtCustomOp* rotary_op();
const OrtCustomOp* rotary_qkv_op();
const OrtCustomOp* swiglu_op();

}  // namespace mxspd
