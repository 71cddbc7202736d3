"""Incremental detokenization (byte-level BPE, multi-byte characters, special tokens) and stop strings."""

from __future__ import annotations

import random

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, trainers

from kubellm.runtime.text.detokenizer import IncrementalDetokenizer, StopStringMatcher

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["the", "a", "model", "token", "stream", "answer", "quickly", "over", "under", "river"]
WORDS += ["mountain", "café", "naïve", "résumé", "Zürich"]
CJK = ["你好", "世界", "模型", "東京", "日本語", "한국어", "中文字符"]
EMOJI = ["🙂", "🚀", "👍🏽", "🇫🇷", "🧪", "❤️", "👨‍👩‍👧"]
PUNCT = [".", ",", "!", "?", ";", ":", "...", " -", "'s", '"', "(", ")"]


def make_corpus(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(4, 12)):
            r = rng.random()
            if r < 0.6:
                parts.append(rng.choice(WORDS))
            elif r < 0.72:
                parts.append(str(rng.randint(0, 99999)))
            elif r < 0.84:
                parts.append(rng.choice(CJK))
            elif r < 0.92:
                parts.append(rng.choice(EMOJI))
            else:
                parts.append(rng.choice(PUNCT))
        out.append(" ".join(parts).capitalize())
    return out


@pytest.fixture(scope="module")
def bpe() -> tokenizers.Tokenizer:
    """A small GPT-2-style byte-level BPE; rare emoji / CJK stay split over several byte tokens."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(make_corpus(), trainer)
    return tok


def ids_of(tok: tokenizers.Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int] | None = None) -> list[str]:
    """Push ``ids`` one at a time (or in chunks of the given sizes, cycled); return the deltas."""
    deltas, i, k = [], 0, 0
    while i < len(ids):
        size = chunks[k % len(chunks)] if chunks else 1
        deltas.append(detok.push(ids[i : i + size]))
        i, k = i + size, k + 1
    return deltas


# ----------------------------------------------------------------------------------------------------
# IncrementalDetokenizer
# ----------------------------------------------------------------------------------------------------
TEXTS = [
    "The model answered quickly over the river.",
    "Café naïve résumé in Zürich costs 12345.67!",
    "你好，世界！日本語のテキストと中文字符。",
    "Emoji: 🙂🚀 👍🏽 🇫🇷 🧪 ❤️ 👨‍👩‍👧 and 🦜 (rare) 𝔘𝔫𝔦𝔠𝔬𝔡𝔢.",
    "  leading spaces, tabs\tand\nnewlines\n\n  ",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_text(bpe, text):
    ids = ids_of(bpe, text)
    assert bpe.decode(ids) == text
    detok = IncrementalDetokenizer(bpe, ids_of(bpe, "<|im_start|>assistant\n"))
    deltas = stream(detok, ids)
    assert "".join(deltas) == text == detok.text
    assert detok.flush() == ""
    assert detok.token_ids == ids
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_character_split_over_tokens_is_held_back(bpe):
    text = "a🦜b"  # not in the training corpus: the parrot's 4 UTF-8 bytes are separate tokens
    ids = ids_of(bpe, text)
    pieces = [bpe.decode([i]) for i in ids]
    assert "\ufffd" in "".join(pieces), "the emoji should be split across tokens"
    detok = IncrementalDetokenizer(bpe, [])
    deltas = stream(detok, ids)
    assert "".join(deltas) == text
    assert "🦜" in deltas or "🦜b" in deltas
    assert "" in deltas  # held while incomplete
    for d in deltas:
        assert not d.endswith("\ufffd")


def test_incomplete_tail_is_flushed(bpe):
    ids = ids_of(bpe, "ok 🦜")[:-1]  # stop in the middle of the emoji
    full = bpe.decode(ids)
    assert full.endswith("\ufffd")
    detok = IncrementalDetokenizer(bpe, [])
    pushed = "".join(stream(detok, ids))
    assert pushed.startswith("ok") and not pushed.endswith("\ufffd")
    tail = detok.flush()
    assert tail.endswith("\ufffd") and pushed + tail == full == detok.text
    assert detok.flush() == ""


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(bpe, skip):
    im_end = bpe.token_to_id("<|im_end|>")
    ids = ids_of(bpe, "Hello there") + [im_end] + ids_of(bpe, " world")
    detok = IncrementalDetokenizer(bpe, [], skip_special_tokens=skip)
    text = "".join(stream(detok, ids))
    assert text == bpe.decode(ids, skip_special_tokens=skip)
    assert text == ("Hello there world" if skip else "Hello there<|im_end|> world")


def test_prompt_ending_mid_character_is_not_used_as_context(bpe):
    prompt = ids_of(bpe, "question 🦜")[:-2]  # the prompt stops inside the emoji's bytes
    assert bpe.decode(prompt).endswith("\ufffd")
    out = ids_of(bpe, "answer: 东京")
    detok = IncrementalDetokenizer(bpe, prompt)
    assert "".join(stream(detok, out)) == bpe.decode(out)


def test_decode_window_stays_small(bpe):
    """Each step decodes a few tokens, not the whole output (O(window) per token)."""
    calls: list[int] = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return bpe.decode(ids, skip_special_tokens=skip_special_tokens)

    text = " ".join(make_corpus(100, seed=5))
    ids = ids_of(bpe, text)
    assert len(ids) > 500
    detok = IncrementalDetokenizer(Counting(), ids_of(bpe, "prompt text here"))
    assert "".join(stream(detok, ids)) == text
    assert max(calls) <= IncrementalDetokenizer.CONTEXT_TOKENS + 8
    assert len(calls) <= 2 * len(ids) + 2


def test_sentencepiece_style_first_token_keeps_its_space():
    """With a Metaspace tokenizer the first output token continues the prompt (" Paris", not "Paris")."""
    corpus = ["The capital of France is Paris.", "Hello world, this is a test of the tokenizer."] * 20
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"], show_progress=False)
    )
    prompt = tok.encode("The capital of France is").ids
    out = tok.encode(" Paris. Hello world").ids
    detok = IncrementalDetokenizer(tok, prompt)
    text = "".join(stream(detok, out))
    full = tok.decode(prompt + out)
    assert text == full[len(tok.decode(prompt)) :] == " Paris. Hello world"
    # Without a prompt it is exactly the standalone decode.
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(stream(detok, out)) == tok.decode(out) == "Paris. Hello world"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_token_streams_match_full_decode(bpe, data):
    vocab = bpe.get_vocab_size()
    ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=60), label="ids")
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=5), label="chunks")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    prompt = data.draw(
        st.sampled_from([[], ids_of(bpe, "Hi there"), ids_of(bpe, "<|im_start|>user\n你好🙂")])
    )
    detok = IncrementalDetokenizer(bpe, prompt, skip_special_tokens=skip)
    deltas = stream(detok, ids, chunks)
    full = bpe.decode(ids, skip_special_tokens=skip)
    tail = detok.flush()
    assert "".join(deltas) + tail == full == detok.text
    if not full.endswith("\ufffd"):
        assert tail == ""  # a stream that ends on complete characters is fully emitted by push
    for d in deltas:
        assert not d.endswith("\ufffd")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40), data=st.data())
def test_random_unicode_text_roundtrips(bpe, text, data):
    ids = ids_of(bpe, text)
    chunks = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=4), label="chunks")
    detok = IncrementalDetokenizer(bpe, ids_of(bpe, "prompt: "))
    deltas = stream(detok, ids, chunks)
    tail = detok.flush()
    assert "".join(deltas) + tail == bpe.decode(ids) == text
    # A genuine U+FFFD at the very end looks like an incomplete character: held until flush().
    assert tail == "" or text.endswith("\ufffd")


# ----------------------------------------------------------------------------------------------------
# StopStringMatcher
# ----------------------------------------------------------------------------------------------------
def feed(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, str | None, str]:
    """Stream ``deltas`` through the matcher as a server would; returns (final text, stop, streamed text)."""
    text, sent = "", 0
    streamed = ""
    for delta in deltas:
        text += delta
        out, stop = matcher.check(text, len(delta))
        if stop is not None:
            assert out.startswith(streamed)  # nothing streamed earlier is taken back
            return out, stop, out
        end = matcher.safe_text_end(out)
        assert end >= sent
        streamed += out[sent:end]
        sent = end
    return text, None, text


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_straddling_tokens(include):
    m = StopStringMatcher(["STOP"], include_stop_str_in_output=include)
    text, stop, _ = feed(m, ["Hel", "lo S", "T", "OP and more", " text"])
    assert stop == "STOP"
    assert text == ("Hello STOP" if include else "Hello ")


def test_stop_string_inside_one_delta():
    m = StopStringMatcher(["\n\n"])
    assert m.check("abc\n\ndef", 8) == ("abc", "\n\n")
    # Text checked before is not searched again (only matches that reach into the new chars count) ...
    assert m.check("abc\n\ndef", 3) == ("abc\n\ndef", None)
    # ... but a match that overlaps the new chars is found even if it starts in older text:
    assert m.check("abc\n\n", 1) == ("abc", "\n\n")


def test_no_stop_strings():
    m = StopStringMatcher([])
    assert not m and m.holdback == 0
    assert m.check("anything", 3) == ("anything", None)
    assert m.safe_text_end("anything") == 8


def test_earliest_ending_match_wins():
    m = StopStringMatcher(["abc", "b"])
    assert m.check("xabcd", 5) == ("xa", "b")  # "b" completes before "abc" does
    m = StopStringMatcher(["cd", "xabcd"], include_stop_str_in_output=True)
    assert m.check("zxabcde", 7) == ("zxabcd", "xabcd")  # both end at 6: the one starting first
    m = StopStringMatcher(["world", "hello"])
    assert m.check("say hello world", 15) == ("say ", "hello")


def test_holdback_and_safe_text_end():
    m = StopStringMatcher(["STOP", "ab"])
    assert m.holdback == 3
    assert m.safe_text_end("hello") == 5
    assert m.safe_text_end("hello S") == 6
    assert m.safe_text_end("hello ST") == 6
    assert m.safe_text_end("hello STO") == 6
    assert m.safe_text_end("hello SX") == 8
    assert m.safe_text_end("xa") == 1
    assert m.safe_text_end("") == 0
    assert m.safe_text_end("STO") == 0
    # Only tails that could still grow into a stop string are held back (not a blanket max_len - 1).
    assert m.safe_text_end("hello TOP") == 9
    inc = StopStringMatcher(["STOP"], include_stop_str_in_output=True)
    assert inc.holdback == 0 and inc.safe_text_end("hello STO") == 9


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc d", max_size=30),
    stops=st.lists(st.text(alphabet="abc d", min_size=1, max_size=4), max_size=3),
    include=st.booleans(),
    cuts=st.lists(st.integers(1, 5), min_size=1, max_size=6),
)
def test_stop_matching_independent_of_chunking(text, stops, include, cuts):
    m = StopStringMatcher(stops, include)
    by_char = feed(m, list(text))
    deltas, i, k = [], 0, 0
    while i < len(text):
        deltas.append(text[i : i + cuts[k % len(cuts)]])
        i, k = i + cuts[k % len(cuts)], k + 1
    chunked = feed(m, deltas)
    assert chunked[:2] == by_char[:2]
    final, stop, _ = by_char
    if stop is None:
        assert final == text and not any(s in text for s in stops)
    else:
        cut = len(final) - (len(stop) if include else 0)
        assert text[cut : cut + len(stop)] == stop
        assert not any(s in text[: cut + len(stop) - 1] for s in stops)  # nothing completed earlier
