"""Speculative decoding with an EAGLE head: one extra decoder layer drafts from the served model's hidden states.

An EAGLE-1 head (Li et al. 2024; checkpoints such as yuhuili/EAGLE-LLaMA3-Instruct-8B) predicts the served
model's next final hidden state from the current one and the embedding of the token that state chose:
``h' = layers(fc(cat(embed(t[j+1]), f[j])))`` at position ``j``, where ``f[j]`` is the served model's hidden
state after its final norm at position ``j``. The served model's LM head turns ``h'`` into the draft for
position ``j + 2``; the next draft feeds ``(draft, h')`` back (a chain of ``k``, no tree). The embedding and the
LM head are the served model's, so the head is small: ``fc`` [hidden, 2*hidden], then Llama decoder layers
whose first has no input norm, no final norm (the checkpoint's ``layers.0.input_layernorm`` / ``norm`` are
used when present).

Checkpoint layout (a folder): config.json (a Llama config, ``num_hidden_layers`` usually 1) and the weights as
``model.safetensors`` (or shards) or ``pytorch_model.bin``, named ``fc.weight`` (``fc.bias`` optional),
``layers.N.self_attn.{q,k,v,o}_proj.weight``, ``layers.N.mlp.{gate,up,down}_proj.weight``,
``layers.N.post_attention_layernorm.weight``; an ``embed_tokens.weight`` copy of the served model's embedding
is checked and skipped. EAGLE-3 heads (three fused layers' features, their own reduced vocabulary) are refused.

The head's K/V live in its own pool indexed by the *served model's* block ids: position ``p`` of a sequence
holds the head's pair ``(t[p+1], f[p])`` in block ``block_table[p // block_size]`` of the head's pool. So a
prefix-cache hit of the served model is one of the head too, preemption frees both, and there is no second
block manager. The pairs are computed in the step that computes ``f`` (after sampling, when ``t[p+1]`` is
known: every position the served model computed this step, prefill chunks and accepted drafts alike), so the
head's cache always covers exactly what the served model's does. The pair at the last position of a block
depends on the first token of the next block, which the block's hash does not cover: the engine's block
manager gives back the last block of every hit (``recompute_last_hit_block``) so that pair is recomputed.
Chained drafts write their pairs beyond the computed positions (never read as context later: the next step's
pairs overwrite them), in the sequence's own blocks or in scratch blocks after the pool's end.

Drafts for the next step are made right after this step's pairs: the catch-up forward's last row drafts the
first token, ``k - 1`` single-row forwards the rest. Greedy requests draft the argmax; sampled requests draw
from the head's distribution ``q`` under the request's sampling parameters and hand ``q`` to verification,
which applies the rejection rule (``verification.verify_sampled_drafts``), so the output distribution is the
served model's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from torch import nn

from kubellm.runtime.distributed.tp_group import Group
from kubellm.runtime.engine.model_runner import ModelRunner, chunk_starts, kv_block_bytes
from kubellm.runtime.engine.scheduler import ScheduledSeq
from kubellm.runtime.engine.sequence import Sequence
from kubellm.runtime.layers.kernel_choice import KernelChoice
from kubellm.runtime.layers.rotary import RotaryEmbedding
from kubellm.runtime.models.checkpoint import CheckpointError
from kubellm.runtime.models.config import ModelConfig
from kubellm.runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM, RMSNorm
from kubellm.runtime.sampling.sampler import Sampler
from kubellm.runtime.spec_decode.proposer import Draft, Proposer, draft_room, draw_drafts, speculable

log = logging.getLogger("kubellm.eagle")

# Served models whose hidden states an EAGLE-1 Llama head can read: the embedding enters unscaled (Gemma
# scales it inside the model, which the head would not see).
EAGLE_TARGETS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class EagleHeadError(CheckpointError):
    """The EAGLE head does not fit the served model (or is no EAGLE-1 head); the message says what differs."""


class EagleHead(nn.Module):
    """``fc`` and the decoder layers of an EAGLE-1 head; the served model's embedding and LM head are borrowed.

    Parameters live under ``model.`` (``model.fc``, ``model.layers``) so :class:`ModelRunner` wires its KV
    pool into ``model.layers`` as for any model; checkpoint names get that prefix when loaded."""

    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    parameter_of = LlamaForCausalLM.parameter_of

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int, fc_bias: bool,
                 input_norm: list[bool], final_norm: bool):
        super().__init__()
        self.config = dataclasses.replace(cfg, tie_word_embeddings=False)
        self.tp = Group()
        self.model = nn.Module()
        self.model.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.model.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.model.layers = nn.ModuleList(LlamaDecoderLayer(cfg, self.model.rotary, self.tp)
                                          for _ in range(cfg.num_layers))
        for layer, has_norm in zip(self.model.layers, input_norm, strict=True):
            if not has_norm:  # EAGLE drops the first layer's input norm: fc's output enters as it is
                layer.input_layernorm = nn.Identity()
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if final_norm else None
        self._embed: nn.Module | None = None  # the served model's, set by borrow() (kept out of parameters)

    def borrow(self, target: LlamaForCausalLM) -> None:
        self.__dict__["_embed"] = target.model.embed_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, features: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T], features [T, hidden] (the served model's final hidden states one position
        earlier) → the predicted next hidden states [T, hidden]."""
        m = self.model
        embeds = self._embed(input_ids)
        hidden, residual = m.fc(torch.cat((embeds, features.to(embeds.dtype)), dim=-1)), None
        for layer in m.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden = hidden + residual
        return m.norm(hidden) if m.norm is not None else hidden

    load_weights = LlamaForCausalLM.load_weights


# ---- loading ---------------------------------------------------------------------------------------------------
def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise EagleHeadError(f"no weights in {folder}: an EAGLE head needs *.safetensors or pytorch_model.bin")
    out = {}
    for f in bins:
        out.update(torch.load(f, map_location="cpu", weights_only=True))  # tensors only: no pickled code runs
    return out


def _check_fits(config: dict, tensors: dict[str, torch.Tensor], target: ModelConfig, source: str) -> None:
    """Refuse, with what differs, a head that is not EAGLE-1 or was not made for the served model's shapes."""
    archs = config.get("architectures") or []
    if any("eagle3" in a.lower() for a in archs) or "draft_vocab_size" in config or "d2t" in tensors:
        raise EagleHeadError(f"{source} is an EAGLE-3 head; kubellm loads EAGLE-1 heads only "
                             "(fc [hidden, 2*hidden] over the embedding and the last hidden state)")
    if target.architecture not in EAGLE_TARGETS:
        raise EagleHeadError(f"EAGLE heads draft for {', '.join(EAGLE_TARGETS)}; the served model is "
                             f"{target.architecture}")
    h = config.get("hidden_size")
    if h != target.hidden_size:
        raise EagleHeadError(f"{source}: the head's hidden_size is {h} but the served model's is "
                             f"{target.hidden_size}; an EAGLE head only drafts for the model it was trained on")
    if config.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise EagleHeadError(f"{source}: the head's vocab_size is {config.get('vocab_size')} but the served "
                             f"model's is {target.vocab_size}; an EAGLE head uses the served model's vocabulary")
    fc = tensors.get("fc.weight")
    if fc is None:
        raise EagleHeadError(f"{source} has no fc.weight: not an EAGLE head (tensors: "
                             f"{', '.join(sorted(tensors)[:5])}...)")
    if tuple(fc.shape) != (h, 2 * h):
        raise EagleHeadError(f"{source}: fc.weight has shape {list(fc.shape)}, an EAGLE head for hidden size {h} "
                             f"needs [{h}, {2 * h}] (the embedding and the hidden state, concatenated)")
    embed = tensors.get("embed_tokens.weight")
    if embed is not None and tuple(embed.shape) != (target.vocab_size, h):
        raise EagleHeadError(f"{source}: embed_tokens.weight has shape {list(embed.shape)}, the served model's "
                             f"embedding is [{target.vocab_size}, {h}]")


def load_eagle_head(name_or_path: str, target: LlamaForCausalLM, target_cfg: ModelConfig, dtype: torch.dtype,
                    device: str, max_model_len: int) -> tuple[EagleHead, ModelConfig]:
    """Read an EAGLE-1 head folder, check it fits the served model, build it on ``device`` borrowing the served
    model's embedding (its LM head is the served model's ``compute_logits``)."""
    from kubellm.runtime.models.store import resolve

    folder = resolve(name_or_path)
    source = str(folder)
    if not folder.is_dir() or not (folder / "config.json").exists():
        raise EagleHeadError(f"{source}: an EAGLE head is a folder with config.json and its weights")
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    tensors = _read_tensors(folder)
    _check_fits(config, tensors, target_cfg, source)
    cfg = ModelConfig.from_hf({**config, "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False},
                              source)
    if cfg.num_kv_heads > cfg.num_heads or cfg.num_heads % cfg.num_kv_heads:
        raise EagleHeadError(f"{source}: {cfg.num_heads} heads cannot share {cfg.num_kv_heads} KV heads")
    input_norm = [f"layers.{i}.input_layernorm.weight" in tensors for i in range(cfg.num_layers)]
    with torch.device("meta"):
        head = EagleHead(cfg, dtype, max_model_len, "fc.bias" in tensors, input_norm, "norm.weight" in tensors)
    head = head.to_empty(device=device).to(dtype)
    head.model.rotary.build_tables(device)
    weights = [(f"model.{name}", t.to(device=device, dtype=dtype)) for name, t in tensors.items()
               if name != "embed_tokens.weight"]
    try:
        head.load_weights(weights, source)
    except CheckpointError as e:  # in the checkpoint's names, without the "model." the head's parameters add
        raise EagleHeadError(str(e).replace("'model.", "'")) from None
    head.borrow(target)
    head.eval()
    log.info("EAGLE head %s: %d layer(s), fc bias %s", source, cfg.num_layers, "fc.bias" in tensors)
    return head, cfg


# ---- proposing -------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _HeadView:
    """What :meth:`ModelRunner.prepare` reads of a sequence, for the head: ``token_ids[p]`` is the token *after*
    position ``p`` (the head's input at ``p``), the served model's block table, possibly extended by scratch."""

    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    num_draft_tokens: int = 0

    def __len__(self) -> int:
        return len(self.token_ids)


class EagleProposer(Proposer):
    """Keeps the head's KV pool in step with the served model's and drafts ``k`` tokens per decoding sequence.

    The engine calls :meth:`observe` after each step's postprocess (the served model's hidden states in hand)
    and :meth:`propose` (through the Speculator) before the next schedule. The pool is indexed by the served
    model's block ids, so a prefix-cache hit must recompute the last block of the hit (``reads_hidden_states``
    tells the engine's block manager so)."""

    reads_hidden_states = True

    def __init__(self, head: EagleHead, head_cfg: ModelConfig, target: LlamaForCausalLM, block_size: int,
                 dtype: torch.dtype, device: str, num_speculative_tokens: int, vocab_size: int, max_num_seqs: int,
                 kernels: KernelChoice, max_model_len: int, give_up_after: int = 2):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.k, self.vocab_size, self.block_size = num_speculative_tokens, vocab_size, block_size
        self.head_cfg, self.dtype, self.device, self.kernels = head_cfg, dtype, device, kernels
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        # Chained drafts past a sequence's blocks go to scratch blocks after the pool's end, a fixed set per row.
        self.scratch_per_row = max(1, -(-(num_speculative_tokens - 1) // block_size))
        self.head, self.target = head, target
        self.num_blocks = 0
        self.runner: ModelRunner | None = None  # the head's KV pool: allocate()
        super().__init__(give_up_after)
        self._drafts: dict[int, Draft] = {}

    def kv_block_bytes(self) -> int:
        return kv_block_bytes(self.head_cfg, self.block_size, self.dtype)

    def allocate(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        scratch = self.max_num_seqs * self.scratch_per_row
        self.runner = ModelRunner(self.head, self.head_cfg, num_blocks + scratch, self.block_size, self.dtype,
                                  self.device, Sampler(()), self.kernels)

    def forget(self, seq: Sequence) -> None:
        super().forget(seq)
        self._drafts.pop(seq.seq_id, None)

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[Draft]:
        """The drafts :meth:`observe` made for ``seqs`` last step, cut to ``rooms``; [] for the others."""
        out = []
        for seq, room in zip(seqs, rooms, strict=True):
            d = self._drafts.pop(seq.seq_id, None)
            if d is None or room < 1:
                out.append(Draft([]))
                continue
            out.append(Draft(d.tokens[:room], d.probs[:room] if d.probs is not None else None))
        self._drafts.clear()  # drafts of sequences that are no longer decoding (preempted, finished) are stale
        return out

    @torch.inference_mode()
    def observe(self, batch: list[ScheduledSeq], hidden: torch.Tensor, starts: list[int]) -> None:
        """After a step's postprocess: compute the head's pairs for every position the served model just
        computed (``hidden`` [rows, hidden] its final hidden states, entry ``i``'s first row at ``starts[i]``;
        ``batch[i].num_tokens`` the positions kept, rejected drafts excluded), then draft for the sequences that
        decode next."""
        views, rows, drafting = [], [], []
        for i, s in enumerate(batch):
            seq, n = s.seq, s.num_tokens
            computed = seq.num_computed_tokens  # already advanced by postprocess
            views.append(ScheduledSeq(_HeadView(seq.token_ids[1 : computed + 1], seq.block_table, computed - n), n))
            rows.append(torch.arange(starts[i], starts[i] + n))
            decodes_next = len(seq) == computed + 1 and speculable(seq)
            if decodes_next and draft_room(seq, self.max_model_len) > 0 and not self.backoff.paused(seq):
                drafting.append(i)
        if not views:
            return
        input_ids, positions, meta, last_rows = self.runner.prepare(views)
        order = chunk_starts(views)
        index = torch.empty(input_ids.shape[0], dtype=torch.long)
        for i, r in enumerate(rows):
            index[order[i] : order[i] + len(r)] = r
        features = hidden.index_select(0, index.to(hidden.device))
        out = self.head(input_ids, positions, meta, features)
        if not drafting:
            return
        seqs = [batch[i].seq for i in drafting]
        params = [seq.sampling_params for seq in seqs]
        # Chained positions stay inside the context.
        wanted = [min(self.k, draft_room(seq, self.max_model_len)) for seq in seqs]
        sel = torch.tensor([last_rows[i] for i in drafting], device=out.device)
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        chain = [ScheduledSeq(self._chain_view(seq, r), 1) for r, seq in enumerate(seqs)]
        active = list(range(len(seqs)))  # rows still drafting, in the order of out's selected rows
        while True:
            h = out.index_select(0, sel)
            drawn, q = draw_drafts(self.target.compute_logits(h), [params[r] for r in active], self.vocab_size)
            for j, r in enumerate(active):
                tokens[r].append(drawn[j])
                if q is not None and q[j] is not None:
                    probs[r].append(q[j])
            going = [j for j, r in enumerate(active) if len(tokens[r]) < wanted[r]]
            if not going:
                break
            active = [active[j] for j in going]
            for r in active:  # the next pair: (the draft, the head's own hidden state)
                v = chain[r].seq
                v.num_computed_tokens = seqs[r].num_computed_tokens + len(tokens[r]) - 1
                del v.token_ids[v.num_computed_tokens :]
                v.token_ids.append(tokens[r][-1])
            input_ids, positions, meta, last_rows = self.runner.prepare([chain[r] for r in active])
            out = self.head(input_ids, positions, meta, h.index_select(0, torch.tensor(going, device=h.device)))
            sel = torch.tensor(last_rows, device=out.device)
        for seq, t, p in zip(seqs, tokens, probs, strict=True):
            self._drafts[seq.seq_id] = Draft(t, torch.stack(p) if p else None)

    def _chain_view(self, seq: Sequence, row: int) -> _HeadView:
        """The view chained drafts run on: the sequence's blocks, then this row's scratch blocks as needed."""
        computed, bs = seq.num_computed_tokens, self.block_size
        need = -(-(computed + self.k - 1) // bs) - len(seq.block_table)
        first = self.num_blocks + row * self.scratch_per_row
        table = seq.block_table + list(range(first, first + max(0, need)))
        return _HeadView(seq.token_ids[1 : computed + 1], table, computed)
