"""The artifact's tokenizer on the `tokenizers` library alone: the runtime imports neither torch nor transformers.

The exporter saves the checkpoint's fast tokenizer (tokenizer.json, whose post-processor adds
BOS/EOS as transformers does) and tokenizer_config.json (special tokens, chat template). This
class offers the part of transformers' tokenizer interface the runtime uses, with the same
results (tested against transformers): `tok(text)["input_ids"]`, `decode`, `eos_token_id`,
`chat_template` and `apply_chat_template` (rendered in a Jinja sandbox as transformers does).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as Backend

SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token(value: object) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    """A chat template compiled once (compiling took 1.2 ms, on every request of a server)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


class Tokenizer:
    def __init__(self, folder: Path) -> None:
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise OSError(f"{folder} has no tokenizer.json (the runtime reads fast tokenizers only)")
        self.backend = Backend.from_file(str(folder / "tokenizer.json"))
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.special = {k: _token(config[k]) for k in SPECIAL if _token(config.get(k)) is not None}
        self.chat_template: str | None = config.get("chat_template")
        template_file = folder / "chat_template.jinja"
        if self.chat_template is None and template_file.is_file():
            self.chat_template = template_file.read_text()
        eos = self.special.get("eos_token")
        self.eos_token_id = self.backend.token_to_id(eos) if eos is not None else None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.backend.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        # transformers 5 applies no clean_up_tokenization to a fast tokenizer's decode; neither do we
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = True, add_generation_prompt: bool = False,
                            return_dict: bool = False) -> list[int] | str:
        if return_dict:
            raise ValueError("return_dict=True is not supported: the runtime's tokenizer returns token ids")
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        text = _compiled(self.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                    **self.special)
        if not tokenize:
            return text
        return self(text, add_special_tokens=False)["input_ids"]
