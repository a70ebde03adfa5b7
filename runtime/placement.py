"""Where a model's tensors live and how its sessions open: the runner (runtime/model_runner.py) asks its
placement, and each placement is one file.

`HostPlacement` (runtime/host_placement.py) on the CPU target; `DevicePlacement` (runtime/device_placement.py)
on a GPU target (or forced on the CPU by the tests): the cache and every buffer on the device, CUDA graphs.

What they share is here: a graph's bound buffers (`BoundGraph`: the runner fills the host inputs in
place and calls `run`) and opening a session the target's way (options and providers from
common/targets.py, the shared weights handed in, a session that fell back to the CPU refused).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from common import graph_io
from common.manifest import ModelEntry
from common.shared_weights import SharedWeights
from common.targets import Target, check_session, compiled_session_options


@dataclass
class BoundGraph:
    """One graph's session and its I/O, bound once; the runner writes the host inputs in place."""

    tokens: int
    session: ort.InferenceSession
    binding: ort.IOBinding
    input_ids: np.ndarray  # [1, T]
    position_ids: np.ndarray  # [1, T]
    mask: np.ndarray  # [1, T, C + T]
    shared: SharedWeights | None  # the weights the session was handed: they must outlive it
    greedy_outputs: bool = False  # the graph returns each row's greedy token (compiler/greedy_outputs.py)
    logit_rows: int = 0  # rows of logits it returns: T, or 1 (graph_io.PREFILL_LAST: its last row's alone)

    def run(self) -> None:
        """One call on the inputs as they stand."""
        self.session.run_with_iobinding(self.binding)

    def logits(self) -> np.ndarray:
        """The last call's logits [1, T, V] on the host (the caller's until the next call)."""
        raise NotImplementedError

    def output(self, name: str) -> np.ndarray:
        """One of the last call's small outputs (NEXT_TOKEN, LOGITS_CHECK) on the host."""
        raise NotImplementedError

    def greedy_tokens(self, n: int) -> np.ndarray:
        """The first n rows' greedy tokens (np.argmax, the first on ties): the graph's own output where it has
        one (T integers leave the device, no logits), else from the logits."""
        if self.greedy_outputs:
            return self.output(graph_io.NEXT_TOKEN)[0, :n]
        return np.argmax(self.logits()[0, :n], axis=-1)

    def finite(self, n: int) -> np.ndarray:
        """Whether each of the first n rows' logits are all finite (the graph's check where it has one)."""
        if self.greedy_outputs:
            return ~np.isnan(self.output(graph_io.LOGITS_CHECK)[0, :n])
        return np.isfinite(self.logits()[0, :n]).all(axis=-1)

    def run_padding(self, runs: int) -> None:
        """Run `runs` times on padding rows that each see only themselves (token 0 at position 0)."""
        rows = np.arange(self.tokens)
        self.input_ids[...] = 0
        self.position_ids[...] = 0
        self.mask[...] = False
        self.mask[0, rows, self.mask.shape[2] - self.tokens + rows] = True
        for _ in range(runs):
            self.run()


class Placement:
    """Opens a model's graphs for one target and keeps its KV cache; see the module docstring."""

    cuda_graph = False  # whether calls replay CUDA graphs (runtime/device_placement.py)

    def __init__(self, artifact_dir: Path, entry: ModelEntry, slots: int, target: Target, threads: int | None,
                 device: str | None) -> None:
        """`device`: where the shared weights go ("cpu": views of one mapping of the weights file; None:
        each session its own copy, as for artifacts built before the compiler's initializer index)."""
        self.target = target
        self.dims, self.slots, self.threads = entry.dims, slots, threads
        self.shared = None if device is None else SharedWeights.available(
            Path(artifact_dir) / Path(entry.weights).parent, Path(artifact_dir) / entry.weights, device)

    def options(self) -> ort.SessionOptions:
        return compiled_session_options(self.target, self.threads)

    def session(self, graph: str, path: Path) -> ort.InferenceSession:
        """The graph's session, with the shared weights, on the target's provider or refused."""
        so = self.options()
        if self.shared is not None:
            self.shared.add_to(graph, so)
        session = ort.InferenceSession(str(path), so, providers=self.target.providers(self.cuda_graph))
        check_session(session, self.target)
        return session

    @staticmethod
    def has_greedy_outputs(session: ort.InferenceSession) -> bool:
        return set(graph_io.GREEDY_OUTPUTS) <= {o.name for o in session.get_outputs()}

    def inputs(self, tokens: int) -> dict[str, np.ndarray]:
        """A graph's host inputs: token ids, positions, mask."""
        return {"input_ids": np.zeros((1, tokens), np.int64), "position_ids": np.zeros((1, tokens), np.int64),
                "mask": np.zeros((1, tokens, self.slots + tokens), bool)}

    def open(self, graph: str, path: Path, tokens: int) -> BoundGraph:
        raise NotImplementedError

    def store(self, g: BoundGraph, rows: np.ndarray, slots: np.ndarray) -> None:
        """Write the KV of rows `rows` of `g`'s last call into cache slots `slots` (one slot per row)."""
        raise NotImplementedError

    def needs_capture(self) -> bool:
        """Whether this thread's next call must first capture every graph (CUDA graphs)."""
        return False

    def capture(self, graphs: Iterable[BoundGraph]) -> None:
        raise ValueError("only a device placement replays CUDA graphs (runtime/device_placement.py)")
