"""Text ↔ token ids and chat templates, over a `tokenizers` fast tokenizer (no transformers)."""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kubellm.runtime.models.checkpoint import Checkpoint


class ChatTemplateError(ValueError):
    """The messages could not be rendered with the model's chat template (or it has none)."""


# What apply_chat_template passes the template itself; extra template kwargs may not replace them.
TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


def _token_str(value) -> str | None:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise(message: str):
    raise ChatTemplateError(message)


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character each byte is written as, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class Tokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, tokenizer_config: dict | None = None,
                 generation_config: dict | None = None, model_config: dict | None = None):
        self.tk = tokenizer
        tc = tokenizer_config or {}
        self.chat_template: str | None = tc.get("chat_template")
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self.bos_token = _token_str(tc.get("bos_token"))
        self.eos_token = _token_str(tc.get("eos_token"))
        self.add_bos_token = bool(tc.get("add_bos_token", False))
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_ids = self._eos_ids(generation_config or {}, model_config or {})
        self._template: jinja2.Template | None = None

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> Tokenizer:
        return cls(ckpt.tokenizer, ckpt.tokenizer_config, ckpt.generation_config, ckpt.config)

    def _eos_ids(self, generation_config: dict, model_config: dict) -> frozenset[int]:
        ids: set[int] = set()
        for source in (generation_config.get("eos_token_id"), model_config.get("eos_token_id")):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list):
                ids.update(i for i in source if isinstance(i, int))
        if self.eos_token:
            tid = self.tk.token_to_id(self.eos_token)
            if tid is not None:
                ids.add(tid)
        return frozenset(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch_fast lets go of the GIL while it works (encode held it: the event loop stood still for
        # the second a 1.5 MB prompt took), and skips the character offsets nobody here reads.
        ids = self.tk.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        # Some tokenizer.json files carry no BOS post-processor although the config asks for BOS.
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None and (
                not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one tokenizer per process, ids are few
    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (a piece of a UTF-8 character possibly), for logprobs."""
        piece = self.tk.id_to_token(token_id)
        if piece is None:
            return b""
        if m := _BYTE_FALLBACK.match(piece):  # SentencePiece byte fallback
            return bytes([int(m.group(1), 16)])
        table = _byte_level_decoder()
        if self.tk.token_to_id(piece) is not None and self._byte_level and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return self.tk.decode([token_id], skip_special_tokens=False).encode()

    def token_text(self, token_id: int) -> str:
        """One token as text (U+FFFD where it holds part of a character), as OpenAI's logprobs show it."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The longest vocabulary piece in characters: no token stands for more input than this (byte-fallback
        and byte-level pieces are at least as long as what they stand for), so a text longer than
        ``n * max_chars_per_token`` cannot fit in n tokens."""
        return max((len(piece) for piece in self.tk.get_vocab(with_added_tokens=True)), default=1)

    @functools.cached_property
    def _byte_level(self) -> bool:
        return "ByteLevel" in json.dumps(json.loads(self.tk.to_str()).get("decoder") or {})

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, /,
                            **kwargs) -> str:
        """Render messages to the prompt text the model was trained on."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use the completions API instead")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"the model's chat template does not compile: {e}") from e
        if clash := sorted(TEMPLATE_VARIABLES & kwargs.keys()):
            raise ChatTemplateError(f"template kwargs may not set {', '.join(clash)}: the server sets them")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except ChatTemplateError:
            raise
        except Exception as e:  # noqa: BLE001 - the template ran on the client's values (a str where it calls...)
            raise ChatTemplateError(f"cannot render the chat template: {type(e).__name__}: {e}") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, /, **kwargs) -> list[int]:
        # The template writes any BOS it wants itself (as transformers assumes); don't add a second.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs), add_special_tokens=False)
