"""Log-probabilities in OpenAI's two shapes: completions (parallel lists) and chat (one entry per token).

Values are the engine's: log-softmax of the processed logits (after penalties, logit_bias and min_tokens,
before the grammar mask, temperature and top-k/top-p/min-p). JSON has no -inf, so -inf becomes -9999.0, as
vLLM writes it.
"""

from __future__ import annotations

from kubellm.runtime.sampling.sampler import TokenLogprobs

FLOOR = -9999.0


def _finite(v: float) -> float:
    return v if v > FLOOR else FLOOR


def completion_logprobs(tokenizer, token_ids: list[int], entries: list[TokenLogprobs | None],
                        text_offset: int) -> tuple[dict, int]:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` and the offset after the last token.

    An entry of None (the first prompt token under ``echo``) gives null logprob and top_logprobs.
    """
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(token_ids, entries, strict=True):
        text = tokenizer.token_text(token)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_finite(entry.logprob))
        out["top_logprobs"].append({tokenizer.token_text(t): _finite(v) for t, v in entry.top})
    return out, text_offset


def chat_logprobs(tokenizer, token_ids: list[int], entries: list[TokenLogprobs]) -> dict:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...], "refusal": None}``."""

    def item(token: int, value: float) -> dict:
        raw = tokenizer.token_bytes(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": _finite(value), "bytes": list(raw)}

    content = [{**item(t, e.logprob), "top_logprobs": [item(i, v) for i, v in e.top]}
               for t, e in zip(token_ids, entries, strict=True)]
    return {"content": content, "refusal": None}
