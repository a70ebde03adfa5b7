"""The GPU target's MX matmul (ai.mxspd::MXMatMulGPU) where no GPU is: its per-column layout, its CPU
reference against the documented values, the lowering that emits it for ort-cuda builds, and the CUDA
source compiled with CUDA's compiler where one is installed. Its CUDA kernel's values and speed are
measured on a GPU (benchmarks/cuda_device.sh, step kernel: benchmarks.gpu_kernel)."""

from __future__ import annotations

import ctypes
from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kernels
from common.manifest import read_manifest
from common.recipe import ModelSpec
from common.targets import session_options
from compiler import build
from compiler.mx_lowering import lower_model
from export.pipeline import build_artifact
from kernels import cuda_build
from kernels.layout import GPU_BLOCK_BYTES, pack_gpu, pack_gpu_scales
from quant import element_values, fake_quantize
from quant.onnx_pass import MXPass, apply_passes, quantize_model
from tests.conftest import tiny_recipe
from tests.test_mx_graph import matmul_model, renamed, weights

needs_library = pytest.mark.skipif(kernels.library_path() is None, reason="native kernel library not built here")


def gpu_model(w: np.ndarray, s: np.ndarray, k: int, n: int, wbits: int) -> onnx.ModelProto:
    node = helper.make_node(kernels.MX_MATMUL_GPU, ["a", "w", "s"], ["y"], domain=kernels.DOMAIN, K=k, N=n,
                            weight_bits=wbits)
    graph = helper.make_graph([node], "gpu", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(s, "s")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(kernels.DOMAIN, 1)])


def random_codes(rng: np.random.Generator, k: int, n: int, wbits: int) -> np.ndarray:
    """E2M3 codes (uint8 0..63) or MXINT8's symmetric int8 codes, [K, N]."""
    if wbits == 6:
        return rng.integers(0, 64, (k, n)).astype(np.uint8)
    return rng.integers(-127, 128, (k, n)).astype(np.int8)


def exact_values(codes: np.ndarray, exps: np.ndarray, wbits: int) -> np.ndarray:
    """float64 [K, N]: E2M3 values or MXINT8 codes times 2^(e - 127) (MXINT8's e holds its 2^-6 here)."""
    values = codes.astype(np.float64) * 2.0**-6 if wbits == 8 else element_values("fp6_e2m3")[codes]
    e = exps.astype(int) + (6 if wbits == 8 else 0)
    scale = np.where(exps == 255, np.nan, np.ldexp(1.0, e - 127))
    return values * scale.repeat(32, 0)[: codes.shape[0]]


@pytest.mark.parametrize("wbits", [6, 8])
@pytest.mark.parametrize("k,n", [(96, 40), (70, 19), (4096, 3)])
def test_the_layout_keeps_each_columns_blocks_together(wbits, k, n):
    rng = np.random.default_rng(k + n)
    codes = random_codes(rng, k, n, wbits)
    packed = pack_gpu(codes, wbits)
    kb = -(-k // 32)
    assert packed.shape == (n, kb, GPU_BLOCK_BYTES[wbits]) and packed.dtype == np.uint8
    # read back as the kernels do: block b of column j, code i at bits 6i of its 24 bytes (or byte i)
    j, b = n - 1, kb - 1
    block = packed[j, b]
    if wbits == 6:
        bits = int.from_bytes(block.tobytes(), "little")
        got = [(bits >> (6 * i)) & 63 for i in range(32)]
    else:
        got = block.view(np.int8).tolist()
    want = [int(codes[32 * b + i, j]) if 32 * b + i < k else 0 for i in range(32)]
    assert got == want
    exps = rng.integers(110, 140, (kb, n)).astype(np.uint8)
    assert pack_gpu_scales(exps).shape == (n, kb) and pack_gpu_scales(exps)[j, b] == exps[b, j]


@needs_library
@pytest.mark.parametrize("wbits", [6, 8])
@pytest.mark.parametrize("k,n,rows", [(96, 40, 3), (70, 19, 9), (576, 64, 1)])
def test_the_cpu_reference_computes_the_documented_values(wbits, k, n, rows):
    rng = np.random.default_rng(7)
    codes = random_codes(rng, k, n, wbits)
    exps = rng.integers(118, 132, (-(-k // 32), n)).astype(np.uint8)
    exps[0, 2] = 255  # a NaN block: column 2 is NaN
    a = rng.standard_normal((rows, k)).astype(np.float32)
    model = gpu_model(pack_gpu(codes, wbits), pack_gpu_scales(exps), k, n, wbits)
    y = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"]
                             ).run(None, {"a": a})[0]
    ref = a.astype(np.float64) @ exact_values(codes, exps, wbits)
    assert np.isnan(y[:, 2]).all() and np.isfinite(np.delete(y, 2, axis=1)).all()
    np.testing.assert_allclose(np.delete(y, 2, axis=1), np.delete(ref, 2, axis=1), rtol=1e-5,
                               atol=1e-5 * np.abs(np.delete(ref, 2, axis=1)).max())
    scrambled = gpu_model(pack_gpu(codes[::-1].copy(), wbits), pack_gpu_scales(exps), k, n, wbits)  # control
    other = ort.InferenceSession(scrambled.SerializeToString(), session_options(), providers=["CPUExecutionProvider"]
                                 ).run(None, {"a": a})[0]
    assert not np.allclose(np.delete(other, 2, axis=1), np.delete(ref, 2, axis=1), rtol=1e-3)


@needs_library
@pytest.mark.parametrize("fragment", [None, "lm_head"])
def test_the_gpu_lowering_runs_mxmatmulgpu_on_the_mx_values(fragment):
    """ort-cuda's native lowering: every MX MatMul becomes MXMatMulGPU (MXFP6, or MXINT8 for a head),
    whose CPU reference gives the MX values' product (float32 sums)."""
    w = weights(96, 40)
    model = renamed(matmul_model(w), "lm_head.weight.T") if fragment else matmul_model(w)
    name = model.graph.node[0].input[1]
    if fragment:
        apply_passes(model, [MXPass(int8=(fragment,))])
    else:
        quantize_model(model)
    fmt = "int8" if fragment else "fp6_e2m3"
    assert lower_model(model, kernels.GPU_LOWERING) == {name: fmt}
    assert [(n.op_type, n.domain) for n in model.graph.node] == [(kernels.MX_MATMUL_GPU, kernels.DOMAIN)]
    build._check_lowered(model, "decode", kernels.GPU_LOWERING, {name: fmt})
    x = np.random.default_rng(2).standard_normal((1, 3, 96)).astype(np.float32)
    y = ort.InferenceSession(model.SerializeToString(), session_options(),
                             providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    exact = x @ fake_quantize(w, fmt, axis=0)
    np.testing.assert_allclose(y, exact, rtol=0, atol=1e-5 * np.abs(exact).max())


@needs_library
def test_an_ort_cuda_build_lowers_mx_weights_to_the_gpu_kernel(checkpoints, tmp_path):
    """Built on a machine without a GPU: every MX weight (decoder MXFP6, head MXINT8) runs MXMatMulGPU with
    float16 activations; no 8-bit MatMulNBits is left, and the manifest says which kernel."""
    recipe = replace(tiny_recipe(target="ort-cuda"), dlm=None, tlm=ModelSpec(model="", mx_format="fp6_e2m3"))
    with pytest.warns(UserWarning, match="batch-invariant graphs need mxspd's kernels"):
        art = build_artifact(recipe, tmp_path / "art", tlm=str(checkpoints["llama-gqa"]), progress=False)
    manifest = read_manifest(art)
    quant = manifest.models["tlm"].quant
    assert quant["lowering"] == kernels.GPU_LOWERING and "MXMatMulGPU" in quant["kernel"]
    model = onnx.load(str(art / "tlm" / "decode.onnx"), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count(kernels.MX_MATMUL_GPU) == 7 * 2 + 1 and "MatMulNBits" not in ops
    gpu = [n for n in model.graph.node if n.op_type == kernels.MX_MATMUL_GPU]
    to32 = [n for n in model.graph.node if n.op_type == "Cast" and n.attribute[0].i == TensorProto.FLOAT]
    assert to32  # the float32 islands (RMSNorm statistics, logits) are there, and no MXMatMulGPU borders one
    assert not {n.output[0] for n in to32} & {n.input[0] for n in gpu} and not {n.input[0] for n in to32} & {
        n.output[0] for n in gpu}
    inits = {t.name: t for t in model.graph.initializer}
    head = next(n for n in gpu if n.input[1].startswith("lm_head"))
    assert list(inits[head.input[1]].dims)[2] == GPU_BLOCK_BYTES[8]
    assert all(list(inits[n.input[1]].dims)[2] == GPU_BLOCK_BYTES[6] for n in gpu if n is not head)


def test_the_cuda_source_compiles_where_nvcc_is():
    try:
        cuda_build.nvcc()
    except cuda_build.NvccNotFoundError as exc:
        pytest.skip(str(exc))
    cuda_build.build(check=True, arches="90")


def test_the_cuda_library_registers_with_onnx_runtime(tmp_path):
    """Built whole (cudart linked statically, so it loads without a GPU), its RegisterCustomOps adds the
    ai.mxspd domain to a session's options as ONNX Runtime expects."""
    try:
        cuda_build.nvcc()
    except cuda_build.NvccNotFoundError as exc:
        pytest.skip(str(exc))
    library = cuda_build.build(tmp_path / "cuda.so", arches="90")
    assert hasattr(ctypes.CDLL(str(library)), "RegisterCustomOps")
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(library))
