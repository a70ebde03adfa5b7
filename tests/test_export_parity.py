"""Every exported graph matches transformers' own forward pass (fp32, max abs diff <= 1e-4).

The graphs are exported the way the pipeline does it: traced from a placeholder model and fed by
streaming the saved checkpoint's tensors, so parity here is the streaming exporter's parity.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from common import graph_io
from export.loader import placeholder_model
from export.onnx_export import export_model
from export.weights import CheckpointTensors, model_tensors
from tests.conftest import make_model

C = 24
GRAPHS = {"prefill": 8, "decode": 1, "score": 4}
TOL = 1e-4


@pytest.fixture(scope="module", params=["llama-gqa", "llama-tied", "mistral", "qwen2", "codegen"])
def exported(request, tmp_path_factory):
    model = make_model(request.param, seed=7)
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out / "checkpoint")
    dims = export_model(placeholder_model(out / "checkpoint", C), CheckpointTensors(out / "checkpoint"), out,
                        GRAPHS, C, progress=False)
    sessions = {g: ort.InferenceSession(str(out / f"{g}.onnx")) for g in GRAPHS}
    return model, dims, sessions


def run_graph(session, dims, ids, positions, mask, cache):
    """Run one graph; `cache` is a list of [1, H, C, D] arrays (random garbage in unused slots)."""
    feeds = {
        graph_io.INPUT_IDS: np.asarray(ids, np.int64)[None],
        graph_io.POSITION_IDS: np.asarray(positions, np.int64)[None],
        graph_io.ATTENTION_MASK: mask[None],
    }
    for i in range(dims.n_layers):
        feeds[graph_io.past_key(i)] = cache[2 * i]
        feeds[graph_io.past_value(i)] = cache[2 * i + 1]
    logits, *new = session.run(None, feeds)
    return logits[0], new


def hf_prefix_cache(model, prefix, dims, rng):
    """The KV of `prefix` from transformers, placed in the first slots of a garbage-filled cache."""
    with torch.no_grad():
        out = model(torch.tensor([prefix]), use_cache=True)
    cache = []
    for layer in out.past_key_values.layers:
        for t in (layer.keys, layer.values):
            buf = rng.standard_normal((1, dims.n_kv_heads, C, dims.head_dim)).astype(np.float32)
            buf[:, :, : len(prefix)] = t.numpy()
            cache.append(buf)
    return cache, out


def test_prefill_matches_hf_including_new_kv(exported):
    model, dims, sessions = exported
    rng = np.random.default_rng(0)
    ids = rng.integers(4, 260, 8)
    mask = np.zeros((8, C + 8), bool)
    mask[:, C:] = np.tri(8, dtype=bool)
    empty = [rng.standard_normal((1, dims.n_kv_heads, C, dims.head_dim)).astype(np.float32)
             for _ in range(2 * dims.n_layers)]
    logits, new = run_graph(sessions["prefill"], dims, ids, np.arange(8), mask, empty)
    with torch.no_grad():
        ref = model(torch.tensor(ids)[None], use_cache=True)
    assert np.abs(logits - ref.logits[0].numpy()).max() <= TOL
    for i, layer in enumerate(ref.past_key_values.layers):
        assert np.abs(new[2 * i] - layer.keys.numpy()).max() <= TOL
        assert np.abs(new[2 * i + 1] - layer.values.numpy()).max() <= TOL


@pytest.mark.parametrize("n_past", [1, 9, C - 1])
def test_decode_matches_hf_full_forward(exported, n_past):
    model, dims, sessions = exported
    rng = np.random.default_rng(n_past)
    seq = rng.integers(4, 260, n_past + 1)
    cache, _ = hf_prefix_cache(model, list(seq[:-1]), dims, rng)
    mask = np.zeros((1, C + 1), bool)
    mask[0, :n_past] = True
    mask[0, C] = True
    logits, _ = run_graph(sessions["decode"], dims, seq[-1:], [n_past], mask, cache)
    with torch.no_grad():
        ref = model(torch.from_numpy(np.asarray([seq]))).logits[0, -1].numpy()
    assert np.abs(logits[0] - ref).max() <= TOL


def test_score_graph_with_tree_mask_matches_hf_4d_mask(exported):
    """A non-trivial tree: node 0 is the root, 1 and 2 are its children, 3 is a child of 2."""
    model, dims, sessions = exported
    rng = np.random.default_rng(3)
    prefix = list(rng.integers(4, 260, 10))
    tree_ids = rng.integers(4, 260, 4)
    parent = [-1, 0, 0, 2]
    tree = np.eye(4, dtype=bool)
    for j in range(4):
        p = parent[j]
        while p >= 0:
            tree[j, p] = True
            p = parent[p]
    depth = tree.sum(1) - 1
    cache, _ = hf_prefix_cache(model, prefix, dims, rng)
    mask = np.zeros((4, C + 4), bool)
    mask[:, : len(prefix)] = True
    mask[:, C:] = tree
    positions = len(prefix) + depth
    logits, _ = run_graph(sessions["score"], dims, tree_ids, positions, mask, cache)

    # transformers on the whole sequence with the equivalent 4D additive mask and position ids
    n = len(prefix) + 4
    full = np.zeros((n, n), bool)
    full[: len(prefix), : len(prefix)] = np.tri(len(prefix), dtype=bool)
    full[len(prefix):, : len(prefix)] = True
    full[len(prefix):, len(prefix):] = tree
    additive = torch.where(torch.tensor(full), 0.0, torch.finfo(torch.float32).min)[None, None]
    pos = torch.tensor([list(range(len(prefix))) + list(positions)])
    with torch.no_grad():
        ref = model(torch.tensor([prefix + list(tree_ids)]), attention_mask=additive, position_ids=pos)
    assert np.abs(logits - ref.logits[0, len(prefix):].numpy()).max() <= TOL
    # and the tree really matters: node 3 differs from the same token placed on a plain chain
    with torch.no_grad():
        chain = model(torch.tensor([prefix + list(tree_ids)])).logits[0, -1].numpy()
    assert np.abs(logits[3] - chain).max() > 1e-3


def test_graphs_share_one_weights_file(exported, tmp_path):
    import onnx

    model, dims, _ = exported
    out = tmp_path / "again"
    export_model(model, model_tensors(model), out, GRAPHS, C, progress=False)
    params = sum(p.numel() for p in model.parameters()) * 4
    weights = (out / "weights.bin").stat().st_size
    # one copy (plus the transposed LM head when tied, plus page alignment), not three
    assert weights < 1.6 * params
    locations = set()
    for g in GRAPHS:
        m = onnx.load(str(out / f"{g}.onnx"), load_external_data=False)
        for t in m.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                locations.add({e.key: e.value for e in t.external_data}["location"])
    assert locations == {"weights.bin"}
