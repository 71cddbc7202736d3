"""Turn generated token ids into text as they arrive, and cut the text at stop strings.

Streaming protocol for one request (``detok`` and ``stops`` are created per request)::

    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
    stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
    sent = 0                                          # characters of output text already streamed
    every step:
        delta = detok.push(new_token_ids)
        text, matched = stops.check(detok.text, len(delta))
        if matched is not None:                       # finish_reason "stop", stop_reason = matched
            stream(text[sent:]); done
        else:
            end = stops.safe_text_end(text)           # never stream a possible stop-string start
            stream(text[sent:end]); sent = end
    on any other finish (EOS, length, abort):
        delta = detok.flush()                         # an incomplete character at the very end, if any
        text, matched = stops.check(detok.text, len(delta))
        stream(text[sent:])

``text[sent:end]`` is always a valid continuation of what was streamed before: the detokenizer never
returns a delta that ends inside a multi-byte character, and ``safe_text_end`` holds back exactly the
tail that a later stop string could still start in (it never moves backwards once the caller keeps
``sent`` monotone, because a held tail is only released when it can no longer become a stop string).
"""

from __future__ import annotations

from collections.abc import Iterable

import tokenizers

_REPLACEMENT = "\ufffd"  # what a lossy UTF-8 decode turns an incomplete byte sequence into


class IncrementalDetokenizer:
    """Incremental ``tokenizer.decode`` of one request's output tokens.

    Each ``push`` decodes only a small window: the ids from ``prefix_offset`` (the start of the last text
    already emitted) to the end, and returns what the window adds past ``decode(ids[prefix_offset:
    read_offset])``. Starting the window a token back reproduces exactly what a full decode gives at token
    boundaries (merged spaces, word-piece joins, byte-level characters split across tokens), at O(window)
    cost per token. While the window's text ends in U+FFFD (a multi-byte character whose remaining bytes
    are in tokens not generated yet) nothing is emitted; the held text comes out with the token that
    completes it. ``flush()`` emits whatever is still held (an incomplete character at the very end, as
    U+FFFD, like a full decode shows it).

    The last few prompt tokens seed the window as context (when they decode to complete characters), so
    the first output token is decoded as a continuation of the prompt: for SentencePiece-style tokenizers
    ("▁Paris") that gives " Paris", which is what a completion must append to the prompt, where a decode
    of the output alone would drop the space. For byte-level BPE (GPT-2, Llama 3, Qwen...) decoding is
    context-free and ``"".join(deltas) + flush() == tokenizer.decode(output_ids, skip_special_tokens)``.
    """

    #: prompt tokens decoded as context for the first output tokens
    CONTEXT_TOKENS = 5
    #: a U+FFFD tail held over this many tokens is not a character in progress (a UTF-8 character has at
    #: most 4 bytes) but invalid bytes; it is emitted rather than making every later decode longer
    MAX_HELD_TOKENS = 32

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        prompt_token_ids: Iterable[int] = (),
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids)[-self.CONTEXT_TOKENS :]
        context_text = self._decode(context) if context else ""
        if context_text.endswith(_REPLACEMENT):
            context, context_text = [], ""
        self._ids: list[int] = context  # context + output ids
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = context_text  # == decode(_ids[_prefix_offset:_read_offset])
        self.token_ids: list[int] = []  # output token ids
        self.text = ""  # output text emitted so far

    @property
    def prefix_offset(self) -> int:
        return self._prefix_offset

    @property
    def read_offset(self) -> int:
        return self._read_offset

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: Iterable[int]) -> str:
        """Append output ``token_ids``; return the text they complete (possibly ``""``)."""
        deltas = []
        for t in token_ids:
            t = int(t)
            self._ids.append(t)
            self.token_ids.append(t)
            delta = self._step(force=len(self._ids) - self._read_offset >= self.MAX_HELD_TOKENS)
            if delta:
                deltas.append(delta)
        delta = "".join(deltas)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit text still held back (only an incomplete or invalid UTF-8 tail can be); call at the end."""
        delta = self._step(force=True) if len(self._ids) > self._read_offset else ""
        self.text += delta
        return delta

    def _step(self, force: bool) -> str:
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or (new_text.endswith(_REPLACEMENT) and not force):
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return delta


class StopStringMatcher:
    """Finds stop strings in a growing output text.

    ``check(text, num_new_chars)`` looks for stop strings that end inside the last ``num_new_chars``
    characters (so a stop string may straddle several tokens / earlier text). When several match, the one
    that *ends* first wins (ties: the one that starts first, i.e. the longer): that is the one a
    character-by-character stream would have completed first, so the result does not depend on how the
    text was split into deltas. Returns ``(text, None)`` when nothing matched, else ``(truncated, stop)``
    where ``truncated`` ends just before the stop string, or just after it with
    ``include_stop_str_in_output``.

    Streaming: the text before ``safe_text_end(text)`` can be sent to the client now; what follows may
    still be cut off by a stop string completed by later tokens. Without ``include_stop_str_in_output``
    that is the longest tail of the text (at most ``holdback = max(len(stop)) - 1`` characters) that is a
    proper prefix of some stop string; with it nothing needs holding back, because a cut then always
    falls after everything that was already in the text.
    """

    def __init__(self, stop: Iterable[str] = (), include_stop_str_in_output: bool = False):
        self.stop: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_len = max((len(s) for s in self.stop), default=0)

    def __bool__(self) -> bool:
        return bool(self.stop)

    @property
    def holdback(self) -> int:
        """The most characters ``safe_text_end`` may hold back."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return self.max_len - 1

    def check(self, text: str, num_new_chars: int) -> tuple[str, str | None]:
        if not self.stop or num_new_chars <= 0:
            return text, None
        new_start = max(0, len(text) - num_new_chars)
        search_from = max(0, new_start - self.max_len + 1)
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stop:
            i = text.find(s, search_from)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is None:
            return text, None
        end, start, s = best
        return (text[:end] if self.include_stop_str_in_output else text[:start]), s

    def safe_text_end(self, text: str) -> int:
        """Length of the prefix of ``text`` that no later stop-string match can remove."""
        n = len(text)
        for i in range(max(0, n - self.holdback), n):
            tail = text[i:]
            if any(s.startswith(tail) for s in self.stop):
                return i
        return n
