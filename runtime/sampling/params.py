"""Per-request sampling and stopping parameters (what the OpenAI API exposes, plus vLLM's extras)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubellm.runtime.sampling.structured_output import GuidedDecoding

MAX_LOGPROBS = 20  # top log-probabilities per token a request may ask for (vLLM's default max_logprobs)


class InvalidSamplingParams(ValueError):
    """A parameter is out of range; the message names it and the allowed range."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature == 0 means greedy (argmax); top_k <= 0 (or -1) disables top-k; top_p == 1 and
    min_p == 0 disable those filters. A seed makes sampling reproducible per request regardless of
    what else is in the batch.
    """

    max_tokens: int | None = 16  # None: until the context length is reached
    min_tokens: int = 0  # EOS and stop_token_ids are suppressed until this many tokens exist
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Log-probabilities of the processed distribution (after penalties, logit_bias and min_tokens; before the
    # grammar mask, temperature and top-k/top-p/min-p): None = none; k >= 0 = the chosen token's plus the top k.
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (no prefix cache)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    guided: GuidedDecoding | None = None  # structured output: the text must match this schema/regex/grammar

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        """Any of repetition, presence or frequency penalty is set (the sampler then counts tokens)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> None:
        def bad(param: str, msg: str) -> InvalidSamplingParams:
            return InvalidSamplingParams(param, msg)

        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise bad("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "each stop sequence must be a non-empty string")
        if len(self.stop) > 16:
            raise bad("stop", f"at most 16 stop sequences, got {len(self.stop)}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not (isinstance(k, int) and 0 <= k <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        for t, b in (self.logit_bias or {}).items():
            if not isinstance(t, int) or t < 0:
                raise bad("logit_bias", f"keys must be token ids (non-negative integers), got {t!r}")
            if not -100.0 <= b <= 100.0:
                raise bad("logit_bias", f"values must be in [-100, 100], got {b} for token {t}")
