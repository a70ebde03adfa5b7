"""One sequence in a runner's cache slots 0..: the plain calls with which tests and benchmarks check and
time a chosen graph. (The runtime drives the cache through a forest of branches, runtime/forest.py,
whose plan chooses the graphs.)"""

from __future__ import annotations

import numpy as np

from common import graph_io
from runtime.model_runner import ModelRunner


class Chain:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.length = runner, 0

    def run(self, graph: str, tokens: np.ndarray, sees: np.ndarray | None = None, fetch: bool = True
            ) -> np.ndarray | None:
        """`tokens` as new rows after the `length` committed slots; their logits [n, V] (None with fetch=False).
        `sees` (bool [n, n]): the new rows each row sees (default: causal). Nothing is committed."""
        sees = np.tri(len(tokens), dtype=bool) if sees is None else sees
        return self.runner.run_rows(graph, tokens, np.arange(self.runner.context) < self.length, sees, fetch=fetch)

    def commit(self, rows: list[int] | np.ndarray) -> None:
        """Append the KV of these rows of the last `run` (the root and an accepted path, say) to the sequence."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.length + len(rows) > self.runner.context:
            raise ValueError(f"{self.length + len(rows)} tokens exceed the cache's {self.runner.context} slots")
        self.runner.store(rows, np.arange(self.length, self.length + len(rows)))
        self.length += len(rows)

    def forward(self, graph: str, tokens: np.ndarray, fetch: bool = True) -> np.ndarray | None:
        """Run a chain of tokens and commit all of them; their logits [n, V]."""
        logits = self.run(graph, tokens, fetch=fetch)
        self.commit(np.arange(len(tokens)))
        return logits

    def rewind(self, length: int) -> None:
        """Forget every slot from `length` on."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind to {length} (valid length {self.length})")
        self.length = length

    def prefill(self, tokens: np.ndarray, fetch: bool = True) -> np.ndarray | None:
        """Run a prompt after the committed slots in the runtime's cheapest calls; its last token's logits."""
        s, logits, plan = 0, None, self.runner.plan(len(tokens), last_row=True)
        for i, (graph, n) in enumerate(plan):
            graph = self.runner.prefill_graph if graph == graph_io.PREFILL else graph
            logits = self.forward(graph, tokens[s : s + n], fetch=fetch and i == len(plan) - 1)
            s += n
        return None if logits is None else logits[-1]

    def start(self, prompt: np.ndarray, fetch: bool = True) -> np.ndarray | None:
        """Begin again in slot 0: prefill `prompt`; its last token's logits."""
        self.rewind(0)
        return self.prefill(prompt, fetch)
