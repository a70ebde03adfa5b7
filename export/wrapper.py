"""Wraps a transformers causal LM so that its KV cache and attention mask are explicit tensors.

We reuse transformers' own modules (projections, RoPE, norms) rather than re-deriving each
architecture: the wrapper only moves the cache and the mask to the graph boundary. The C past slots
are graph inputs that attention reads in place (export/split_attention.py): transformers' own
attention would concatenate the T new tokens' KV onto them, copying the whole cache every call.
The mask (built by the host) says which of the C + T keys each new token may see. Every supported
family splits, CodeGen included.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel

from export.split_attention import SplitCache, split_attention


class ExplicitKVWrapper(torch.nn.Module):
    """forward(input_ids, position_ids, bool mask [B, T, C + T], *past KV) -> (logits, *new KV).

    `split=False` traces transformers' own attention, which concatenates past and new KV; it is
    kept only as the baseline of benchmarks/attention_cost.py.
    """

    def __init__(self, model: PreTrainedModel, split: bool = True, last_row: bool = False) -> None:
        """`last_row`: logits for the last row alone (graph_io.PREFILL_LAST: its LM head reads one row)."""
        super().__init__()
        self.model = model
        self.n_layers = model.config.num_hidden_layers
        self.split = split
        self.last_row = last_row
        # transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name is
        # deprecated until 5.40); pass whichever this version's signature names.
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        dtype = past[0].dtype
        additive = torch.where(
            attention_mask, torch.tensor(0.0, dtype=dtype), torch.tensor(torch.finfo(dtype).min, dtype=dtype)
        )[:, None]  # [B, 1, T, C + T], the form transformers accepts as a prepared 4D mask
        inputs = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=additive, use_cache=True,
                      logits_to_keep=1 if self.last_row else 0)
        if self.split:
            cache = SplitCache(past)
            with split_attention(self.model, cache) as extra:
                out = self.model(**inputs, **{self.cache_kwarg: cache}, **extra)
            return (out.logits.float(), *cache.new_kv())
        concat = DynamicCache()
        for i in range(self.n_layers):
            concat.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(**inputs, **{self.cache_kwarg: concat})
        t = input_ids.shape[1]
        new: list[torch.Tensor] = []
        for layer in concat.layers:
            new += [layer.keys[:, :, -t:], layer.values[:, :, -t:]]
        return (out.logits.float(), *new)
