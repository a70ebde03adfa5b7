"""Concurrent clients against the OpenAI-compatible server, on loopback: throughput and latency.

    python -m benchmarks.serve_load [--models default-fp32,220m] [--clients 1,4,8] [--requests 4]
                                    [--max-tokens 32] [--rounds 3] [--threads N] [--mixed 200]
                                    [--artifact DIR] [--speculation none|draft|prompt_lookup]

Starts `python -m runtime.serve` in its own process (a free loopback port) for each TLM-only artifact of
benchmarks.multidecode (built once, cached), then for each client count C runs C threads that each
send `--requests` greedy streaming completions one after another (bounded: C x requests in all).
The client counts alternate for `--rounds` rounds (the machine is shared and noisy: a slow spell
then hits every count). Prints the median round's aggregate tokens/s (completion tokens, from the
stream's usage chunk, over wall time), its ratio to one client's, p50/p99 time to first token and
per-token latency, and how many outputs equal the same prompt's output run alone before the timed runs.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np

from benchmarks.multidecode import artifacts

PROMPTS = ["def binary_search(items, target):\n", "class Stack:\n    def __init__(self):\n        self.",
           "import os\n\ndef list_python_files(root):\n", "def read_config(path):\n    with open(path) as f:\n",
           "def mean(values):\n", "class Counter:\n", "def parse_args(argv):\n", "def main():\n"]


def serve(art_dir: str, extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """`python -m runtime.serve` in its own process (clients here must not share its GIL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "runtime.serve", art_dir, "--port", str(port),
                             "--model-name", "bench", *extra], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return proc, f"{base}/v1/completions"
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start")


def one(url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion, read with the standard library's http.client: a lean client, so
    that on a 2-core machine the load generator takes little of the server's CPU (httpx's line
    iterator took ~0.8 ms of CPU per token, a whole core at 4 clients)."""
    start, first, text, tokens = time.perf_counter(), None, "", 0
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=600)
    try:
        conn.request("POST", where.path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        while line := r.readline():
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                first = first or time.perf_counter()
                text += chunk["choices"][0]["text"]
            else:
                tokens = chunk["usage"]["completion_tokens"]
    finally:
        conn.close()
    end = time.perf_counter()
    return dict(prompt=prompt, text=text, ttft=first - start, total=end - start, tokens=tokens)


def run(url: str, clients: int, requests: int, max_tokens: int) -> tuple[list[dict], float]:
    jobs = [PROMPTS[(c + i) % len(PROMPTS)] for c in range(clients) for i in range(requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: one(url, p, max_tokens), jobs))
    return results, time.perf_counter() - start


def mixed(url: str, total: int, clients: int, max_tokens: int, reference: dict[str, str]) -> dict:
    """`total` requests from `clients` threads mixing streaming, non-streaming, sampled, greedy,
    oversize and malformed ones: every greedy one must equal its output alone, every bad one get a 4xx."""
    bodies = [
        lambda p: {"prompt": p, "max_tokens": max_tokens, "temperature": 0},  # greedy, whole
        lambda p: {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "stream": True},  # greedy, streamed
        lambda p: {"prompt": p, "max_tokens": max_tokens, "temperature": 0.8, "top_k": 40, "seed": 1},  # sampled
        lambda p: {"prompt": p * 200, "max_tokens": max_tokens},  # oversize: 400
        lambda p: {"prompt": p, "max_tokens": "many"},  # malformed: 400
        lambda p: {"prompt": p, "temperature": -1},  # bad value: 400
    ]
    jobs = [(i % len(bodies), PROMPTS[i % len(PROMPTS)]) for i in range(total)]

    def send(job: tuple[int, str]) -> tuple[int, int, str, str]:
        kind, prompt = job
        body = bodies[kind](prompt)
        if body.get("stream"):
            with httpx.stream("POST", url, json=body, timeout=600) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            return kind, r.status_code, prompt, "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        r = httpx.post(url, json=body, timeout=600)
        return kind, r.status_code, prompt, r.json()["choices"][0]["text"] if r.status_code == 200 else ""

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(send, jobs))
    wall = time.perf_counter() - start
    greedy = [(p, t) for k, code, p, t in results if k in (0, 1)]
    return dict(requests=total, wall_s=wall, requests_per_s=total / wall,
                greedy_equal=sum(reference[p] == t for p, t in greedy), greedy=len(greedy),
                bad_got_400=sum(code == 400 for k, code, _, _ in results if k >= 3),
                bad=sum(k >= 3 for k, _, _, _ in results),
                sampled_ok=sum(code == 200 for k, code, _, _ in results if k == 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="default-fp32,220m")
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per client count; the median is shown")
    ap.add_argument("--artifact", help="serve this artifact instead of --models")
    ap.add_argument("--speculation", default="none", help="the server's --speculation (default none)")
    ap.add_argument("--threads", type=int, help="the server's --threads (ONNX Runtime threads per call)")
    ap.add_argument("--mixed", type=int, default=0, metavar="N",
                    help="then N mixed requests (good, sampled, oversize, malformed) from 8 clients")
    args = ap.parse_args()
    print("| TLM | clients | tok/s | vs 1 client | TTFT p50 / p99 ms | per-token p50 / p99 ms | same as 1 client |")
    print("|---|---|---|---|---|---|---|")
    extra = (["--threads", str(args.threads)] if args.threads else []) + ["--speculation", args.speculation]
    paths = {Path(args.artifact).name: args.artifact} if args.artifact else \
        {name: str(art.path) for name, (art, _) in artifacts(args.models.split(",")).items()}
    for name, path in paths.items():
        server, url = serve(path, extra)
        reference = {p: one(url, p, args.max_tokens)["text"] for p in PROMPTS}  # warms up, one at a time
        counts = list(map(int, args.clients.split(",")))
        rounds: dict[int, list] = {c: [] for c in counts}  # client counts alternate: a slow spell hits all
        for _ in range(args.rounds):
            for clients in counts:
                results, wall = run(url, clients, args.requests, args.max_tokens)
                rounds[clients].append((sum(r["tokens"] for r in results) / wall, results))
        single = None
        for clients in counts:
            rate, results = sorted(rounds[clients], key=lambda x: x[0])[len(rounds[clients]) // 2]  # the median
            single = single or rate
            ttft = np.array([r["ttft"] for r in results]) * 1e3
            per_token = np.array([(r["total"] - r["ttft"]) / max(r["tokens"] - 1, 1) for r in results]) * 1e3
            same = sum(reference[r["prompt"]] == r["text"] for r in results)
            print(f"| {name} | {clients} | {rate:.1f} | {rate / single:.2f}x | {np.percentile(ttft, 50):.0f} / "
                  f"{np.percentile(ttft, 99):.0f} | {np.percentile(per_token, 50):.1f} / "
                  f"{np.percentile(per_token, 99):.1f} | {same}/{len(results)} |", flush=True)
        if args.mixed:
            print(f"mixed load on {name}: {mixed(url, args.mixed, 8, args.max_tokens, reference)}", flush=True)
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
