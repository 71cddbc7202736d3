"""``make_proposer``: the one place that turns the engine config's speculative settings into a proposer."""

from __future__ import annotations

from torch import nn

from kubellm.runtime.engine.config import EngineConfig
from kubellm.runtime.layers.kernel_choice import KernelChoice
from kubellm.runtime.models.config import ModelConfig
from kubellm.runtime.spec_decode.draft_model import DraftModelProposer, load_draft_model
from kubellm.runtime.spec_decode.eagle import EagleProposer, load_eagle_head
from kubellm.runtime.spec_decode.ngram import NgramProposer
from kubellm.runtime.spec_decode.proposer import Proposer
from kubellm.runtime.text.tokenizer import Tokenizer


def make_proposer(config: EngineConfig, target: nn.Module, target_config: ModelConfig, tokenizer: Tokenizer,
                  max_model_len: int, kernels: KernelChoice, device: str, progress: bool = True) -> Proposer | None:
    """The proposer ``config`` asks for, its draft model or EAGLE head loaded on ``device``; None without
    speculative decoding. ``target`` is the served model, built (an EAGLE head borrows its embedding and LM head),
    ``target_config`` its config and ``tokenizer`` its tokenizer (a draft model must share it). The proposer's
    own KV cache is built later, by ``allocate``, once the engine has sized its own."""
    k = config.num_speculative_tokens
    if config.speculative_ngram:
        return NgramProposer(config.speculative_ngram, k, min_ngram=min(2, config.speculative_ngram))
    if not config.speculative_model:
        return None
    if config.speculative_method == "eagle":
        head, head_config = load_eagle_head(config.speculative_model, target, target_config, config.dtype, device,
                                            max_model_len)
        return EagleProposer(head, head_config, target, config.block_size, config.dtype, device, k,
                             target_config.vocab_size, config.max_num_seqs, kernels, max_model_len)
    draft = load_draft_model(config.speculative_model, tokenizer, config, max_model_len, device, progress)
    return DraftModelProposer(draft, config.block_size, config.dtype, device, k, target_config.vocab_size,
                              config.max_num_batched_tokens, config.enable_prefix_caching)
