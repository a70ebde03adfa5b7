"""The server as a Ray Serve deployment: two replicas on a local Ray instance, checked with the openai client."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray
from ray import serve

import runtime
from common.manifest import ArtifactError
from serve.ray_serve import application

PROMPTS = [[0, 5, 6, 7], [0, *range(40, 60)], [0, 9], [0, 77, 78]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_server(artifact_dir):
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(artifact_dir, replicas=2, name="tiny", threads=1), name="mxspd", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_serve_the_openai_routes(ray_server, artifact_dir):
    from openai import BadRequestError, OpenAI

    replicas = serve.status().applications["mxspd"].deployments["mxspd"].replica_states
    assert replicas == {"RUNNING": 2}
    reference = runtime.load_artifact(artifact_dir)
    client = OpenAI(base_url=f"{ray_server}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]

    def greedy(prompt):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # spread over both replicas by Ray's proxy
        responses = list(pool.map(greedy, PROMPTS))
    for prompt, r in zip(PROMPTS, responses, strict=True):
        want = runtime.generate(reference, prompt, max_new_tokens=12, speculative=False)
        assert r.choices[0].text == want.text and r.usage.completion_tokens == len(want.token_ids)

    stream = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True)
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == responses[1].choices[0].text

    with pytest.raises(BadRequestError, match="unknown model"):
        client.completions.create(model="other", prompt=PROMPTS[0], max_tokens=2)
    assert httpx.get(f"{ray_server}/health").json() == {"status": "ok"}


def test_a_missing_artifact_is_refused_before_any_replica_starts(tmp_path):
    with pytest.raises(ArtifactError):
        application(tmp_path / "nothing")
    with pytest.raises(ValueError, match="replicas"):
        application(tmp_path, replicas=0)
