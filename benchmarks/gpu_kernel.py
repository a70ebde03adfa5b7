"""mxspd's MXFP6 CUDA kernel (ai.mxspd::MXMatMulGPU) against float16 and 8-bit MatMulNBits on one GPU.

    python -m benchmarks.gpu_kernel [--rows 1,2,9,128] [--layers 8] [--repeats 20] [--out FILE]

Needs ONNX Runtime's CUDA provider and the kernel library (`python -m kernels.cuda_build`). Builds a
stack of `--layers` independent Llama-2-7B MLP matrices (K 4096, N 11008; 35 MB each in MXFP6, well
past the GPU's L2 together) as three graphs: MXMatMulGPU on MXFP6 (6.25 bits per weight), ONNX
Runtime's MatMul on float16 (16) and MatMulNBits on 8-bit codes (8.5: the previous ort-cuda lowering),
the same values in all three. First checks MXMatMulGPU's values: the CUDA kernel against its CPU
reference (kernels/mx_matmul_gpu.cc) on the same float16 inputs, within float16's rounding of the output,
at 1, 9, 16, 40 and 128 rows (the one- and few-row path, and the tensor cores' from 16), at the 7B shape
and at a ragged one (K 100, N 70).
Then times each graph for every row count (inputs and outputs bound on the GPU, CUDA-synchronised
calls, median of `--repeats`) and prints ms per call, GB/s of weights read, and MXFP6's speedup over
float16 and over 8-bit.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import kernels
from common.targets import TARGETS, session_options
from kernels.layout import GPU_BLOCK_BYTES, pack_gpu, pack_gpu_scales
from quant import element_values

K, N = 4096, 11008
BLOCK = 32
CHECK_ROWS = (1, 9, 16, 40, 128)  # mx_gemv below 16 rows, mx_gemm (tensor cores) from 16


def weights(layers: int, seed: int = 0, k: int = K, n: int = N) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random E2M3 codes [k, n] and E8M0 exponents [ceil(k/32), n] near 2^-7 per layer."""
    rng = np.random.default_rng(seed)
    kb = -(-k // BLOCK)
    return [(rng.integers(0, 64, (k, n)).astype(np.uint8), rng.integers(118, 122, (kb, n)).astype(np.uint8))
            for _ in range(layers)]


def values(codes: np.ndarray, exps: np.ndarray) -> np.ndarray:
    return (element_values("fp6_e2m3")[codes] * np.ldexp(1.0, exps.astype(int) - 127).repeat(BLOCK, 0)[
        : len(codes)]).astype(np.float32)


def stack(kind: str, layers: list[tuple[np.ndarray, np.ndarray]], dtype: int) -> onnx.ModelProto:
    nodes, inits, outputs = [], [], []
    k, n = layers[0][0].shape
    for i, (codes, exps) in enumerate(layers):
        if kind == "mxfp6":
            inits += [numpy_helper.from_array(pack_gpu(codes, 6), f"w{i}"),
                      numpy_helper.from_array(pack_gpu_scales(exps), f"s{i}")]
            nodes.append(helper.make_node(kernels.MX_MATMUL_GPU, ["x", f"w{i}", f"s{i}"], [f"y{i}"],
                                          domain=kernels.DOMAIN, K=k, N=n, weight_bits=6))
        elif kind == "float16":
            inits.append(numpy_helper.from_array(values(codes, exps).astype(np.float16), f"w{i}"))
            nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]))
        else:  # 8-bit MatMulNBits: 8 * value + 128 per column, scale 2^(e-130)
            q = (np.round(element_values("fp6_e2m3") * 8).astype(np.int32)[codes.T] + 128).astype(np.uint8)
            scales = np.ldexp(1.0, exps.T.astype(int) - 130).astype(np.float16)
            inits += [numpy_helper.from_array(q.reshape(n, k // BLOCK, BLOCK), f"w{i}"),
                      numpy_helper.from_array(scales.reshape(-1), f"s{i}")]
            nodes.append(helper.make_node("MatMulNBits", ["x", f"w{i}", f"s{i}"], [f"y{i}"], domain="com.microsoft",
                                          K=k, N=n, bits=8, block_size=BLOCK))
        outputs.append(helper.make_tensor_value_info(f"y{i}", dtype, ["M", n]))
    graph = helper.make_graph(nodes, kind, [helper.make_tensor_value_info("x", dtype, ["M", k])], outputs, inits)
    opsets = [helper.make_opsetid(d, v) for d, v in (("", 18), ("com.microsoft", 1), (kernels.DOMAIN, 1))]
    return helper.make_model(graph, opset_imports=opsets)


def session(model: onnx.ModelProto, folder: Path, name: str, cuda: bool) -> ort.InferenceSession:
    path = folder / f"{name}.onnx"
    onnx.save(model, path, save_as_external_data=True, location=f"{name}.bin")
    target = TARGETS["ort-cuda" if cuda else "ort-cpu"]
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if cuda else ["CPUExecutionProvider"]
    return ort.InferenceSession(str(path), session_options(target=target), providers=providers)


def timed(s: ort.InferenceSession, x: np.ndarray, repeats: int) -> float:
    """Median seconds of one call, the input bound on the GPU and the outputs left there."""
    binding = s.io_binding()
    binding.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0))
    for o in s.get_outputs():
        binding.bind_output(o.name, "cuda")
    for _ in range(3):
        s.run_with_iobinding(binding)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        s.run_with_iobinding(binding)
        binding.synchronize_outputs()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,9,128")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        ap.exit(2, "error: this ONNX Runtime has no CUDA provider (docs/gpu.md)\n")
    kernels.require_cuda_library()
    layers = weights(args.layers)
    rows = [int(r) for r in args.rows.split(",")]
    report: dict = {"shape": [K, N], "layers": args.layers, "rows": rows, "check": {}, "ms": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        # the check: the CUDA kernel against the CPU reference, float16 inputs for both, for the one-row and
        # few-row path (1, 9) and the tensor cores' (16 rows on), at the 7B shape and at a ragged one
        for shape, one in (((K, N), layers[:1]), ((100, 70), weights(1, seed=2, k=100, n=70))):
            name = "x".join(map(str, shape))
            gpu_s = session(stack("mxfp6", one, TensorProto.FLOAT16), folder, f"check_gpu_{name}", cuda=True)
            cpu_s = session(stack("mxfp6", one, TensorProto.FLOAT), folder, f"check_cpu_{name}", cuda=False)
            for m in CHECK_ROWS:
                x = np.random.default_rng(m).standard_normal((m, shape[0])).astype(np.float16)
                gpu = gpu_s.run(None, {"x": x})[0].astype(np.float32)
                cpu = cpu_s.run(None, {"x": x.astype(np.float32)})[0]
                err = float(np.abs(gpu - cpu).max() / np.abs(cpu).max())
                report["check"][f"{name} rows {m}"] = {"max_relative_error": err, "within_float16": err < 4e-3}
        bytes_per_weight = {"mxfp6": (GPU_BLOCK_BYTES[6] + 1) / BLOCK, "float16": 2.0, "int8": 1 + 2 / BLOCK}
        sessions = {kind: session(stack(kind, layers, TensorProto.FLOAT16), folder, kind, cuda=True)
                    for kind in bytes_per_weight}
        for m in rows:
            x = np.random.default_rng(m).standard_normal((m, K)).astype(np.float16)
            ms = {kind: timed(s, x, args.repeats) * 1e3 for kind, s in sessions.items()}
            report["ms"][m] = {kind: round(v, 3) for kind, v in ms.items()} | {
                "GB_per_s": {kind: round(args.layers * K * N * bytes_per_weight[kind] / (v / 1e3) / 1e9, 1)
                             for kind, v in ms.items()},
                "mxfp6_over_float16": round(ms["float16"] / ms["mxfp6"], 3),
                "mxfp6_over_int8": round(ms["int8"] / ms["mxfp6"], 3)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
