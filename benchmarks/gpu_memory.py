"""GPU memory one load of an ort-cuda artifact takes, with one device copy of each model's weights
shared by its graphs' sessions (the default) and with a copy per session (as before the compiler wrote
the initializer index), and that both decode the same greedy tokens.

    python -m benchmarks.gpu_memory ARTIFACT [--prompt P] [--new-tokens 32]

Memory is the drop in the GPU's free memory (torch.cuda.mem_get_info) from before the load to after a
generation (sessions, shared weights, KV cache, CUDA graphs and ONNX Runtime's arenas), beside the
artifact's weights files.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time
from pathlib import Path
from unittest import mock

import runtime
from common.manifest import read_manifest
from common.shared_weights import SharedWeights


def one_load(path: Path, prompt: str, new_tokens: int, shared: bool) -> dict:
    import torch

    free = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    with contextlib.nullcontext() if shared else mock.patch.object(SharedWeights, "available", return_value=None):
        art = runtime.load_artifact(path)
    load_s = time.perf_counter() - t0
    r = runtime.generate(art, prompt, max_new_tokens=new_tokens, speculative=False)
    taken = free - torch.cuda.mem_get_info()[0]
    held = sum(m.place.shared.nbytes for m in art.runners.values() if m.place.shared is not None)
    del art
    gc.collect()
    return {"gpu_memory_taken_gb": round(taken / 1e9, 2), "shared_weights_gb": round(held / 1e9, 2),
            "load_s": round(load_s, 1), "decode_tokens_per_s": round(r.metrics.decode_tokens_per_s, 1),
            "tokens": r.token_ids}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--prompt", default="What is the capital of France?")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    manifest = read_manifest(args.artifact, verify=False)
    weights = {role: round((args.artifact / m.weights).stat().st_size / 1e9, 2) for role, m in manifest.models.items()}
    graphs = {role: len(m.graphs) for role, m in manifest.models.items()}
    runs = {mode: one_load(args.artifact, args.prompt, args.new_tokens, mode == "shared")
            for mode in ("shared", "per_session")}
    same = runs["shared"].pop("tokens") == runs["per_session"].pop("tokens")
    print(json.dumps({"weights_file_gb": weights, "graphs": graphs, **runs, "same_tokens": same}, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
