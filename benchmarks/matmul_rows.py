"""What one more row costs ONNX Runtime's CPU kernels: the floor under a scoring call's price.

    python -m benchmarks.matmul_rows [--layers 24] [--repeats 10] [--kinds "mxfp6 native,mxint8 native"]
                                     [--columns 8192] [--depth 1024] [--rows 1,2,3,5,9] [--threads N]
                                     [--baseline OTHER.so]

A K+1-token scoring call reads the same weights as a decode step, so at the bandwidth floor it
would cost one step. This times the kernels alone, on a stack of 1024 x 8192 weights as large as the
220M checkpoint's (24 layers: 805 MB in float32), for M = 1..9 rows: float32 MatMul (MLAS SGEMM,
weights prepacked by the session), mxspd's RowMatMul (`float32 row`: the batch-invariant float32 op
that compiled float32 graphs run, kernels/row_matmul.cc) and the fused MXFP6 kernel (MatMulNBits bits=8, block 32,
accuracy_level 4, as compiler/mx_lowering.py emits it) and mxspd's own MXMatMul (kernels/mx_matmul.cc:
MXFP6 with int16 or int8 activations, MXINT8, MXFP4 with int8 activations). Whatever a whole graph adds
on top (attention, per-row elementwise ops) comes on top of these ratios.

`--baseline OTHER.so` (another build of mxspd's kernel library) times the library's kinds with both
libraries in one process, alternated call batch by call batch, checks that they give the same bits,
and prints baseline / installed: on a noisy shared box, a fairer comparison than two runs. A small
stack (`--layers 16 --columns 512 --threads 1`: 6 MB of MXFP6, within the L3 cache) times the kernels'
arithmetic rather than memory. `--rows 16,64,128` times calls of many rows (prefill, a server's batched
step), where the arithmetic sets the pace; `--depth 4096 --columns 11008` (K and N) gives the stack
Llama-2-7B's MLP shape. G_MACs_per_s against benchmarks.issue_rate's multiply-adds/s is the many-row
path's fraction of the CPU's compute peak.
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

from common.targets import session_options, spin_within_calls
from compiler.mx_lowering import ACCURACY_LEVEL, BLOCK
from kernels import DOMAIN, MX_MATMUL, ROW_MATMUL, preferred_mx_layout, require_library
from kernels.layout import (
    BLOCK_BYTES,
    GROUP,
    PLANES8,
    TRIPLES,
    pack_columns,
    pack_fp4_columns,
    pack_int8_columns,
    pack_panels,
)

K, N = 1024, 8192
ROWS = "1,2,3,5,9"
KINDS = ("float32", "float32 row", "mxfp6 fused", "mxfp6 native", "mxfp6 native8", "mxint8 native", "mxint8 native8",
         "mxfp4 native")
# The MX kinds of mxspd's kernel library: (weight bits, activation bits).
NATIVE = {"mxfp6 native": (6, 16), "mxfp6 native8": (6, 8), "mxint8 native": (8, 16), "mxint8 native8": (8, 8),
          "mxfp4 native": (4, 8)}
LIBRARY_KINDS = {*NATIVE, "float32 row"}  # run by mxspd's kernel library (RowMatMul: the float32 graphs' op)


def stack(kind: str, layers: int, n: int = N, layout: int = TRIPLES, k: int = K) -> tuple[onnx.ModelProto, int]:
    """`layers` independent k x n weights, each multiplied by the input, the same for any MXFP6 `layout`;
    returns the model and its weight bytes."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    for i in range(layers):
        if kind == "float32":
            inits.append(numpy_helper.from_array((rng.standard_normal((k, n)) * 0.02).astype(np.float32), f"w{i}"))
            nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]))
        elif kind == "float32 row":
            w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
            inits.append(numpy_helper.from_array(pack_panels(w), f"w{i}"))
            nodes.append(helper.make_node(ROW_MATMUL, ["x", f"w{i}"], [f"y{i}"], domain=DOMAIN, N=n))
        elif kind in NATIVE:
            wbits, abits = NATIVE[kind]
            codes = (pack_columns(rng.integers(0, 64, size=(k, n), dtype=np.uint8), layout) if wbits == 6
                     else pack_fp4_columns(rng.integers(0, 16, size=(k, n), dtype=np.uint8)) if wbits == 4
                     else pack_int8_columns(rng.integers(-127, 128, size=(k, n), dtype=np.int8)))
            exps = rng.integers(115, 125, size=(n // GROUP, k // BLOCK, GROUP), dtype=np.uint8)
            inits += [numpy_helper.from_array(codes, f"q{i}"), numpy_helper.from_array(exps, f"s{i}")]
            nodes.append(helper.make_node(MX_MATMUL, ["x", f"q{i}", f"s{i}"], [f"y{i}"], domain=DOMAIN, K=k, N=n,
                                          activation_bits=abits, weight_bits=wbits,
                                          **({"layout": layout} if wbits == 6 else
                                             {"layout": PLANES8} if wbits == 4 else {})))
        else:
            codes = rng.integers(0, 256, size=(n, k // BLOCK, BLOCK), dtype=np.uint8)
            scales = (rng.random((n, k // BLOCK)) * 0.01 + 0.001).astype(np.float32)
            inits += [numpy_helper.from_array(codes, f"q{i}"), numpy_helper.from_array(scales, f"s{i}")]
            nodes.append(helper.make_node("MatMulNBits", ["x", f"q{i}", f"s{i}"], [f"y{i}"], domain="com.microsoft",
                                          K=k, N=n, bits=8, block_size=BLOCK, accuracy_level=ACCURACY_LEVEL))
    outputs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(layers)]
    graph = helper.make_graph(nodes, kind, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              outputs, inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1), helper.make_opsetid(DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    if kind in NATIVE:
        per_weight = (k // BLOCK) * (n // GROUP) * (BLOCK_BYTES[NATIVE[kind][0]] + GROUP)
    else:
        per_weight = k * n * 4 if kind.startswith("float32") else k * n + (k // BLOCK) * n * 4
    return model, layers * per_weight


def _session(path: Path, threads: int | None, library: Path | None, kind: str) -> ort.InferenceSession:
    """A session whose pool stops spinning when its call returns, so that alternated sessions do not slow
    each other; a baseline library that cannot run `kind` (older than its op) is named, not a raw error."""
    try:
        return ort.InferenceSession(str(path), spin_within_calls(session_options(threads, library)),
                                    providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types, none shared with Python's
        if library is None:
            raise
        raise SystemExit(f"--baseline {library}: cannot run kind {kind!r} (a library older than its op?): {e}") from e


def _time(session: ort.InferenceSession, x: np.ndarray, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        session.run(None, {"x": x})
    return (time.perf_counter() - t0) / calls


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--columns", type=int, default=N, help="N of each weight (a multiple of 16)")
    ap.add_argument("--depth", type=int, default=K, help="K of each weight (a multiple of 32)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, help="intra-op threads (default: every core)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--rows", default=ROWS, help="comma-separated rows per call (M); the first is the reference")
    ap.add_argument("--baseline", type=Path, help="another build of the kernel library, for its kinds")
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - set(KINDS):
        ap.error(f"unknown kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    try:
        rows = [int(m) for m in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    if min(rows) < 1:
        ap.error("--rows must be positive")
    if args.columns <= 0 or args.columns % GROUP:
        ap.error(f"--columns must be a positive multiple of {GROUP}")
    if args.depth <= 0 or args.depth % BLOCK:
        ap.error(f"--depth must be a positive multiple of {BLOCK}")
    if args.baseline is not None and not args.baseline.is_file():
        ap.error(f"--baseline {args.baseline}: no such file")
    if set(kinds) & LIBRARY_KINDS:
        require_library()
    rng = np.random.default_rng(0)
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}  # kind -> ({library name: session}, weight bytes)
        for kind in kinds:
            other = args.baseline and kind in LIBRARY_KINDS
            libraries = {"installed": None} | ({"baseline": args.baseline} if other else {})
            sessions = {}
            for name, lib in libraries.items():  # each library's weights in the MXFP6 layout it prefers
                layout = preferred_mx_layout(lib, NATIVE[kind][1]) if kind in NATIVE else TRIPLES
                model, nbytes = stack(kind, args.layers, args.columns, layout, args.depth)
                path = Path(tmp) / f"{kind.replace(' ', '_')}_{name}.onnx"
                onnx.save(model, path, save_as_external_data=True, location=path.stem + ".bin")
                sessions[name] = _session(path, args.threads, lib, kind)
            runs[kind] = (sessions, nbytes)
        for kind, (sessions, nbytes) in runs.items():
            ms: dict[str, dict[int, float]] = {name: {} for name in sessions}
            calls = max(1, int(2e8 / nbytes))  # per timing: enough to dwarf a call's own overhead
            for m in rows:
                x = rng.standard_normal((m, args.depth)).astype(np.float32)
                outs = {name: s.run(None, {"x": x}) for name, s in sessions.items()}  # warm-up, and the values
                if "baseline" in outs and any(not np.array_equal(a, b, equal_nan=True)
                                              for a, b in zip(outs["installed"], outs["baseline"], strict=True)):
                    raise SystemExit(f"{kind}, {m} rows: the baseline library gives other values")
                for s in sessions.values():
                    _time(s, x, 2)
                times: dict[str, list[float]] = {name: [] for name in sessions}
                for _ in range(args.repeats):
                    for name, s in sessions.items():
                        times[name].append(_time(s, x, calls))
                for name, t in times.items():
                    ms[name][m] = float(np.median(t) * 1e3)
            mine = ms["installed"]
            first = rows[0]
            out[kind] = {"weights_mb": round(nbytes / 1e6, 1),
                         f"GB_per_s_at_{first}_rows": round(nbytes / mine[first] / 1e6, 1),
                         f"G_MACs_per_s_at_{rows[-1]}_rows": round(args.layers * args.depth * args.columns * rows[-1]
                                                                   / mine[rows[-1]] / 1e6, 1),
                         "ms": {m: round(v, 3) for m, v in mine.items()},
                         f"over_{first}_rows": {m: round(v / mine[first], 3) for m, v in mine.items()}}
            if "baseline" in ms:
                out[kind]["baseline_ms"] = {m: round(v, 3) for m, v in ms["baseline"].items()}
                out[kind]["speedup_over_baseline"] = {m: round(ms["baseline"][m] / v, 3) for m, v in mine.items()}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
