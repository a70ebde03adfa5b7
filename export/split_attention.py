"""Attention that reads the KV cache in place instead of concatenating the new tokens onto it.

transformers' attention appends the new keys and values to the cache (`torch.cat`) and attends over
the result, so every traced graph copied all C cache slots of every layer on every call (about 1 GB
per step for a 7B model at C = 1024 in fp32). Here the cache hands back only the T new keys and
values, and attention runs over the two blocks separately: scores against the past and against the
new tokens, one softmax over their concatenation (only [T, C + T] scores), and two weighted sums.
The mask is the graph's general [B, 1, T, C + T] mask, added unchanged.

Llama, Mistral, Qwen2 and CodeGen (transformers >= 5.24) reach this through transformers'
AttentionInterface (selected while tracing). CodeGen before 5.24 calls its own `_attn` method, which
is replaced on the instance while tracing.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface, Cache, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.models.codegen.modeling_codegen import CodeGenAttention

ATTN_IMPLEMENTATION = "mxspd_split"
CACHE_KWARG = "split_kv_cache"  # the model forwards unknown kwargs down to the attention function


def attend(
    query: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    new_key: torch.Tensor,
    new_value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scaling + mask) v over [past; new] keys without forming [past; new].

    query [B, Hq, T, D]; past [B, Hkv, C, D]; new [B, Hkv, T, D]; mask broadcastable to
    [B, Hq, T, C + T]. Returns the output [B, Hq, T, D] and the probabilities [B, Hq, T, C + T].
    Grouped-query heads are folded into rows of the query (a reshape) rather than repeating the
    KV heads, which would copy the cache.
    """
    b, hq, t, d = query.shape
    hkv, c = past_key.shape[1], past_key.shape[2]
    q = query.reshape(b, hkv, (hq // hkv) * t, d)  # query head h uses KV head h // (hq // hkv)
    scores = torch.cat([q @ past_key.transpose(-1, -2), q @ new_key.transpose(-1, -2)], dim=-1) * scaling
    scores = scores.reshape(b, hq, t, c + t)
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(past_value.dtype)
    grouped = probs.reshape(b, hkv, (hq // hkv) * t, c + t)
    out = grouped[..., :c] @ past_value + grouped[..., c:] @ new_value
    return out.reshape(b, hq, t, d), probs


class _SplitLayer(DynamicLayer):
    """One layer's C past slots (inputs, read in place) and its T new keys/values (recorded by update)."""

    def __init__(self, past_key: torch.Tensor, past_value: torch.Tensor) -> None:
        super().__init__()
        self.past_keys, self.past_values = past_key, past_value
        self.read = False  # set by the attention: proves this layer's attention went through `attend`

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys, self.values, self.is_initialized = key_states, value_states, True
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.past_keys.shape[-2] + (0 if self.keys is None else self.keys.shape[-2])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.past_keys.shape[-2] + query_length, 0


class SplitCache(Cache):
    """A cache whose `update` returns only the new tokens' KV; attention reads the past via `past`."""

    def __init__(self, past: Sequence[torch.Tensor]) -> None:
        super().__init__(layers=[_SplitLayer(past[i], past[i + 1]) for i in range(0, len(past), 2)])

    def past(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        layer.read = True
        return layer.past_keys, layer.past_values

    def new_kv(self) -> list[torch.Tensor]:
        """[key_0, value_0, key_1, ...] of the new tokens, in graph_io's output order."""
        if not all(layer.read for layer in self.layers):
            raise RuntimeError("split attention was not used by every layer: this model's attention "
                               "does not go through transformers' AttentionInterface")
        return [t for layer in self.layers for t in (layer.keys, layer.values)]


def _hf_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The AttentionInterface function: eager attention with `key`/`value` new only.

    Mistral/Qwen2 pass `sliding_window`; as in eager attention the mask already encodes it.
    """
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or dropout:
        raise NotImplementedError("split attention supports neither softcapping, attention sinks nor dropout")
    past_key, past_value = kwargs[CACHE_KWARG].past(module.layer_idx)
    out, probs = attend(query, past_key, past_value, key, value, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), probs


AttentionInterface.register(ATTN_IMPLEMENTATION, _hf_attention)


def _codegen_attn(module: torch.nn.Module, cache: SplitCache, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """CodeGenAttention._attn (transformers < 5.24) with `key`/`value` new only. It adds the mask
    before dividing by sqrt(D); adding it after scaling differs only in already-masked scores."""
    past_key, past_value = cache.past(module.layer_idx)
    return attend(query, past_key, past_value, key, value, attention_mask, 1.0 / module.scale_attn)


@contextmanager
def split_attention(model: PreTrainedModel, cache: SplitCache) -> Iterator[dict[str, Any]]:
    """Within the block, `model` attends through `attend` over `cache`; yields the extra forward kwargs.

    The model's own attention setting (and CodeGen's `_attn`) is restored afterwards, so the same
    model object still runs transformers' reference forward.
    """
    if model.config.model_type == "codegen" and hasattr(CodeGenAttention, "_attn"):
        blocks = [m for m in model.modules() if isinstance(m, CodeGenAttention)]
        for m in blocks:
            m._attn = functools.partial(_codegen_attn, m, cache)
        try:
            yield {}
        finally:
            for m in blocks:
                del m._attn
        return
    previous = model.config._attn_implementation
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    try:
        yield {CACHE_KWARG: cache}
    finally:
        model.config._attn_implementation = previous
