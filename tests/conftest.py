"""Tiny models built from configs with fixed seeds, saved as local checkpoints; never downloaded."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    CodeGenConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

import runtime
from common import graph_io
from common.recipe import ModelSpec, Recipe
from export.pipeline import build_artifact
from recipes.default_pair import byte_tokenizer

VOCAB = 260
COMMON = dict(vocab_size=VOCAB, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=3)
CONFIGS = {
    "llama-gqa": lambda: LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, **COMMON),
    "llama-tied": lambda: LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4,
                                      tie_word_embeddings=True, **COMMON),
    "mistral": lambda: MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, sliding_window=4096,
                                     **COMMON),
    "qwen2": lambda: Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, **COMMON),
    "codegen": lambda: CodeGenConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, **COMMON),
    "draft": lambda: LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, **COMMON),
}


def make_model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    config = CONFIGS[kind]()
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).eval()
    # Random init gives near-uniform logits; sharpen them so greedy paths are decisive.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def save_checkpoint(kind: str, path: Path, seed: int = 0) -> Path:
    make_model(kind, seed).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def fewest_calls(monkeypatch):
    """Call plans as if no graph cost had been measured: the fewest calls. Tests that count calls use
    it, so that they do not depend on the costs the compiler measured on this machine."""
    from runtime.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "plan", lambda self, rows, max_rows=None, last_row=False: graph_io.plan_calls(
        {name: (g.tokens, 0.0) for name, g in self.entries.items()}, rows, max_rows))


def always_draft(self, offers, rows=1, live=1):
    """A stand-in for the cost-based draft policy: every offer drafts the longest length it can (a fixed
    policy its own)."""
    return [self.fit(self.fixed or max(self.lengths), most) for _, most in offers]


def set_costs(art, role: str, cost) -> None:
    """Pretend the compiler measured cost(T) ms for each graph of `role` in a loaded artifact."""
    graphs = art.manifest.models[role].graphs
    for name, g in list(graphs.items()):
        graphs[name] = replace(g, cost_ms=cost(g.tokens))


def recipe_file(path: Path, model: Path, context: int = 64) -> Path:
    """A minimal TLM-only recipe TOML at `path`, for the export CLI."""
    path.write_text(f'name = "cli"\nprefill_chunk = 8\ncontext_length = {context}\nmax_prompt_length = '
                    f'{context // 2}\nspeculative = false\n[tlm]\nmodel = "{model}"\n')
    return path


def tiny_recipe(**overrides) -> Recipe:
    fields = dict(
        name="tiny-test", tlm=ModelSpec(model="unused"), dlm=ModelSpec(model="unused"), k=3,
        prefill_chunk=8, context_length=96, max_new_tokens=64,
        speculative=False,
    )
    fields.update(overrides)
    if "max_prompt_length" not in overrides:  # prompts up to the context limit, unless a test sets one
        fields["max_prompt_length"] = fields["context_length"] - 1
    return Recipe(**fields)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {kind: save_checkpoint(kind, root / kind, seed=i) for i, kind in enumerate(CONFIGS)}


@pytest.fixture(scope="session")
def artifact_dir(tmp_path_factory, checkpoints) -> Path:
    """A compiled TLM (llama-gqa) + DLM (draft) artifact shared by the runtime tests."""
    out = tmp_path_factory.mktemp("art") / "tiny"
    return build_artifact(
        tiny_recipe(), out, tlm=str(checkpoints["llama-gqa"]), dlm=str(checkpoints["draft"]),
        progress=False,
    )


FORMATS = {
    "float32": ModelSpec(model=""),
    "float16": ModelSpec(model="", dtype="float16"),
    "mx-fused": ModelSpec(model="", mx_format="fp6_e2m3", mx_lowering="fused"),
    "mx-native": ModelSpec(model="", mx_format="fp6_e2m3", mx_lowering="native"),
    "mx-native8": ModelSpec(model="", mx_format="fp6_e2m3"),  # the default lowering: int8 activations
    "mx-exact": ModelSpec(model="", mx_format="fp6_e2m3", mx_lowering="exact"),
}


@pytest.fixture(scope="session")
def flat(tmp_path_factory):
    """llama-gqa with its random-init, near-uniform logits (not sharpened): near-ties everywhere."""
    torch.manual_seed(11)
    path = tmp_path_factory.mktemp("flat") / "ck"
    AutoModelForCausalLM.from_config(CONFIGS["llama-gqa"]()).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


_built: dict = {}


def artifact(flat, checkpoints, tmp_path_factory, fmt: str, invariant: bool = True, dlm: bool = False):
    """The `flat` TLM compiled in weight format `fmt` (FORMATS), with the draft model as DLM if `dlm`;
    built once per session."""
    key = (fmt, invariant, dlm)
    if key not in _built:
        recipe = replace(tiny_recipe(), tlm=FORMATS[fmt], dlm=ModelSpec(model="") if dlm else None,
                         batch_invariant=invariant, speculative=False)
        out = tmp_path_factory.mktemp("inv") / f"{fmt}-{invariant}-{dlm}"
        _built[key] = runtime.load_artifact(build_artifact(recipe, out, tlm=str(flat),
                                                           dlm=str(checkpoints["draft"]) if dlm else None,
                                                           progress=False))
    return _built[key]


@contextmanager
def live_server(app) -> Iterator[str]:  # noqa: ANN001 - an ASGI app
    """`app` served by uvicorn on a free loopback port for the block; yields its /v1 base URL."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(10)
