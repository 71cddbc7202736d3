"""Structured outputs: JSON schema, JSON object, regex, choice and grammars, enforced token by token.

The grammar engine is llguidance (docs/architecture.md says why: no dependencies, CPU-native Rust, masks in
tens of microseconds per token, JSON Schema / regex / Lark / GBNF). Per request: a ``GuidedDecoding`` spec in
``SamplingParams`` → one ``LLMatcher`` on its ``Sequence``. Per step: the masks of every constrained row are
computed on a side thread while the model's forward pass runs (llguidance drops the GIL), then the sampler
applies them to the whole batch at once. After each token the matcher advances; a grammar that can take no
more tokens ends the sequence with finish_reason "stop".
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import re
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar", "lark")  # lark: never read as GBNF
# Compact JSON (no free whitespace): a model cannot wander into endless spaces, and the output is the same data.
JSON_OPTIONS = {"whitespace_flexible": False}


class InvalidGuidedDecoding(ValueError):
    """The schema, regex or grammar cannot be compiled; ``param`` names the request field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class GuidedDecoding:
    """What the output must match. ``value``: a JSON schema (dict), None (json_object), a regex, a list of
    strings (choice), or a Lark / GBNF grammar (text). ``param`` is the request field it came from."""

    kind: Literal["json", "json_object", "regex", "choice", "grammar", "lark"]
    value: Any = None
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidGuidedDecoding(self.param, f"unknown kind {self.kind!r}; one of {', '.join(KINDS)}")

    @functools.cached_property
    def grammar(self) -> str:
        """The llguidance grammar (JSON text) for this spec."""
        import llguidance

        m = llguidance.LLMatcher
        try:
            if self.kind == "json":
                if not isinstance(self.value, dict | bool):
                    raise InvalidGuidedDecoding(self.param, "the JSON schema must be an object")
                return m.grammar_from_json_schema(self.value, defaults=JSON_OPTIONS)
            if self.kind == "json_object":
                return m.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            if self.kind == "regex":
                return m.grammar_from_regex(_text(self.value, self.param))
            if self.kind == "choice":
                if not isinstance(self.value, list) or not self.value or not all(
                        isinstance(c, str) and c for c in self.value):
                    raise InvalidGuidedDecoding(self.param, "choice must be a non-empty list of non-empty strings")
                return m.grammar_from_regex("|".join(re.escape(c) for c in self.value))
            from llguidance.gbnf_to_lark import gbnf_to_lark

            text = _text(self.value, self.param)
            if self.kind == "grammar" and "::=" in text:  # GBNF (llama.cpp / xgrammar's notation)
                text = gbnf_to_lark(text)
            return m.grammar_from_lark(text)
        except (ValueError, TypeError) as e:
            if isinstance(e, InvalidGuidedDecoding):
                raise
            raise InvalidGuidedDecoding(self.param, str(e)) from e


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidGuidedDecoding(param, "must be a non-empty string")
    return value


class StructuredOutputs:
    """The engine's grammar state: the llguidance tokenizer, compiled-grammar checks, per-step masks."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance

        backend = copy.copy(tokenizer.tk)  # llguidance wants the tokenizer JSON without padding/truncation
        backend.no_padding()
        backend.no_truncation()
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                                eos_token=sorted(tokenizer.eos_token_ids) or None)
        self._executor = llguidance.LLExecutor()
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._words = (vocab_size + 31) // 32
        self._checked: dict[str, str] = {}

    def check(self, spec: GuidedDecoding) -> None:
        """Raise InvalidGuidedDecoding if the spec does not compile (cached per grammar)."""
        import llguidance

        grammar = spec.grammar
        if grammar not in self._checked:
            if len(self._checked) > 1024:
                self._checked.clear()
            self._checked[grammar] = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error := self._checked[grammar]:
            raise InvalidGuidedDecoding(spec.param, error.strip())

    def matcher(self, spec: GuidedDecoding):
        import llguidance

        m = llguidance.LLMatcher(self.tokenizer, spec.grammar)
        if m.is_error():
            raise InvalidGuidedDecoding(spec.param, m.get_error())
        return m

    def start_masks(self, seqs: list) -> concurrent.futures.Future | None:
        """Begin computing the allowed-token mask [len(seqs), vocab] (bool; None when no row is constrained).
        Runs on a side thread so it overlaps the forward pass; ``.result()`` before sampling."""
        rows = [(s.grammar, i) for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return None
        return self._thread.submit(self._masks, rows, len(seqs))

    def _masks(self, rows: list[tuple], batch: int) -> torch.Tensor:
        bits = np.full((batch, self._words), -1, dtype=np.int32)  # unconstrained rows: every bit set
        self._executor.unsafe_compute_mask_ptr(rows, bits.ctypes.data, self._words * 4, batch)
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]
        return torch.from_numpy(allowed.view(np.bool_))

    def close(self) -> None:
        self._thread.shutdown(wait=False)

