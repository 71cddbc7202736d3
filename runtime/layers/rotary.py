"""Rotary position embeddings (the rotate-half layout Hugging Face Llama checkpoints use)."""

from __future__ import annotations

import math

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2], float32, with linear or llama3 scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


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
            inv_freq = inv_frequencies(head_dim, theta, scaling)
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
            self.cos = emb.cos().to(dtype)
            self.sin = emb.sin().to(dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, KVH, D], positions [T] → rotated q, k (new tensors)."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
