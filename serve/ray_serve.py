"""Scale-out on Ray Serve: the OpenAI-compatible app of serve/app.py as N replicas behind Ray's HTTP proxy.

`python -m serve.ray_serve ARTIFACT --replicas 2` starts (or joins, with --address) a Ray
instance and serves the same routes at http://HOST:PORT/v1/... Each replica is a Ray actor that
loads the artifact and runs its own scheduler (one continuous batch per replica); Ray's proxy
spreads requests over the replicas. Python: `serve.run(application(path, replicas=2))`.
Needs `pip install ".[ray]"`.
"""

from __future__ import annotations

import os
from pathlib import Path

from ray import serve

from common.manifest import read_manifest
from runtime.load import load_artifact
from serve.app import check_exposure, create_app, positive, server_arguments


@serve.ingress()
class OpenAIServer:
    """One replica: the artifact and its scheduler, built in the replica's own process."""

    def __init__(self, artifact: str, name: str | None, max_queue: int, speculation: str | None,
                 threads: int | None, api_key: str | None = None) -> None:
        self.settings = (artifact, name, max_queue, speculation, threads, api_key)

    def __serve_build_asgi_app__(self):  # Ray Serve calls it on the replica, after __init__
        artifact, name, max_queue, speculation, threads, api_key = self.settings
        return create_app(load_artifact(artifact, threads=threads), name, max_queue, speculation, api_key)


def application(artifact: str | os.PathLike, replicas: int = 1, name: str | None = None, max_queue: int = 64,
                speculation: str | None = None, cpus_per_replica: float = 1.0, threads: int | None = None,
                api_key: str | None = None) -> serve.Application:
    """The Serve application: `replicas` copies of the server, each reserving `cpus_per_replica` of
    Ray's CPUs and running ONNX Runtime on `threads` threads (default: ONNX Runtime's choice)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    read_manifest(Path(artifact), verify=False)  # a missing artifact fails here, not inside N actors
    deployment = serve.deployment(OpenAIServer, name="mxspd", num_replicas=replicas,
                                  ray_actor_options={"num_cpus": cpus_per_replica})
    return deployment.bind(str(os.path.abspath(artifact)), name, max_queue, speculation, threads, api_key)


def main(argv: list[str] | None = None) -> int:
    import ray

    p = server_arguments("python -m serve.ray_serve", __doc__, per=" per replica")
    p.add_argument("--replicas", type=positive, default=1)
    p.add_argument("--address", help="a running Ray cluster to join (default: start a local instance)")
    p.add_argument("--cpus-per-replica", type=float, default=1.0)
    args = p.parse_args(argv)
    check_exposure(args.host, args.api_key)
    try:
        app = application(args.artifact, args.replicas, args.model_name, args.max_queue,
                          None if args.speculation == "none" else args.speculation, args.cpus_per_replica,
                          args.threads, args.api_key)
    except (ValueError, OSError, RuntimeError) as exc:
        p.error(str(exc))
    ray.init(address=args.address)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(app, name="mxspd", route_prefix="/", blocking=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
