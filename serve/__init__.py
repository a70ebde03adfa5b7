"""Serving: an OpenAI-compatible HTTP server over a compiled artifact (`python -m serve ARTIFACT`).

`scheduler` advances every in-flight request in shared calls (continuous batching, a prefix cache,
speculation per request: the runtime's engine step), `app` is the FastAPI server and
`ray_serve` its replicas on Ray Serve. It imports the runtime (the decoding methods); the runtime
never imports it.
"""
