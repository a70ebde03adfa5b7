"""Attention that reads the KV cache in place instead of concatenating the new tokens onto it.

transformers' attention appends the new keys and values to the cache (`torch.cat`) and attends over
the result, so every traced graph copied all C cache slots of every layer on every call (about 1 GB
per step for a 7B model at C = 1024 in fp32). Here the cache hands back only the T new keys and
values, and attention runs over the two blocks separately: scores against the past and against the
new tokens, one softmax over their concatenation (only [T, C + T] scores), and two weighted sums.
The mask is the graph's general [B, 1, T, C + T] mask, added unchanged.

Each layer's attention is traced as one node, `ai.mxspd::Attention`, whose meaning is a model-local
ONNX function (`attention_function`, the same math in standard ops), so an exported graph runs on
any ONNX Runtime; the compiler either keeps the node for mxspd's batch-invariant kernel
(kernels/attention.cc) or inlines the function.

Llama, Mistral, Qwen2 and CodeGen (transformers >= 5.24) reach this through transformers'
AttentionInterface (selected while tracing). CodeGen before 5.24 calls its own `_attn` method, which
is replaced on the instance while tracing.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import onnx
import torch
from onnx import helper
from transformers import AttentionInterface, Cache, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.models.codegen.modeling_codegen import CodeGenAttention

from kernels import ATTENTION, DOMAIN

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


class _AttentionNode(torch.autograd.Function):
    """`attend`'s output, traced as the single node ai.mxspd::Attention (see attention_function)."""

    @staticmethod
    def forward(ctx, query, past_key, past_value, new_key, new_value, mask, scaling):  # noqa: ANN001, ANN205
        return attend(query, past_key, past_value, new_key, new_value, mask, scaling)[0]

    @staticmethod
    def symbolic(g, query, past_key, past_value, new_key, new_value, mask, scaling):  # noqa: ANN001, ANN205
        out = g.op(f"{DOMAIN}::{ATTENTION}", query, past_key, past_value, new_key, new_value, mask, scale_f=scaling)
        out.setType(query.type())
        return out


def attend_node(query: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor, new_key: torch.Tensor,
                new_value: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> tuple[torch.Tensor, None]:
    """`attend` as one graph node; no probabilities (nothing reads them while exporting)."""
    if mask is None:
        b, t, c = query.shape[0], query.shape[2], past_key.shape[2]
        mask = torch.zeros(b, 1, t, c + t, dtype=query.dtype)
    return _AttentionNode.apply(query, past_key, past_value, new_key, new_value, mask, float(scaling)), None


def attention_function(opset: int) -> onnx.FunctionProto:
    """ai.mxspd::Attention in standard ONNX ops: `attend` step by step, shapes read from the inputs."""
    def const(name: str, values: list[int]) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [name], value_ints=values)

    scale = helper.make_node("Constant", [], ["scale"])
    scale.attribute.append(onnx.AttributeProto(name="value_float", ref_attr_name="scale",
                                               type=onnx.AttributeProto.FLOAT))
    nodes = [
        scale, const("i0", [0]), const("i1", [1]), const("i2", [2]), const("i3", [3]), const("i4", [4]),
        const("minus1", [-1]), const("end", [2**62]),
        helper.make_node("Shape", ["query"], ["qs"]),
        helper.make_node("Shape", ["past_key"], ["ks"]),
        helper.make_node("Slice", ["qs", "i0", "i1"], ["b"]),
        helper.make_node("Slice", ["ks", "i1", "i2"], ["hkv"]),
        helper.make_node("Slice", ["ks", "i2", "i3"], ["c"]),
        helper.make_node("Slice", ["qs", "i3", "i4"], ["d"]),
        helper.make_node("Slice", ["qs", "i0", "i3"], ["bht"]),
        helper.make_node("Concat", ["b", "hkv", "minus1", "d"], ["grouped"], axis=0),
        helper.make_node("Concat", ["bht", "minus1"], ["by_head"], axis=0),
        helper.make_node("Reshape", ["query", "grouped"], ["qg"]),  # query head h uses KV head h // (Hq // Hkv)
        helper.make_node("Transpose", ["past_key"], ["pkt"], perm=[0, 1, 3, 2]),
        helper.make_node("Transpose", ["new_key"], ["nkt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["qg", "pkt"], ["s_past"]),
        helper.make_node("MatMul", ["qg", "nkt"], ["s_new"]),
        helper.make_node("Concat", ["s_past", "s_new"], ["s_cat"], axis=-1),
        helper.make_node("Mul", ["s_cat", "scale"], ["s_scaled"]),
        helper.make_node("Reshape", ["s_scaled", "by_head"], ["s_heads"]),
        helper.make_node("Add", ["s_heads", "mask"], ["s_masked"]),
        helper.make_node("Softmax", ["s_masked"], ["probs"], axis=-1),
        helper.make_node("Shape", ["s_cat"], ["gs"]),
        helper.make_node("Reshape", ["probs", "gs"], ["pg"]),
        helper.make_node("Slice", ["pg", "i0", "c", "i3"], ["p_past"]),
        helper.make_node("Slice", ["pg", "c", "end", "i3"], ["p_new"]),
        helper.make_node("MatMul", ["p_past", "past_value"], ["o_past"]),
        helper.make_node("MatMul", ["p_new", "new_value"], ["o_new"]),
        helper.make_node("Add", ["o_past", "o_new"], ["o"]),
        helper.make_node("Reshape", ["o", "qs"], ["out"]),
    ]
    return helper.make_function(
        DOMAIN, ATTENTION, ["query", "past_key", "past_value", "new_key", "new_value", "mask"], ["out"], nodes,
        [helper.make_opsetid("", opset)], attributes=["scale"])


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
    out, probs = attend_node(query, past_key, past_value, key, value, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), probs


AttentionInterface.register(ATTN_IMPLEMENTATION, _hf_attention)


def _codegen_attn(module: torch.nn.Module, cache: SplitCache, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """CodeGenAttention._attn (transformers < 5.24) with `key`/`value` new only. It adds the mask
    before dividing by sqrt(D); adding it after scaling differs only in already-masked scores."""
    past_key, past_value = cache.past(module.layer_idx)
    return attend_node(query, past_key, past_value, key, value, attention_mask, 1.0 / module.scale_attn)


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
