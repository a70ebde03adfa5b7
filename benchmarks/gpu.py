"""Artifacts built for the GPU target (ort-cuda), decoding with and without CUDA graphs, side by side.

    python -m benchmarks.gpu ARTIFACT [ARTIFACT ...] [--prompt P] [--new-tokens 128] [--rounds 2]
                             [--genai fp16,int4 --gguf FILE]

Each artifact is loaded twice, with each fixed-shape graph replayed as a CUDA graph and with every
kernel launched, and greedy autoregressive generations of the same prompt alternate between the
two, `rounds` times. Per run: decode tokens/s; per generated token (the prompt's prefill spread
over them), the time inside model calls (inputs in and tokens or logits out included) and the rest,
the host's overhead (sampling, masks, committing KV). Checks that both give the same tokens, that
greedy speculation (the recipe's method) gives what greedy autoregressive decoding gives, and that the
greedy tokens the graphs compute on the device (`device_argmax`; greedy decoding brings no logits to
the host) are numpy's argmax of the same call's logits; prints
the floor (the decode call's weight bytes over the GPU's read bandwidth,
benchmarks.bandwidth.gpu_read_bandwidth_gbs) and where ONNX Runtime placed each op of the decode
graph (from its profile: a CPU-placed MatMulNBits would be a silent fallback), and what a call
costs by what ran before it (`call_pattern`: a decode call after a decode call or after a scoring
call, a scoring call, a commit; speculation alternates them). `--genai` adds
onnxruntime-genai's CUDA builds of the same GGUF (onnxruntime-genai-cuda,
benchmarks.peers.Genai), timed in the same rounds on the same prompt token ids, and each of
our artifacts' CUDA-graph speed over theirs.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnxruntime as ort

import runtime
from benchmarks.bandwidth import gpu_name, gpu_read_bandwidth_gbs, weight_bytes_per_call
from benchmarks.chain import Chain
from benchmarks.mx_decode import LONG_ANSWER
from benchmarks.peers import Genai
from common import graph_io
from common.manifest import read_manifest
from common.targets import compiled_session_options, get_target
from compiler.costs import visible_slots
from runtime.request import encode_prompt


def call_inputs(dims: graph_io.ModelDims, tokens: int, context: int, device: str) -> dict[str, ort.OrtValue]:
    """A call's inputs on `device`, as the compiler times it (compiler/costs.py: a short visible prefix)."""
    shapes = graph_io.input_shapes(dims, 1, tokens, context)
    visible = visible_slots(context, tokens)
    mask = np.zeros(shapes[graph_io.ATTENTION_MASK], dtype=bool)
    mask[:, :, :context] = visible
    mask[:, :, context:] = np.tri(tokens, dtype=bool)
    feeds = {graph_io.INPUT_IDS: np.zeros(shapes[graph_io.INPUT_IDS], np.int64),
             graph_io.POSITION_IDS: np.arange(tokens, dtype=np.int64)[None] + visible.sum(),
             graph_io.ATTENTION_MASK: mask}
    kv = ort.OrtValue.ortvalue_from_numpy(np.zeros(shapes[graph_io.past_key(0)], dims.kv_dtype), device, 0)
    return {k: ort.OrtValue.ortvalue_from_numpy(v, device, 0) for k, v in feeds.items()} | {
        name: kv for name in graph_io.input_names(dims)[3:]}


def placement(artifact: Path, graph: str = graph_io.DECODE) -> dict[str, dict[str, int]]:
    """{provider: {op type: nodes run}} for one call of the TLM's `graph`, read from ORT's profile."""
    manifest = read_manifest(artifact, verify=False)
    entry = manifest.models["tlm"]
    target = get_target(manifest.target)
    so = compiled_session_options(target)
    so.enable_profiling = True
    so.profile_file_prefix = f"/tmp/mxspd-placement-{artifact.name}"
    session = ort.InferenceSession(str(artifact / entry.graphs[graph].file), so, providers=target.providers())
    session.run_with_ort_values([graph_io.LOGITS], call_inputs(entry.dims, entry.graphs[graph].tokens,
                                                               manifest.capacity, target.device))
    counts: dict[str, Counter] = {}
    for event in json.loads(Path(session.end_profiling()).read_text()):
        args = event.get("args", {})
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            counts.setdefault(args.get("provider", "?"), Counter())[args.get("op_name", "?")] += 1
    return {p: dict(c) for p, c in counts.items()}


def call_pattern(art, prompt: list[int], repeats: int = 50) -> dict[str, float]:
    """Median ms of a decode call after a decode call, of a scoring call (the graph for 5 rows) after a
    decode call, of a decode call right after a scoring call, and of committing 1 and 3 rows, all on the
    same cached prompt; as in generation each call is followed by its commit (rewound after), so "after a
    decode call" means after a decode call and its commit. Shows whether alternating graphs, or the
    commits, cost what the calls alone do not (with CUDA graphs they do not: docs/benchmarks-history.md)."""
    runner = Chain(art.tlm)
    runner.start(np.asarray(prompt))
    length, decode, score = runner.length, graph_io.DECODE, art.tlm.graph_for(5)
    one_token, five = np.asarray(prompt[-1:]), np.asarray(prompt[-5:])
    times: dict[str, list[float]] = {}

    def timed(key: str, call) -> None:
        t0 = time.perf_counter()
        call()
        times.setdefault(key, []).append(1e3 * (time.perf_counter() - t0))

    for _ in range(repeats):
        timed("decode_after_decode", lambda: runner.run(decode, one_token))
        timed("commit_1", lambda: runner.commit([0]))
        runner.rewind(length)
    for _ in range(repeats):
        timed(f"{score}_after_decode", lambda: runner.run(score, five))
        timed("commit_3", lambda: runner.commit([0, 1, 2]))
        runner.rewind(length)
        timed(f"decode_after_{score}", lambda: runner.run(decode, one_token))
        runner.commit([0])
        runner.rewind(length)
    return {k: round(float(np.median(v)), 3) for k, v in times.items()}


def greedy_outputs_check(art, prompt: list[int]) -> dict:
    """Whether the greedy tokens the graphs compute on the device (compiler/greedy_outputs.py; greedy decoding
    reads only those) are numpy's argmax of the same call's logits, over a prefill call's rows."""
    if not art.tlm.greedy_outputs:
        return {"greedy_outputs": False}
    graph, n = art.tlm.plan(len(prompt))[0]
    logits = Chain(art.tlm).run(graph, np.asarray(prompt[:n]))
    equal = art.tlm.argmax() == np.argmax(logits, axis=-1)
    return {"greedy_outputs": True, "rows": n, "argmax_equal_rows": int(equal.sum())}


def one(art, prompt: list[int], new_tokens: int) -> dict:
    runner = art.tlm
    runner.forget()  # cold: the prompt would otherwise be found in the cache
    before = runner.call_s
    r = runtime.generate(art, prompt, max_new_tokens=new_tokens, speculative=False)
    m, inside = r.metrics, runner.call_s - before
    runner.forget()
    spd = runtime.generate(art, prompt, max_new_tokens=new_tokens, speculative=True)
    return {"spd_equals_ar": spd.token_ids == r.token_ids, "decode_tokens_per_s": round(m.decode_tokens_per_s, 1),
            "ttft_ms": round(1e3 * m.ttft_s, 2),
            "call_ms_per_token": round(1e3 * inside / m.new_tokens, 3),
            "host_ms_per_token": round(1e3 * (m.total_s - inside) / m.new_tokens, 3),
            "tokens": r.token_ids, "text": r.text}


def measure(paths: list[Path], text: str, new_tokens: int, rounds: int, genai: dict | None = None) -> dict:
    arts, failed, genai = {}, {}, genai or {}
    prompt: list[int] = []  # chat-templated ids, the same for every system
    for p in paths:
        for graph in (True, False):
            try:
                arts[str(p), graph] = art = runtime.load_artifact(p, cuda_graph=graph)
                prompt = prompt or encode_prompt(art, text)
                one(art, prompt, 8)  # warm-up (a thread's first call captures the CUDA graphs)
            except Exception as exc:  # noqa: BLE001 - reported: a graph ONNX Runtime cannot capture, say
                arts.pop((str(p), graph), None)
                failed[str(p), graph] = f"{type(exc).__name__}: {exc}"
    runs: dict = {key: [] for key in arts}
    theirs: dict[str, list] = {name: [] for name in genai}
    for model in genai.values():
        model.generate(prompt, 8)  # warm-up
    for _ in range(rounds):
        for key, art in arts.items():
            runs[key].append(one(art, prompt, new_tokens))
        for name, model in genai.items():
            theirs[name].append(model.generate(prompt, new_tokens))
    bandwidth = gpu_read_bandwidth_gbs()
    out = {"gpu": gpu_name(), "read_bandwidth_GB_per_s": round(bandwidth, 1), "artifacts": {}}
    for p in paths:
        weights = weight_bytes_per_call(p, "tlm")
        pattern = {}
        for graph in (True, False):
            if (str(p), graph) in arts:
                try:
                    pattern["cuda_graph" if graph else "launches"] = call_pattern(arts[str(p), graph], prompt)
                except Exception as exc:  # noqa: BLE001 - reported; the decode measurements still stand
                    pattern["cuda_graph" if graph else "launches"] = f"{type(exc).__name__}: {exc}"
        floor = bandwidth * 1e9 / weights
        rows = {("cuda_graph" if graph else "launches"): failed.get((str(p), graph)) or [
            {k: v for k, v in r.items() if k != "tokens"} for r in runs[str(p), graph]] for graph in (True, False)}
        done = [r["tokens"] for g in (True, False) for r in runs.get((str(p), g), [])]
        same = bool(done) and all(t == done[0] for t in done)
        checked = next((greedy_outputs_check(arts[str(p), g], prompt) for g in (True, False) if (str(p), g) in arts),
                       {})
        out["artifacts"][str(p)] = {"weights_read_per_token_MB": round(weights / 1e6, 2),
                                    "floor_tokens_per_s": round(floor), "same_tokens": same,
                                    "device_argmax": checked, "placement": placement(p), "call_pattern_ms": pattern,
                                    **rows}
    ours = {p: float(np.median([r["decode_tokens_per_s"] for r in runs.get((p, True), [])] or [np.nan]))
            for p in map(str, paths)}
    for name, model in genai.items():
        speed = [round(tps, 1) for _, tps, _ in theirs[name]]
        out["genai"] = out.get("genai", {}) | {name: {
            "decode_tokens_per_s": speed, "weights_MB": round(model.weight_bytes() / 1e6, 1),
            "ours_cuda_graph_over_theirs": {p: round(v / float(np.median(speed)), 3) for p, v in ours.items()},
            "same_tokens_as_ours": {p: [int(t) for t in theirs[name][0][2]] == runs[p, True][0]["tokens"]
                                    for p in map(str, paths) if runs.get((p, True))}}}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifacts", type=Path, nargs="+")
    ap.add_argument("--prompt", default=LONG_ANSWER)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--genai", default="", help="onnxruntime-genai CUDA builds to time beside ours (fp16, int4)")
    ap.add_argument("--gguf", type=Path, help="the GGUF the artifacts were built from (for --genai)")
    args = ap.parse_args(argv)
    if args.genai and not args.gguf:
        ap.error("--genai needs --gguf")
    genai, broken = {}, {}
    for precision in filter(None, args.genai.split(",")):
        try:
            genai[precision] = Genai(args.gguf, precision, 1, provider="cuda")
        except Exception as exc:  # noqa: BLE001 - reported beside our measurements, which still run
            broken[precision] = f"{type(exc).__name__}: {exc}"
    result = measure(args.artifacts, args.prompt, args.new_tokens, args.rounds, genai) | {"genai_failed": broken}
    print(json.dumps(result, indent=2))
    return 0 if all(a["same_tokens"] for a in result["artifacts"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
