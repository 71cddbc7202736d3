"""Self-distil an EAGLE-1 head for a served model on CPU, and write it in the published EAGLE layout.

No trained head for the demo model can be downloaded here, so this makes one on CPU (one thread by default:
the host is shared):

1. kubellm itself answers chat prompts built from benchmarks/data/eagle_prompts.json (every task with every
   topic, shuffled; half greedy, half sampled at temperature 0.7): the head learns what the model says, not
   what some corpus says;
2. kubellm prefills each sequence again and keeps the model's final hidden states (after its last norm, in the
   serving dtype) at every position: exactly the features a served EAGLE head sees (``EagleProposer.observe``)
   and the ones EAGLE-1 trains on (transformers' ``hidden_states[-1]``). Sequences and features are cached in
   ``--data`` (default under ~/.cache/kubellm/eagle-data), so a second run only trains;
3. a head (fc [hidden, 2*hidden] over cat(embedding of token j+1, feature j), one Llama decoder layer without
   an input norm, at position j) learns to predict feature j+1 with EAGLE-1's loss: smooth-L1 on the feature
   plus 0.1 x the cross-entropy of the model's LM head on it against the model's own next-token distribution
   (softmax of the LM head on the true feature j+1); features get uniform noise (as EAGLE does) so chained
   drafts, which feed the head its own predictions, stay on track;
4. the head is written to OUT: config.json (the model's, one layer) and pytorch_model.bin with fc.weight,
   layers.0.* and a copy of embed_tokens.weight, the layout of yuhuili/EAGLE-* checkpoints.

Run (never into the repository):

  .venv/bin/python benchmarks/train_eagle_head.py --out ~/.cache/kubellm/smollm2-eagle [--model smollm2]
      [--prompts 2000] [--max-tokens 128] [--minutes 30] [--threads 1]

then measure it: benchmarks/speculative.py --proposers ngram,eagle --eagle-head ~/.cache/kubellm/smollm2-eagle.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

PROMPTS = Path(__file__).resolve().parent / "data" / "eagle_prompts.json"


def prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` chat prompts: every task x topic (and every fifth a quoting task), in a fixed shuffled order."""
    spec = json.loads(PROMPTS.read_text(encoding="utf-8"))
    combos = [(task, topic) for task in spec["tasks"] for topic in spec["topics"]]
    quoting = [(task, topic) for task in spec["quoting"] for topic in spec["topics"]]
    rng = random.Random(seed)
    rng.shuffle(combos)
    rng.shuffle(quoting)
    out = []
    while len(out) < n:
        pool = quoting if len(out) % 5 == 4 and quoting else combos
        task, topic = pool[(len(out) // (5 if pool is quoting else 1)) % len(pool)]
        out.append(task.format(topic))
    return out


class Head(nn.Module):
    """The head in transformers' layer types (so its math is transformers' Llama, which kubellm matches),
    named as the EAGLE checkpoints name them."""

    def __init__(self, config):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        super().__init__()
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, 0)])
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE-1: fc's output enters the layer as it is
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """embeds, features [B, T, hidden] (embedding of token j+1, feature j, at position j) → predicted
        feature j+1."""
        x = self.fc(torch.cat((embeds, features), dim=-1))
        positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        cos_sin = self.rotary(x, positions)
        for layer in self.layers:
            out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
            x = out[0] if isinstance(out, tuple) else out
        return x


def generate(llm, conversations: list[list[dict]], max_tokens: int, seed: int = 0) -> list[list[int]]:
    """Prompt + answer token ids, the even conversations answered greedily, the odd ones sampled at 0.7."""
    from kubellm.runtime.sampling.params import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    sampled = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=max_tokens)
    torch.manual_seed(seed)
    outs = llm.chat(conversations, [greedy if i % 2 == 0 else sampled for i in range(len(conversations))])
    return [o.prompt_token_ids + o.token_ids for o in outs]


def features(llm, seqs: list[list[int]]) -> list[torch.Tensor]:
    """The served model's final hidden states (after its last norm) at every position, [T, hidden] in the
    serving dtype: each sequence prefilled whole by kubellm itself (prefix caching off), its step's hidden states
    kept, exactly the features a served EAGLE head reads."""
    from kubellm.runtime.sampling.params import SamplingParams

    engine = llm.engine
    engine.runner.keep_hidden = True
    out = []
    for s in tqdm(seqs, desc="features"):
        engine.add_request(s, SamplingParams(temperature=0.0, max_tokens=1))
        engine.step()  # the whole sequence in one step (it fits max_num_batched_tokens)
        hidden, starts = engine.runner.last_hidden
        if hidden.shape[0] != len(s):
            raise ValueError(f"a {len(s)}-token sequence was prefilled in chunks; raise max_num_batched_tokens")
        out.append(hidden[starts[0] : starts[0] + len(s)].clone())
        while engine.has_unfinished_requests():
            engine.step()
    engine.runner.keep_hidden = False
    return out


@dataclass
class Training:
    """How :func:`train` runs: until ``steps`` (or ``seconds``) run out, one sequence per step, AdamW at ``lr``
    with a short warm-up and a cosine decay, ``noise`` the uniform noise's width in units of the features'
    standard deviation, the cross-entropy on ``ce_positions`` random positions per step (the LM head's GEMMs
    dominate a step)."""

    steps: int | None = None
    seconds: float | None = None
    lr: float = 1e-3
    noise: float = 0.2
    ce_weight: float = 0.1
    ce_positions: int = 48
    seed: int = 0


def train(head: Head, data: list[tuple[torch.Tensor, torch.Tensor]], embed: torch.Tensor, lm_head: torch.Tensor,
          how: Training, progress: bool = True) -> dict[str, float]:
    """Fit ``head`` on ``data`` ((token ids [T], features [T, hidden]) per sequence; ``embed`` and ``lm_head``
    the served model's, frozen). Returns the last steps' mean loss terms and top-1 agreement with the model."""
    opt = torch.optim.AdamW(head.parameters(), lr=how.lr, weight_decay=0.0)
    rng = random.Random(how.seed)
    gen = torch.Generator().manual_seed(how.seed)
    start = time.perf_counter()
    total = how.steps

    def progress_fraction(step: int) -> float:
        return step / total if total else (time.perf_counter() - start) / how.seconds

    recent: list[tuple[float, float, float]] = []
    bar = tqdm(desc="training", unit="step", total=total, disable=not progress)
    step = 0
    while progress_fraction(step) < 1:
        frac = progress_fraction(step)
        for g in opt.param_groups:  # warm-up over the first 2%, then cosine to 0
            g["lr"] = how.lr * min(1.0, frac / 0.02) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        ids, f = data[rng.randrange(len(data))]
        f = f.float()
        n = len(ids)
        x_feat = f[: n - 1]
        x_feat = x_feat + (torch.rand(x_feat.shape, generator=gen) - 0.5) * how.noise * x_feat.std()
        pred = head(embed[ids[1:n]][None], x_feat[None])[0]  # pair j = (token j+1, feature j) → feature j+1
        target = f[1:n]
        reg = nn.functional.smooth_l1_loss(pred, target)
        at = torch.randperm(n - 1, generator=gen)[: how.ce_positions]
        logits = pred[at] @ lm_head.T
        with torch.no_grad():
            target_logits = target[at] @ lm_head.T
        ce = nn.functional.cross_entropy(logits, target_logits.softmax(-1))
        loss = reg + how.ce_weight * ce
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        step += 1
        top1 = float((logits.argmax(-1) == target_logits.argmax(-1)).float().mean())
        recent = [*recent[-99:], (reg.item(), ce.item(), top1)]
        bar.update(1)
        if step % 20 == 0:
            bar.set_postfix(reg=f"{reg.item():.3f}", ce=f"{ce.item():.2f}",
                            top1=f"{sum(r[2] for r in recent) / len(recent):.2f}")
    bar.close()
    means = [sum(r[i] for r in recent) / len(recent) for i in range(3)]
    return {"steps": step, "reg": means[0], "ce": means[1], "top1": means[2]}


def new_head(config_dict: dict) -> Head:
    from transformers import LlamaConfig

    config = LlamaConfig(**{**config_dict, "num_hidden_layers": 1})
    config._attn_implementation = "sdpa"  # causal without a mask
    head = Head(config)
    with torch.no_grad():  # start near "the next feature is about this token's embedding"
        head.fc.weight.normal_(0, 0.02)
        head.layers[0].self_attn.o_proj.weight.mul_(0.1)
        head.layers[0].mlp.down_proj.weight.mul_(0.1)
    return head


def save(head: Head, embed: torch.Tensor, config: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in head.state_dict().items() if not k.startswith("rotary")}
    tensors = {k: v for k, v in tensors.items() if "inv_freq" not in k}
    tensors["embed_tokens.weight"] = embed.detach().contiguous()
    torch.save(tensors, out / "pytorch_model.bin")
    cfg = {**config, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"], "bias": False}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def distill(folder: Path, data: list[tuple[torch.Tensor, torch.Tensor]], out: Path, how: Training,
            progress: bool = True) -> dict[str, float]:
    """Train a new head for the model in ``folder`` (its embedding and LM head from transformers, frozen, in
    float32) on ``data`` and write it to ``out``; returns :func:`train`'s summary."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    embed = model.get_input_embeddings().weight.detach()
    config = json.loads((folder / "config.json").read_text())
    head = new_head(config)
    result = train(head, data, embed.float(), model.get_output_embeddings().weight.detach().float(), how, progress)
    save(head, embed, config, out)
    return result


def distillation_data(llm, n: int, max_tokens: int, cache: Path | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(token ids, features) of the model's answers to ``n`` prompts, read from ``cache`` when it holds them."""
    if cache is not None and cache.exists():
        saved = torch.load(cache, weights_only=True)
        print(f"read {len(saved['seqs'])} sequences from {cache}", file=sys.stderr)
        return list(zip(saved["seqs"], saved["feats"], strict=True))
    start = time.perf_counter()
    seqs = generate(llm, [[{"role": "user", "content": p}] for p in prompts(n)], max_tokens)
    print(f"generated {sum(map(len, seqs))} tokens in {len(seqs)} sequences ({time.perf_counter() - start:.0f}s)",
          file=sys.stderr)
    feats = features(llm, seqs)
    data = [(torch.tensor(s), f) for s, f in zip(seqs, feats, strict=True) if len(s) > 2]
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"seqs": [d[0] for d in data], "feats": [d[1] for d in data]}, cache)
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder to write the head into (not the repository)")
    p.add_argument("--model", default="smollm2", help="known model name, .gguf or HF folder (default smollm2)")
    p.add_argument("--dtype", default="bfloat16", help="the serving dtype the features are computed in")
    p.add_argument("--prompts", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--data", type=Path, default=None,
                   help="cache of the sequences and features (default ~/.cache/kubellm/eagle-data/...)")
    p.add_argument("--minutes", type=float, default=30.0, help="training time budget (default 30)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the host is shared)")
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args(argv)
    repo = Path(__file__).resolve().parents[1]
    if (repo / ".git").exists() and args.out.resolve().is_relative_to(repo):
        p.error("--out must be outside the repository")

    from kubellm.runtime.engine.config import parse_dtype
    from kubellm.runtime.engine.llm_engine import LLM
    from kubellm.runtime.models import store as model_store

    torch.set_num_threads(args.threads)
    folder = Path(args.model).expanduser()
    if not folder.is_dir():
        folder = model_store.cached_hf_export(args.model, parse_dtype(args.dtype))
    cache = args.data or (Path.home() / ".cache" / "kubellm" / "eagle-data" /
                          f"{folder.name}-{args.dtype}-{args.prompts}x{args.max_tokens}.pt")
    llm = None if cache.exists() else LLM(str(folder), progress=False, dtype=args.dtype, max_model_len=1024,
                                         kv_cache_memory="512MiB", enable_prefix_caching=False,
                                         max_num_batched_tokens=1024)
    data = distillation_data(llm, args.prompts, args.max_tokens, cache)
    del llm
    result = distill(folder, data, args.out, Training(seconds=60 * args.minutes, lr=args.lr))
    print(f"{result['steps']} steps on {len(data)} sequences ({sum(len(d[0]) for d in data)} tokens); wrote "
          f"{args.out} (last 100 steps: smooth-L1 {result['reg']:.3f}, cross-entropy {result['ce']:.2f}, top-1 "
          f"agreement with the model {result['top1']:.2f})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
