"""Wraps a transformers causal LM so that its KV cache and attention mask are explicit tensors.

We reuse transformers' own modules (attention, RoPE, norms) rather than re-deriving each
architecture: the wrapper only moves the cache and the mask to the graph boundary. The model is
fed a cache that already holds all C slots; it appends the T new tokens' KV, and the mask (built by
the host) says which of the C + T keys each new token may see.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


class ExplicitKVWrapper(torch.nn.Module):
    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model
        self.n_layers = model.config.num_hidden_layers

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        cache = DynamicCache()
        for i in range(self.n_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        dtype = past[0].dtype
        additive = torch.where(
            attention_mask, torch.tensor(0.0, dtype=dtype), torch.tensor(torch.finfo(dtype).min, dtype=dtype)
        )[:, None]  # [B, 1, T, C + T], the form transformers accepts as a prepared 4D mask
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=additive,
            past_key_values=cache,
            use_cache=True,
        )
        t = input_ids.shape[1]
        new: list[torch.Tensor] = []
        for layer in cache.layers:
            new += [layer.keys[:, :, -t:], layer.values[:, :, -t:]]
        return (out.logits.float(), *new)
