"""Shared by the speculative-decoding tests: tiny models that continue a token cycle, and a two-sample
chi-square to compare sampled outputs with and without speculation."""

from __future__ import annotations

import shutil
from collections import Counter

import torch
from safetensors.torch import load_file, save_file

CYCLE = list(range(10, 40))
CYCLE_PROMPT = CYCLE * 2 + CYCLE[:3]


def cycle_checkpoint(src, dst, strength: float):
    """The tiny Llama made to continue a 30-token cycle (token t → the next on the cycle; at T=1 p ≈ 0.7 with
    strength 1.2, ≈ 0.95 with 2.0): attention and MLP outputs scaled down to 5%, and lm_head rows pointed at the
    predecessor's embedding."""
    shutil.copytree(src, dst)
    w = load_file(str(dst / "model.safetensors"))
    for k in w:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k] = w[k] * 0.05
        if k.endswith("norm.weight"):
            w[k] = torch.ones_like(w[k])
    lm = w["lm_head.weight"].clone()
    for i, t in enumerate(CYCLE):
        lm[CYCLE[(i + 1) % len(CYCLE)]] = strength * w["model.embed_tokens.weight"][t]
    w["lm_head.weight"] = lm
    save_file(w, str(dst / "model.safetensors"))
    return dst


def run_lengths(outs) -> Counter:
    """How many output tokens in a row continue the cycle after the prompt (0..max_tokens)."""
    counts = Counter()
    for o in outs:
        expected, n = CYCLE_PROMPT[-1], 0
        for t in o.token_ids:
            expected = CYCLE[(CYCLE.index(expected) + 1) % len(CYCLE)] if expected in CYCLE else -1
            if t != expected:
                break
            n += 1
        counts[n] += 1
    return counts


def chi2(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-square over the categories with at least 5 expected counts (the rest pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    cats = sorted(set(a) | set(b), key=lambda c: -(a[c] + b[c]))
    big = [c for c in cats if (a[c] + b[c]) * min(na, nb) / (na + nb) >= 5]
    rows = [(a[c], b[c]) for c in big] + [(sum(a[c] for c in cats if c not in big),
                                          sum(b[c] for c in cats if c not in big))]
    rows = [r for r in rows if sum(r)]
    chi2 = 0.0
    for x, y in rows:
        ex, ey = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        chi2 += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    return chi2, len(rows) - 1


CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59,
             11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70, 16: 39.25, 17: 40.79, 18: 42.31, 19: 43.82,
             20: 45.31, 21: 46.80, 22: 48.27, 23: 49.73, 24: 51.18, 25: 52.62, 26: 54.05, 27: 55.48, 28: 56.89,
             29: 58.30, 30: 59.70}  # chi-square quantiles at 0.999


def eagle_head(target, dst, *, seed: int = 0, echo: float | None = None, fmt: str = "safetensors",
               fc_shape: tuple[int, int] | None = None, **config_overrides):
    """An EAGLE-1 head for the tiny Llama at ``target``, in the published layout (config.json + fc.weight,
    layers.0.*, a copy of embed_tokens; no input norm on layer 0, no final norm). Random weights (``seed``), or
    with ``echo`` a head that outputs ``echo`` times the next token's embedding scaled to unit RMS: on
    :func:`cycle_checkpoint` models it drafts the cycle (surer of it than the model for echo > the model's
    strength). ``fmt``: "safetensors" or "bin" (pytorch_model.bin, as the published heads)."""
    import json
    from pathlib import Path

    dst = Path(dst)
    dst.mkdir(parents=True)
    cfg = json.loads((Path(target) / "config.json").read_text())
    w = load_file(str(Path(target) / "model.safetensors"))
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    g = torch.Generator().manual_seed(seed)
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    tensors = {f"layers.0.{k}.weight": torch.randn(s, generator=g) * 0.15 for k, s in shapes.items()}
    tensors["layers.0.post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    tensors["fc.weight"] = torch.randn(fc_shape or (h, 2 * h), generator=g) * 0.1
    tensors["embed_tokens.weight"] = w["model.embed_tokens.weight"].clone()
    if echo is not None:
        rms = float(w["model.embed_tokens.weight"][CYCLE].pow(2).mean().sqrt())
        tensors["fc.weight"] = torch.cat((torch.eye(h) * echo / rms, torch.zeros(h, h)), dim=1)
        tensors["layers.0.self_attn.o_proj.weight"].zero_()
        tensors["layers.0.mlp.down_proj.weight"].zero_()
    cfg.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"], bias=False)
    cfg.update(config_overrides)
    (dst / "config.json").write_text(json.dumps(cfg))
    if fmt == "bin":
        torch.save(tensors, dst / "pytorch_model.bin")
    else:
        save_file(tensors, str(dst / "model.safetensors"))
    return dst
