"""Rotary position embeddings (the rotate-half layout Hugging Face Llama checkpoints use)."""

from __future__ import annotations

import math

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None, max_positions: int) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies [head_dim // 2] (float32) and the factor cos/sin are scaled by, with linear,
    llama3 or longrope scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "longrope":
        return _longrope(exponents, theta, scaling, max_positions)
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    # llama3: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def _longrope(exponents: torch.Tensor, theta: float, scaling: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): per-pair rescaling factors, the long set for contexts past the pre-training length.

    Transformers switches sets by the current sequence length, so a sequence's early keys and later ones would
    be rotated differently; here the served context decides once (as llama.cpp does): long factors when
    ``max_positions`` exceeds the original length. Equal to transformers for every sequence on the same side of
    that length, and the KV cache stays consistent.
    """
    original = int(scaling["original_max_position_embeddings"])
    long = max_positions > original
    ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        factor = float(scaling["factor"])
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0 / (ext * theta**exponents), float(attention_factor)


class RotaryEmbedding(torch.nn.Module):
    """Precomputes cos/sin for every position up to ``max_positions`` once; forward only indexes."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, dtype: torch.dtype):
        super().__init__()
        self.args = (head_dim, max_positions, theta, scaling, dtype)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build_tables(torch.device("cpu"))

    def build_tables(self, device: torch.device | str) -> None:
        """(Re)compute the cos/sin tables on ``device``; needed after materialising a meta-device model."""
        head_dim, max_positions, theta, scaling, dtype = self.args
        with torch.device(device):  # overrides an enclosing meta-device context
            inv_freq, scale = inv_frequencies(head_dim, theta, scaling, max_positions)
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
            self.cos = (emb.cos() * scale).to(dtype)
            self.sin = (emb.sin() * scale).to(dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, KVH, D], positions [T] → rotated q, k (new tensors)."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
