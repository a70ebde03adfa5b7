"""The one place that defines the names and shapes of every exported graph's inputs and outputs.

Every graph of a model (prefill, decode, score, catch-up) has the same signature; only the
number of new tokens T differs. B = batch, C = context length (cache slots), H = KV heads,
D = head dim, V = vocabulary size, L = layers.

| name                | dtype   | shape          | meaning                                              |
|---------------------|---------|----------------|------------------------------------------------------|
| input_ids           | int64   | [B, T]         | the T new tokens                                     |
| position_ids        | int64   | [B, T]         | their positions (RoPE); chosen by the host           |
| attention_mask      | bool    | [B, T, C + T]  | row t: which cache slots (first C columns) and which |
|                     |         |                | new tokens (last T columns) token t may attend to    |
| past_key.{i}        | kv      | [B, H, C, D]   | layer i's key cache (unused slots are masked out)    |
| past_value.{i}      | kv      | [B, H, C, D]   | layer i's value cache                                |
| logits              | float32 | [B, T, V]      | next-token logits for each new token (prefill_last:  |
|                     |         |                | [B, 1, V], the last one's)                           |
| new_key.{i}         | kv      | [B, H, T, D]   | keys of the T new tokens; the host writes them into  |
| new_value.{i}       | kv      | [B, H, T, D]   | the cache slots it chose                             |
| next_token          | int64   | [B, T]         | each row's argmax (greedy token): device targets'    |
| logits_check        | float32 | [B, T]         | 0 where a row's logits are all finite, else NaN;     |
|                     |         |                | both added by the compiler (greedy_outputs.py)       |

The host owns the cache: it decides which slot each token occupies, and the mask decides what
each token sees, so a causal chain, a tree of candidates and a rewind (purge) are all host-side.

Token trees (speculation). A call's rows are: row 0, the root (the last committed token, not yet
in the cache); then the draft tree's nodes, each after its parent; then any auxiliary rows a
drafter needs (lookahead's Jacobi window). Every row sees the committed cache; among the new
rows it sees what `sees[row]` says (its ancestors and itself for a tree node). A row's position
is the root's position plus the number of new rows it sees, minus one (its depth), so any row
whose visible rows form a chain is exactly a chain forward of that chain. After the call the
host commits the root and the accepted path (any subset of rows, in order) to the cache; the
other rows' KV is dropped, so nothing uncommitted is attended to again.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

# MX weights between the quant pass and the compiler: blocks of 32 along K, and the metadata key
# recording the opset the graph had before the pass raised it for FLOAT6 DequantizeLinear.
MX_BLOCK = 32
MX_BASE_OPSET_KEY = "mx.base_opset"

# Graph names. A TLM has score graphs for a few draft lengths k (T = k + 1: the last committed
# token and k drafts), so the runtime can speculate as much as pays off, round by round, and a
# lookahead graph sized for the recipe's lookahead settings. A call of n rows runs on the
# smallest graph with T >= n (`fitting_graph`), so any tree that fits some graph can be scored.
PREFILL, DECODE, CATCHUP, LOOKAHEAD = "prefill", "decode", "catchup", "lookahead"

# A prompt's prefill needs its last row's logits only (llama.cpp computes no others either): this graph is
# the prefill chunk's with logits [B, 1, V] for its last row alone, so its LM head reads one row, not T
# (a call 1.11-1.17x faster on SmolLM2 and at 1B: docs/benchmarks.md). The runtime places a chunk's
# rows at the graph's end, and prefills with it wherever a model has it; calls that want every row's
# logits (scoring, perplexity) use PREFILL.
PREFILL_LAST = "prefill_last"


def logit_rows(graph: str, tokens: int) -> int:
    """The rows of logits a graph returns: the last row's alone for PREFILL_LAST, else every row's."""
    return 1 if graph == PREFILL_LAST else tokens


def score_graph(k: int) -> str:
    return f"score{k}"


def batch_graph(t: int) -> str:
    """A serving build's graph of T rows between the score graphs and the prefill chunk (export.pipeline)."""
    return f"batch{t}"


def draft_lengths(k_max: int) -> tuple[int, ...]:
    """The compiled draft lengths: 1, 2, 3, 4, then powers of two and one less, and k_max itself.
    A score graph of T = 2^i rows (k = 2^i - 1) also runs 2^i requests' newest tokens in one call
    when serving, with no padding row (the default recipe's serving build: score7 7.5 ms, score8 8.6)."""
    powers = {2**i for i in range(2, 12)}
    ks = {k for k in {1, 2, 3, 4} | powers | {p - 1 for p in powers} if k <= k_max} | {k_max}
    return tuple(sorted(ks))


def lookahead_tokens(ngram: int, window: int, guesses: int) -> int:
    """Rows of a full lookahead step: the root, N-1 window levels of W tokens, G candidate (N-1)-grams."""
    return 1 + (ngram - 1) * (window + guesses)


def fitting_graph(graph_tokens: dict[str, int], rows: int) -> str:
    """The graph (name -> T) with the fewest tokens that holds `rows` new rows."""
    fits = [(t, name) for name, t in graph_tokens.items() if t >= rows]
    if not fits:
        raise ValueError(f"{rows} rows fit no compiled graph (largest T = {max(graph_tokens.values())})")
    return min(fits)[1]


def plan_calls(graphs: dict[str, tuple[int, float]], rows: int, max_rows: int | None = None
               ) -> list[tuple[str, int]]:
    """The cheapest sequence of calls that runs `rows` new rows, at most `max_rows` per call: (graph,
    rows it takes) per call, from each graph's (T, measured cost of one call). 20 rows in two calls
    of T = 13 and 9 can cost less than one call of T = 64. Without measured costs (any cost 0): the
    fewest calls, as `fitting_graph` picks them. A graph of fewer rows is taken to cost no more than
    one of more rows (which could run its rows), and ties go to the smaller: measured on a busy
    machine, decode (T = 1) once cost 6.6 ms against a 3-row graph's 6.1, and every greedy token
    ran 3 rows. Batch-invariant graphs give the same bits however the rows are split. Plans are
    remembered (a decode loop asks for the same few sizes)."""
    if rows < 1:
        raise ValueError(f"a call needs at least one row, got {rows}")
    capped, least = {}, np.inf
    for name, (t, cost) in sorted(graphs.items(), key=lambda g: (-g[1][0], -g[1][1])):  # largest first
        least = min(least, cost)
        capped[name] = (t, least)
    first = sorted(capped, key=lambda name: (graphs[name][0], graphs[name][1], name))  # on a tie: fewer rows, cheaper
    return list(_plan(tuple((name, capped[name]) for name in first), rows, max_rows))


@functools.lru_cache(maxsize=4096)
def _plan(graphs: tuple[tuple[str, tuple[int, float]], ...], rows: int, max_rows: int | None
          ) -> tuple[tuple[str, int], ...]:
    sizes = {name: t for name, (t, _) in graphs}
    cap = {name: min(t, max_rows or t) for name, t in sizes.items()}
    if any(cost <= 0 for _, (_, cost) in graphs):
        chunk = max(cap.values())
        return tuple((fitting_graph(sizes, n), n) for n in [chunk] * (rows // chunk) + [rows % chunk] if n)
    best, pick = [0.0] + [np.inf] * rows, [""] * (rows + 1)
    for r in range(1, rows + 1):  # best[r]: the cheapest way to run r rows
        for name, (_, cost) in graphs:
            if cost + best[max(0, r - cap[name])] < best[r]:
                best[r], pick[r] = cost + best[max(0, r - cap[name])], name
    plan, r = [], rows
    while r > 0:
        take = min(cap[pick[r]], r)
        plan.append((pick[r], take))
        r -= take
    return tuple(plan)


def tree_sees(parents: Sequence[int]) -> np.ndarray:
    """bool [n, n]: row i sees its ancestors and itself; parents[0] = -1 (the root), parents[i] < i."""
    n = len(parents)
    sees = np.eye(n, dtype=bool)
    for i in range(1, n):
        if not 0 <= parents[i] < i:
            raise ValueError(f"node {i}: parent {parents[i]} must come before it")
        sees[i] |= sees[parents[i]]
    return sees


def row_positions(start: int, sees: np.ndarray) -> np.ndarray:
    """Position ids of a call's rows: the root is at `start`; a row is one past the deepest row it sees."""
    return start + sees.sum(axis=1) - 1


INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
ATTENTION_MASK = "attention_mask"
LOGITS = "logits"
NEXT_TOKEN = "next_token"
LOGITS_CHECK = "logits_check"
GREEDY_OUTPUTS = {NEXT_TOKEN: np.dtype(np.int64), LOGITS_CHECK: np.dtype(np.float32)}  # [B, logit rows] each


def past_key(layer: int) -> str:
    return f"past_key.{layer}"


def past_value(layer: int) -> str:
    return f"past_value.{layer}"


def new_key(layer: int) -> str:
    return f"new_key.{layer}"


def new_value(layer: int) -> str:
    return f"new_value.{layer}"


@dataclass(frozen=True)
class ModelDims:
    """What the host needs to know about a model to allocate buffers and drive its graphs."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    kv_dtype: str = "float32"

    def to_dict(self) -> dict:
        return asdict(self)


def input_names(dims: ModelDims) -> list[str]:
    names = [INPUT_IDS, POSITION_IDS, ATTENTION_MASK]
    for i in range(dims.n_layers):
        names += [past_key(i), past_value(i)]
    return names


def output_names(dims: ModelDims) -> list[str]:
    names = [LOGITS]
    for i in range(dims.n_layers):
        names += [new_key(i), new_value(i)]
    return names


def input_shapes(dims: ModelDims, batch: int, tokens: int, context: int) -> dict[str, tuple]:
    kv = (batch, dims.n_kv_heads, context, dims.head_dim)
    shapes: dict[str, tuple] = {
        INPUT_IDS: (batch, tokens),
        POSITION_IDS: (batch, tokens),
        ATTENTION_MASK: (batch, tokens, context + tokens),
    }
    for i in range(dims.n_layers):
        shapes[past_key(i)] = kv
        shapes[past_value(i)] = kv
    return shapes


def output_shapes(dims: ModelDims, batch: int, tokens: int, logits: int | None = None) -> dict[str, tuple]:
    """`logits`: the rows of logits (`logit_rows`; default every row's)."""
    new = (batch, dims.n_kv_heads, tokens, dims.head_dim)
    shapes: dict[str, tuple] = {LOGITS: (batch, logits or tokens, dims.vocab_size)}
    for i in range(dims.n_layers):
        shapes[new_key(i)] = new
        shapes[new_value(i)] = new
    return shapes


# The KV store graph, one per model beside its weights (`<role>/kv_store.onnx`): where the runtime
# keeps the cache on a device, it commits rows with this graph instead of through host memory.
# cache_out = cache with new[:, :, :, rows] written at slots (axis 3), written in place (the runtime
# binds cache_out to the cache itself). cache: [2L, 1, H, C, D] (layer i's key at 2i, value at
# 2i + 1); new: a call's new KV of all layers [2L, 1, H, T, D]; rows, slots: int64 [m].
KV_STORE_FILE = "kv_store.onnx"

# A model's initializer index, beside its weights (`<role>/initializers.json`) where its graphs run on a
# device: {graph: [[name, numpy dtype, dims, offset, length], ...]}, the graph's large initializers as
# offsets into the model's weights file. One ONNX Runtime session per graph would otherwise hold its
# own device copy of every weight (nine graphs, nine copies); the runtime puts each distinct tensor
# on the device once and hands it to every session (common/shared_weights.py).
INITIALIZERS_FILE = "initializers.json"
KV_CACHE, KV_NEW, KV_ROWS, KV_SLOTS, KV_CACHE_OUT = "cache", "new", "rows", "slots", "cache_out"
