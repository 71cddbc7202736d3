"""Self-distil an EAGLE-1 head for a served model on CPU, and write it in the published EAGLE layout.

No trained head for the demo model can be downloaded here, so this makes one in a few minutes on 2 cores:

1. kubellm itself generates text from varied prompts (chat requests on many topics, code, quoting tasks),
   sampled at temperature 0.7: the head learns what the model says, not what some corpus says;
2. kubellm prefills each sequence again and keeps the model's final hidden states (after its last norm, in the
   serving dtype) at every position: exactly the features a served EAGLE head sees;
3. a head (fc [hidden, 2*hidden] over cat(embedding of token j+1, feature j), one Llama decoder layer without
   an input norm) learns to predict feature j+1, with the loss EAGLE trains with: smooth-L1 on the feature
   plus 0.1 x cross-entropy of the model's LM head on it against token j+2; features get a little uniform
   noise (as EAGLE does) so chained drafts, which feed the head its own predictions, stay on track;
4. the head is written to OUT: config.json (the model's, one layer) and pytorch_model.bin with fc.weight,
   layers.0.* and a copy of embed_tokens.weight, the layout of yuhuili/EAGLE-* checkpoints.

Run (never into the repository):

  .venv/bin/python benchmarks/train_eagle_head.py --out /tmp/smollm2-eagle [--model smollm2]
      [--prompts 96] [--max-tokens 96] [--minutes 4] [--threads 2]

then measure it: benchmarks/speculative.py --proposers eagle --eagle-head /tmp/smollm2-eagle.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

TOPICS = ["Kubernetes operators", "the water cycle", "binary search", "the French revolution", "photosynthesis",
          "how a compiler works", "TCP congestion control", "baking bread", "black holes", "the stock market",
          "vaccines", "electric cars", "the Roman empire", "machine learning", "climate change", "chess openings",
          "coffee", "volcanoes", "the human heart", "jazz music", "recycling", "the moon landing", "honey bees",
          "public key cryptography", "the Python language", "rain forests", "sleep", "the printing press"]
TASKS = ["Explain {} to a ten year old.", "Write a short essay about {}.", "Give five facts about {}.",
         "What are the pros and cons of {}?", "Write a short poem about {}.", "Summarize the history of {}.",
         "Write a Python function related to {} and explain it.", "Describe {} in three paragraphs."]
QUOTING = ["Repeat this sentence exactly: {}.", "Fix the grammar and return the text: {} are very intresting and"
           " many peoples study it every days."]


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        topic = rng.choice(TOPICS)
        out.append(rng.choice(QUOTING if i % 6 == 5 else TASKS).format(topic))
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
        """embeds, features [B, T, hidden] (embedding of token j+1, feature j) → predicted feature j+1."""
        x = self.fc(torch.cat((embeds, features), dim=-1))
        positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        cos_sin = self.rotary(x, positions)
        for layer in self.layers:
            out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
            x = out[0] if isinstance(out, tuple) else out
        return x


def generate(llm, n: int, max_tokens: int) -> list[list[int]]:
    from kubellm.runtime.sampling_params import SamplingParams

    convs = [[{"role": "user", "content": p}] for p in prompts(n)]
    torch.manual_seed(0)
    outs = llm.chat(convs, SamplingParams(temperature=0.7, top_p=0.95, max_tokens=max_tokens))
    return [o.prompt_token_ids + o.token_ids for o in outs]


def features(llm, seqs: list[list[int]]) -> list[torch.Tensor]:
    """The served model's final hidden states (after its last norm) at every position, float32 [T, hidden]:
    each sequence prefilled whole by kubellm itself (prefix caching off), its step's hidden states kept, exactly
    the features a served EAGLE head reads."""
    from kubellm.runtime.sampling_params import SamplingParams

    engine = llm.engine
    engine.runner.keep_hidden = True
    out = []
    for s in tqdm(seqs, desc="features"):
        engine.add_request(s, SamplingParams(temperature=0.0, max_tokens=1))
        engine.step()  # the whole sequence in one step (it fits max_num_batched_tokens)
        hidden, starts = engine.runner.last_hidden
        out.append(hidden[starts[0] : starts[0] + len(s)].float().clone())
        while engine.has_unfinished_requests():
            engine.step()
    engine.runner.keep_hidden = False
    return out


def save(head: Head, embed: torch.Tensor, config: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in head.state_dict().items() if not k.startswith("rotary")}
    tensors = {k: v for k, v in tensors.items() if "inv_freq" not in k}
    tensors["embed_tokens.weight"] = embed.detach().contiguous()
    torch.save(tensors, out / "pytorch_model.bin")
    cfg = {**config, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"], "bias": False}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder to write the head into (not the repository)")
    p.add_argument("--model", default="smollm2", help="known model name, .gguf or HF folder (default smollm2)")
    p.add_argument("--dtype", default="bfloat16", help="the serving dtype the features are computed in")
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--minutes", type=float, default=4.0, help="training time budget (default 4)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args(argv)
    if (Path(__file__).resolve().parents[1] / ".git").exists() and args.out.resolve().is_relative_to(
            Path(__file__).resolve().parents[1]):
        p.error("--out must be outside the repository")

    from transformers import AutoModelForCausalLM, LlamaConfig

    from kubellm.runtime import model_store
    from kubellm.runtime.config import parse_dtype
    from kubellm.runtime.engine import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.dtype)
    folder = Path(args.model).expanduser()
    if not folder.is_dir():
        folder = model_store.cached_hf_export(args.model, dtype)
    start = time.perf_counter()
    llm = LLM(str(folder), progress=False, dtype=args.dtype, max_model_len=1024, kv_cache_memory="512MiB",
              enable_prefix_caching=False)
    seqs = generate(llm, args.prompts, args.max_tokens)
    print(f"generated {sum(map(len, seqs))} tokens in {len(seqs)} sequences ({time.perf_counter() - start:.0f}s)",
          file=sys.stderr)
    feats = features(llm, seqs)
    del llm
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    embed = model.get_input_embeddings().weight
    lm_head = model.get_output_embeddings().weight.float()
    config_dict = json.loads((folder / "config.json").read_text())
    config = LlamaConfig(**{**config_dict, "num_hidden_layers": 1})
    config._attn_implementation = "sdpa"
    head = Head(config)
    with torch.no_grad():  # start near "the next feature is about this token's embedding"
        head.fc.weight.normal_(0, 0.02)
        head.layers[0].self_attn.o_proj.weight.mul_(0.1)
        head.layers[0].mlp.down_proj.weight.mul_(0.1)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    data = [(torch.tensor(s), f) for s, f in zip(seqs, feats, strict=True) if len(s) > 2]
    emb_f = embed.detach().float()
    deadline = time.perf_counter() + 60 * args.minutes
    step, rng = 0, random.Random(0)
    bar = tqdm(desc="training", unit="step", total=None)
    while time.perf_counter() < deadline:
        ids, f = rng.choice(data)
        n = len(ids)
        x_emb = emb_f[ids[1:n]][None]  # token j+1, j = 0 .. n-2
        x_feat = f[: n - 1]
        x_feat = (x_feat + (torch.rand_like(x_feat) - 0.5) * 0.2 * x_feat.std())[None]
        pred = head(x_emb, x_feat)[0]  # feature j+1
        target = f[1:n]
        reg = nn.functional.smooth_l1_loss(pred, target)
        # The LM head's GEMM dominates a step: cross-entropy on 32 positions at most (j+2 must exist).
        at = torch.randperm(n - 2)[:32]
        logits = pred[at] @ lm_head.T
        ce = nn.functional.cross_entropy(logits, ids[2:n][at])
        loss = reg + 0.1 * ce
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        step += 1
        with torch.no_grad():
            top1 = float((logits.argmax(-1) == (target[at] @ lm_head.T).argmax(-1)).float().mean())
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", reg=f"{reg.item():.3f}", ce=f"{ce.item():.2f}", top1=f"{top1:.2f}")
    bar.close()
    save(head, embed, config_dict, args.out)
    print(f"{step} steps; wrote {args.out} (top-1 agreement with the model on the last step's positions: {top1:.2f})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
