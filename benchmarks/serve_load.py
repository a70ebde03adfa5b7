"""Concurrent clients against the OpenAI-compatible server, on loopback: throughput and latency.

    python -m benchmarks.serve_load [--models default-fp32,220m] [--clients 1,4,8] [--requests 4]
                                    [--max-tokens 32] [--rounds 3] [--threads N] [--mixed 200]
                                    [--artifact DIR] [--speculation none|draft|prompt_lookup]
    python -m benchmarks.serve_load --chat --artifact DIR [--turns 4] [--rounds 3] [--max-tokens 24]

Starts `python -m serve` in its own process (a free loopback port) for each TLM-only artifact of
benchmarks.multidecode (built once, cached), then for each client count C runs C threads that each
send `--requests` greedy streaming completions one after another (bounded: C x requests in all).
The client counts alternate for `--rounds` rounds (the machine is shared and noisy: a slow spell
then hits every count). Prints the median round's aggregate tokens/s (completion tokens, from the
stream's usage chunk, over wall time), its ratio to one client's, p50/p99 time to first token and
per-token latency, and how many outputs equal the same prompt's output run alone before the timed runs.

`--chat`: multi-turn chat with the prefix cache on and off (two servers, one after the other): a
conversation of `--turns` turns after a shared 222-token system prompt (SmolLM2's tokenizer;
sized for the default recipe's former 384-token prompts), each turn resending the
whole conversation (as chat clients do), `--rounds` conversations with different questions. Prints
each turn's median TTFT with the cache on and off, their ratio, and whether every answer is equal.
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, base: str, probe: str = "/health", timeout_s: float = 120) -> str:
    """Wait for a server process to answer `probe`; its completions URL."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{base}{probe}").status_code == 200:
                return f"{base}/v1/completions"
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not start (exit code {proc.poll()})")


def serve(art_dir: str, extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """`python -m serve` in its own process (clients here must not share its GIL)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "serve", art_dir, "--port", str(port),
                             "--model-name", "bench", *extra], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    return proc, wait_ready(proc, f"http://127.0.0.1:{port}")


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


SYSTEM = ("You are a careful, friendly assistant for a small software team. " + " ".join(
    f"Rule {i}: {rule}." for i, rule in enumerate([
        "answer in plain English and keep every answer short", "say so when you are not sure of a fact",
        "prefer simple, readable code over clever code", "name the standard library module you would use",
        "never invent function names or command line flags", "explain an error message before fixing it",
        "when asked for a command, give exactly one command", "use metric units and ISO dates",
        "do not repeat the question back to the user", "give one example when a concept is new",
        "ask one short question back when a request is unclear", "write Python that runs on version 3.11",
        "suggest a test for every function you write", "end with the single most useful next step",
    ], 1)) + " These rules hold for the whole conversation, whatever the user asks later.")
QUESTIONS = [["What is a Python list?", "How do I sort one?", "And in reverse order?", "What does it cost?"],
             ["What is a dictionary?", "How do I loop over one?", "How do I merge two?", "Which is faster?"],
             ["What is a unit test?", "Which module runs them?", "How do I skip one?", "Why would I?"]]


def chat_turn(url: str, messages: list[dict], max_tokens: int, usage: bool = True) -> dict:
    """One streamed greedy chat completion: its text, TTFT, total seconds, streamed tokens (content
    chunks) and, with `usage` (mxspd's server), the prompt tokens found in the prefix cache."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body |= {"stream_options": {"include_usage": True}} if usage else {}
    where = urlsplit(url.replace("/completions", "/chat/completions"))
    start, first, text, tokens, cached = time.perf_counter(), None, "", 0, 0
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=600)
    try:
        conn.request("POST", where.path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read().decode()}")
        while line := r.readline():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and (piece := chunk["choices"][0]["delta"].get("content")):
                first = first or time.perf_counter()
                text, tokens = text + piece, tokens + 1
            elif not chunk["choices"]:
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    finally:
        conn.close()
    end = time.perf_counter()
    return dict(text=text, ttft=(first or end) - start, total=end - start, tokens=tokens, cached=cached)


def chat(path: str, extra: list[str], turns: int, rounds: int, max_tokens: int) -> None:
    """Multi-turn conversations with the prefix cache on, then off; TTFT per turn and equal answers."""
    ttft: dict[bool, list[list[float]]] = {}
    answers: dict[bool, list[str]] = {}
    cached: dict[bool, list[int]] = {}
    for on in (True, False):
        server, url = serve(path, extra + ([] if on else ["--no-prefix-cache"]))
        try:
            chat_turn(url, [{"role": "user", "content": "Hello."}], 4)  # warm-up, shares nothing but the template
            ttft[on], answers[on], cached[on] = [[] for _ in range(turns)], [], []
            for r in range(rounds):
                messages = [{"role": "system", "content": SYSTEM}]
                for t in range(turns):
                    messages.append({"role": "user", "content": QUESTIONS[r % len(QUESTIONS)][t % 4]})
                    answer = chat_turn(url, messages, max_tokens)
                    messages.append({"role": "assistant", "content": answer["text"]})
                    ttft[on][t].append(answer["ttft"])
                    answers[on].append(answer["text"])
                    cached[on].append(answer["cached"])
        finally:
            server.terminate()
            server.wait()
    print("| turn | TTFT cache on ms (median) | cache off ms | off / on | prompt tokens cached (on) |")
    print("|---|---|---|---|---|")
    for t in range(turns):
        on, off = np.median(ttft[True][t]) * 1e3, np.median(ttft[False][t]) * 1e3
        hits = [cached[True][r * turns + t] for r in range(rounds)]
        print(f"| {t + 1} | {on:.0f} | {off:.0f} | {off / on:.1f}x | {hits} |")
    same = sum(a == b for a, b in zip(answers[True], answers[False], strict=True))
    print(f"answers equal with the cache on and off: {same}/{len(answers[True])}; cached tokens with it off: "
          f"{sum(cached[False])}")


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
    ap.add_argument("--chat", action="store_true", help="multi-turn chat, prefix cache on and off (needs --artifact)")
    ap.add_argument("--turns", type=int, default=4, help="--chat: turns per conversation (default 4)")
    args = ap.parse_args()
    extra = (["--threads", str(args.threads)] if args.threads else []) + ["--speculation", args.speculation]
    if args.chat:
        if not args.artifact:
            ap.error("--chat needs --artifact (a chat model's artifact, e.g. the default recipe's)")
        chat(args.artifact, extra, args.turns, args.rounds, args.max_tokens)
        return
    print("| TLM | clients | tok/s | vs 1 client | TTFT p50 / p99 ms | per-token p50 / p99 ms | same as 1 client |")
    print("|---|---|---|---|---|---|---|")
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
