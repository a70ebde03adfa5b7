"""One sequence in a runner's cache slots 0..: the plain calls with which tests and benchmarks check and
time a chosen graph. (The runtime drives the cache through a forest of branches, runtime/forest.py,
whose plan chooses the graphs; a prompt goes through it here too.)"""

from __future__ import annotations

import numpy as np

from runtime.forest import Forest
from runtime.model_runner import ModelRunner


class Chain:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.length = runner, 0

    def run(self, graph: str, tokens: np.ndarray, sees: np.ndarray | None = None) -> np.ndarray:
        """`tokens` as new rows after the `length` committed slots; their logits [n, V]. `sees` (bool [n, n]):
        the new rows each row sees (default: causal). Nothing is committed."""
        sees = np.tri(len(tokens), dtype=bool) if sees is None else sees
        return self.runner.run_rows(graph, tokens, np.arange(self.runner.context) < self.length, sees)

    def commit(self, rows: list[int] | np.ndarray) -> None:
        """Append the KV of these rows of the last `run` (the root and an accepted path, say) to the sequence."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.length + len(rows) > self.runner.context:
            raise ValueError(f"{self.length + len(rows)} tokens exceed the cache's {self.runner.context} slots")
        self.runner.store(rows, np.arange(self.length, self.length + len(rows)))
        self.length += len(rows)

    def forward(self, graph: str, tokens: np.ndarray) -> np.ndarray:
        """Run a chain of tokens and commit all of them; their logits [n, V]."""
        logits = self.run(graph, tokens)
        self.commit(np.arange(len(tokens)))
        return logits

    def rewind(self, length: int) -> None:
        """Forget every slot from `length` on."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind to {length} (valid length {self.length})")
        self.length = length

    def prefill(self, tokens: np.ndarray) -> np.ndarray:
        """Run a prompt after the committed slots as the runtime does (a forest's plan of calls); its last
        token's logits."""
        forest = Forest(self.runner)
        logits = forest.extend([forest.attach(list(range(self.length)))], [list(tokens)])[0]
        self.length += len(tokens)
        return logits

    def start(self, prompt: np.ndarray) -> np.ndarray:
        """Begin again in slot 0: prefill `prompt`; its last token's logits."""
        self.rewind(0)
        return self.prefill(prompt)
