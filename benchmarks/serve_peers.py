"""Our server against llama.cpp's OpenAI-compatible server on the same model: closed-loop clients and
Poisson arrivals, chat requests, side by side in one run.

    python -m benchmarks.serve_peers --artifact DIR --gguf FILE [--clients 1,8] [--rates 0.5,1,2]
                                     [--requests 64] [--max-tokens 64] [--threads 2] [--seed 0]
                                     [--no-prefix-cache]

Starts `python -m serve DIR` and `python -m llama_cpp.server --model FILE` (llama-cpp-python[server],
a benchmark-only extra: `pip install -e ".[peers]"`), one after the other, on loopback. For each: the
questions once, one at a time (each one's text alone), then `--requests` requests from C closed-loop
clients for each C in `--clients` (each client sends its share one after another), then `--requests`
requests arriving as a Poisson process at each rate in `--rates` (seeded: both servers get the same
arrival times). Every request is a streamed greedy chat completion of `--max-tokens` tokens. Prints
per workload: requests/s and output tokens/s (over the wall time from the first arrival to the last
answer; tokens counted as streamed content chunks, one per token on both servers), TTFT and time
per output token p50 / p99, and how many answers equal the same question's answer alone. The 16
questions repeat across workloads, so with our prefix cache on (the default) a repeated question
finds its whole prompt cached; `--no-prefix-cache` compares prefill against prefill.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from benchmarks.serve_load import chat_turn, free_port, serve, wait_ready

QUESTIONS = ["What is a Python list?", "How do I read a file in Python?", "What is a dictionary?",
             "Name three primary colors.", "What is the capital of Italy?", "How many days are in a week?",
             "What is 12 times 12?", "Give two tips for writing clean code.", "What does HTTP stand for?",
             "What is a unit test?", "Why is the sky blue?", "What is the boiling point of water?",
             "How do I reverse a string in Python?", "What is recursion?", "Name a prime number above 50.",
             "What is the largest planet?"]


def serve_llama_cpp(gguf: str, threads: int) -> tuple[subprocess.Popen, str]:
    """llama-cpp-python's OpenAI-compatible server on `gguf`, in its own process. It runs one request at a
    time; by default a new request interrupts the running one (its answer cut short), so that is off."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--port", str(port),
                             "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "2048",
                             "--interrupt_requests", "False"],
                            stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    return proc, wait_ready(proc, f"http://127.0.0.1:{port}", "/v1/models")


def ask(url: str, question: str, max_tokens: int) -> dict:
    """One streamed greedy chat completion of `question` (benchmarks.serve_load.chat_turn)."""
    return chat_turn(url, [{"role": "user", "content": question}], max_tokens, usage=False) | {"question": question}


def closed_loop(url: str, clients: int, requests: int, max_tokens: int) -> tuple[list[dict], float]:
    jobs = [QUESTIONS[i % len(QUESTIONS)] for i in range(requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda q: ask(url, q, max_tokens), jobs))
    return results, time.perf_counter() - start


def poisson(url: str, rate: float, requests: int, max_tokens: int, seed: int) -> tuple[list[dict], float]:
    """`requests` requests whose gaps are exponential with mean 1/rate (seeded), each on its own thread."""
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, requests))
    start = time.perf_counter()

    def arrive(i: int) -> dict:
        time.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        return ask(url, QUESTIONS[i % len(QUESTIONS)], max_tokens)

    with ThreadPoolExecutor(requests) as pool:
        results = list(pool.map(arrive, range(requests)))
    return results, time.perf_counter() - start - arrivals[0]


def row(server: str, workload: str, results: list[dict], wall: float, alone: dict[str, str]) -> str:
    ttft = np.array([r["ttft"] for r in results]) * 1e3
    tpot = np.array([(r["total"] - r["ttft"]) / max(r["tokens"] - 1, 1) for r in results]) * 1e3
    tokens = sum(r["tokens"] for r in results)
    same = sum(alone[r["question"]] == r["text"] for r in results)
    return (f"| {server} | {workload} | {len(results) / wall:.2f} | {tokens / wall:.1f} | "
            f"{np.percentile(ttft, 50):.0f} / {np.percentile(ttft, 99):.0f} | "
            f"{np.percentile(tpot, 50):.1f} / {np.percentile(tpot, 99):.1f} | {same}/{len(results)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", required=True, help="our artifact of the model (e.g. the default recipe's)")
    ap.add_argument("--gguf", required=True, help="the same model's GGUF file, for llama.cpp")
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--rates", default="0.5,1,2", help="Poisson arrival rates, requests per second ('' for none)")
    ap.add_argument("--servers", default="mxspd,llama.cpp", help="which servers to run, in order")
    ap.add_argument("--requests", type=int, default=64,
                    help="per workload (default 64: with 16, 8 clients ran ~1 s, and its ratio to 1 client swung "
                         "2.8-3.4x run to run)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="threads per call on both servers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-prefix-cache", action="store_true", help="our server without its prefix cache")
    args = ap.parse_args()
    ours = ["--threads", str(args.threads)] + (["--no-prefix-cache"] if args.no_prefix_cache else [])
    print("| server | workload | req/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | same as alone |")
    print("|---|---|---|---|---|---|---|")
    for server in args.servers.split(","):
        proc, url = (serve(args.artifact, ours) if server == "mxspd"
                     else serve_llama_cpp(args.gguf, args.threads))
        try:
            alone = {q: ask(url, q, args.max_tokens)["text"] for q in QUESTIONS}  # warms up too
            for clients in map(int, args.clients.split(",")):
                results, wall = closed_loop(url, clients, args.requests, args.max_tokens)
                print(row(server, f"{clients} clients", results, wall, alone), flush=True)
            for rate in (map(float, args.rates.split(",")) if args.rates else ()):
                results, wall = poisson(url, rate, args.requests, args.max_tokens, args.seed)
                print(row(server, f"Poisson {rate:g}/s", results, wall, alone), flush=True)
        finally:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
