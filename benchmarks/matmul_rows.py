"""What one more row costs ONNX Runtime's CPU kernels: the floor under a scoring call's price.

    python -m benchmarks.matmul_rows [--layers 24] [--repeats 10] [--kinds "mxfp6 native,mxint8 native"]

A K+1-token scoring call reads the same weights as a decode step, so at the bandwidth floor it
would cost one step. This times the kernels alone, on a stack of 1024 x 8192 weights as large as the
220M checkpoint's (24 layers: 805 MB in float32), for M = 1..9 rows: float32 MatMul (MLAS SGEMM,
weights prepacked by the session) and the fused MXFP6 kernel (MatMulNBits bits=8, block 32,
accuracy_level 4, as compiler/mx_lowering.py emits it) and mxspd's own MXMatMul (kernels/mx_matmul.cc:
MXFP6 with int16 or int8 activations, MXINT8). Whatever a whole graph adds on top (attention, per-row
elementwise ops) comes on top of these ratios.
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

from common.targets import session_options
from compiler.mx_lowering import ACCURACY_LEVEL, BLOCK
from kernels import DOMAIN, MX_MATMUL, require_library
from kernels.layout import BLOCK_BYTES, GROUP

K, N = 1024, 8192
ROWS = (1, 2, 3, 5, 9)
KINDS = ("float32", "mxfp6 fused", "mxfp6 native", "mxfp6 native8", "mxint8 native")
# The native kinds: (weight bits, activation bits).
NATIVE = {"mxfp6 native": (6, 16), "mxfp6 native8": (6, 8), "mxint8 native": (8, 16)}


def stack(kind: str, layers: int, rng: np.random.Generator) -> tuple[onnx.ModelProto, int]:
    """`layers` independent weights, each multiplied by the input; returns the model and its weight bytes."""
    nodes, inits = [], []
    for i in range(layers):
        if kind == "float32":
            inits.append(numpy_helper.from_array((rng.standard_normal((K, N)) * 0.02).astype(np.float32), f"w{i}"))
            nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]))
        elif kind in NATIVE:
            wbits, abits = NATIVE[kind]
            codes = rng.integers(0, 256, size=(N // GROUP, K // BLOCK, BLOCK_BYTES[wbits]), dtype=np.uint8)
            exps = rng.integers(115, 125, size=(N // GROUP, K // BLOCK, GROUP), dtype=np.uint8)
            inits += [numpy_helper.from_array(codes, f"q{i}"), numpy_helper.from_array(exps, f"s{i}")]
            nodes.append(helper.make_node(MX_MATMUL, ["x", f"q{i}", f"s{i}"], [f"y{i}"], domain=DOMAIN, K=K, N=N,
                                          activation_bits=abits, weight_bits=wbits))
        else:
            codes = rng.integers(0, 256, size=(N, K // BLOCK, BLOCK), dtype=np.uint8)
            scales = (rng.random((N, K // BLOCK)) * 0.01 + 0.001).astype(np.float32)
            inits += [numpy_helper.from_array(codes, f"q{i}"), numpy_helper.from_array(scales, f"s{i}")]
            nodes.append(helper.make_node("MatMulNBits", ["x", f"q{i}", f"s{i}"], [f"y{i}"], domain="com.microsoft",
                                          K=K, N=N, bits=8, block_size=BLOCK, accuracy_level=ACCURACY_LEVEL))
    outputs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(layers)]
    graph = helper.make_graph(nodes, kind, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
                              outputs, inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1), helper.make_opsetid(DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    if kind in NATIVE:
        per_weight = (K // BLOCK) * (N // GROUP) * (BLOCK_BYTES[NATIVE[kind][0]] + GROUP)
    else:
        per_weight = K * N * 4 if kind == "float32" else K * N + (K // BLOCK) * N * 4
    return model, layers * per_weight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - set(KINDS):
        ap.error(f"unknown kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    if set(kinds) & set(NATIVE):
        require_library()
    rng = np.random.default_rng(0)
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        sessions = {}
        for kind in kinds:
            model, nbytes = stack(kind, args.layers, rng)
            path = Path(tmp) / f"{kind.replace(' ', '_')}.onnx"
            onnx.save(model, path, save_as_external_data=True, location=path.stem + ".bin")
            sessions[kind] = (ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"]),
                              nbytes)
        for kind, (session, nbytes) in sessions.items():
            ms = {}
            for m in ROWS:
                x = rng.standard_normal((m, K)).astype(np.float32)
                for _ in range(3):
                    session.run(None, {"x": x})
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    session.run(None, {"x": x})
                    times.append(time.perf_counter() - t0)
                ms[m] = float(np.median(times) * 1e3)
            out[kind] = {"weights_mb": round(nbytes / 1e6, 1), "GB_per_s_at_1_row": round(nbytes / ms[1] / 1e6, 1),
                         "ms": {m: round(v, 2) for m, v in ms.items()},
                         "over_1_row": {m: round(v / ms[1], 3) for m, v in ms.items()}}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
