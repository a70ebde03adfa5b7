"""A prompt's prefill computes its last row's logits alone (graph_io.PREFILL_LAST): the graph's LM head reads
one row, and what a generation sees is bit for bit what the all-rows prefill graph gives."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import pytest

from benchmarks.chain import Chain
from common import graph_io
from common.manifest import read_manifest
from runtime.forest import Forest
from runtime.model_runner import ModelRunner


@pytest.fixture(scope="module")
def runners(artifact_dir):
    manifest = read_manifest(artifact_dir)
    entry = manifest.models["tlm"]
    return [Chain(ModelRunner(artifact_dir, entry, manifest.capacity)) for _ in range(2)]


def test_the_prefill_last_graph_returns_one_row(artifact_dir):
    manifest = read_manifest(artifact_dir)
    for entry in manifest.models.values():
        g = entry.graphs[graph_io.PREFILL_LAST]
        assert g.tokens == entry.graphs[graph_io.PREFILL].tokens == manifest.prefill_chunk
        graph = onnx.load(str(artifact_dir / g.file), load_external_data=False).graph
        logits = next(o for o in graph.output if o.name == graph_io.LOGITS)
        assert [d.dim_value for d in logits.type.tensor_type.shape.dim] == [1, 1, entry.dims.vocab_size]


@pytest.mark.parametrize("length", [1, 5, 8, 13, 16, 21])  # chunks of 8: partial, whole, several
def test_prefill_equals_the_all_rows_graphs_last_row_and_commits_the_same_cache(runners, length):
    last, every = runners
    assert last.runner.prefill_graph == graph_io.PREFILL_LAST
    prompt = np.arange(5, 5 + length) % 200 + 3
    every.rewind(0)
    got = last.start(prompt)
    rows = []
    for start in range(0, length, 8):  # the same chunks through the graph of every row's logits
        rows.append(every.forward(graph_io.PREFILL, prompt[start : start + 8]))
    np.testing.assert_array_equal(got, rows[-1][-1])
    assert last.length == every.length == length
    np.testing.assert_array_equal(last.runner.place.cache_stack[..., :length, :],
                                  every.runner.place.cache_stack[..., :length, :])
    for _ in range(3):  # and decoding on goes on alike
        token = np.array([int(np.argmax(got))])
        got, want = last.forward(graph_io.DECODE, token)[0], every.forward(graph_io.DECODE, token)[0]
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rows", [1, 3, 7, 8])
def test_a_partial_chunk_sits_at_the_graphs_end(runners, rows):
    """Its rows end at the graph's last row, whose logits it returns (the plan may not send a partial
    chunk there: this call does)."""
    last, every = runners
    for r in runners:
        r.rewind(0)
        r.forward(graph_io.DECODE, np.array([9]))  # a committed token before the chunk
    chunk = np.arange(20, 20 + rows)
    got = last.forward(graph_io.PREFILL_LAST, chunk)
    np.testing.assert_array_equal(got, every.forward(graph_io.PREFILL, chunk)[-1:])
    np.testing.assert_array_equal(last.runner.place.cache_stack[..., : rows + 1, :],
                                  every.runner.place.cache_stack[..., : rows + 1, :])
    np.testing.assert_array_equal(last.runner.argmax(), np.argmax(got, axis=-1))


def test_calls_that_want_every_rows_logits_never_get_the_last_row_graph(runners):
    runner = runners[0].runner
    assert runner.graph_for(8) == graph_io.PREFILL
    assert all(graph != graph_io.PREFILL_LAST for graph, _ in runner.plan(20))


def test_a_prompt_is_planned_by_what_its_calls_cost_keeping_its_last_row(runners):
    """A prompt keeps its last row's logits alone, so its PREFILL calls run PREFILL_LAST, and the plan prices
    them so: where the every-row graph costs more per row than smaller graphs but the last-row one less (an
    MXFP4 1B build: 8-row calls, each with 8 rows of LM head, had taken its 512-token prompts), a prompt
    takes the prefill chunks, a call that wants every row's logits does not, and a forest's prompt runs them."""
    runner = runners[0].runner
    saved, t = runner.entries, runner.entries[graph_io.PREFILL].tokens
    per_row = {graph_io.PREFILL: 1.2, graph_io.PREFILL_LAST: 0.8}  # the others: 1.0 a row
    runner.entries = {name: replace(g, cost_ms=g.tokens * per_row.get(name, 1.0)) for name, g in saved.items()}
    try:
        assert graph_io.PREFILL not in {graph for graph, _ in runner.plan(2 * t)}
        assert runner.plan(2 * t, last_row=True) == [(graph_io.PREFILL, t)] * 2
        forest = Forest(runner)
        branch, calls = forest.attach([]), runner.calls
        runner.warm.discard(graph_io.PREFILL_LAST)
        forest.extend_rows([branch], [list(range(3, 3 + 2 * t))], [1])
        assert runner.calls - calls == 2 and graph_io.PREFILL_LAST in runner.warm
        forest.release(branch)
    finally:
        runner.entries = saved
