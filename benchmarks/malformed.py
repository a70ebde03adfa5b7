"""What malformed and hostile request bodies cost the server: status and server CPU per request.

    python -m benchmarks.malformed ARTIFACT

Serves ARTIFACT in this process (FastAPI's test client: no socket, so the CPU time measured is the
server's own) and sends a normal greedy chat request, then each body below, then the normal request
again. Prints each body's status and CPU seconds (time.process_time), the worst of them, and whether
the normal answer stayed the same. Targets (docs/serving.md): no 5xx, none over 1 s of CPU.
"""

from __future__ import annotations

import argparse
import json
import time

from fastapi.testclient import TestClient

import runtime
from serve.app import create_app

NORMAL = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 16, "temperature": 0}


def bodies() -> dict[str, bytes]:
    """Name -> raw body of each malformed or hostile request."""
    dump = json.dumps
    return {
        "20 MB prompt": dump({"prompt": "word " * (4 << 20)}).encode(),
        "1 MB prompt (under the body limit)": dump({"prompt": "word " * (200 << 10)}).encode(),
        "5,000-deep nesting": b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        "lone surrogate": dump({"messages": [{"role": "user", "content": "\ud800 hi"}]}).encode(),
        "invalid UTF-8": b'{"prompt": "\xff\xfe"}',
        "not JSON": b"{not json",
        "unknown role": dump({"messages": [{"role": "wizard", "content": "hi"}]}).encode(),
        "temperature 1e9": dump({"prompt": "x", "temperature": 1e9}).encode(),
        "image part": dump({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
        "n 10^6": dump({"prompt": "x", "n": 10**6}).encode(),
        "max_tokens 10^12": dump({"prompt": "x", "max_tokens": 10**12}).encode(),
        "path trick model": dump({"prompt": "x", "model": "../../etc/passwd"}).encode(),
        "10,000 messages": dump({"messages": [{"role": "user", "content": "hi"}] * 10000}).encode(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    args = ap.parse_args(argv)
    art = runtime.load_artifact(args.artifact)
    out: dict = {"requests": {}}
    with TestClient(create_app(art)) as client:
        before = client.post("/v1/chat/completions", json=NORMAL).json()["choices"][0]["message"]["content"]
        for name, body in bodies().items():
            route = "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"
            cpu = time.process_time()
            r = client.post(route, content=body, headers={"content-type": "application/json"})
            out["requests"][name] = {"status": r.status_code, "cpu_s": round(time.process_time() - cpu, 3),
                                     "message": r.json().get("error", {}).get("message", "")[:100]}
        after = client.post("/v1/chat/completions", json=NORMAL).json()["choices"][0]["message"]["content"]
    statuses = [r["status"] for r in out["requests"].values()]
    out |= {"server_errors": sum(s >= 500 for s in statuses),
            "worst_cpu_s": max(r["cpu_s"] for r in out["requests"].values()),
            "normal_answer_unchanged": before == after}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
