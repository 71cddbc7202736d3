"""GGUF files (llama.cpp): their quantized blocks read into the form kubellm's quantized GEMMs take (integer
values, float scales and zero points per group, ``w = (values - zeros) * scales``), and the format the loader
asks about them. Pure torch, no ``gguf`` import (runtime/models/gguf.py reads the file).

:func:`unpack` takes one tensor's raw bytes as a GGUF file stores them, ``[N, K / block * block_bytes]``
uint8 (``GGUFReader``'s ``tensor.data`` for a quantized type, a row per output channel), and returns a
:class:`BlockForm`: ``values`` ``[N, K]``, ``scales`` and ``zeros`` ``[N, K / group]`` float32 (the
orientation of runtime/layers/quantized_weight.py's ``QuantizedWeight``; the CPU kernels want them transposed to
``[K / group, N]``), and which kernel takes it:

=====  ===========================================  ======  =====  ==============================================
type   block (bytes)                                kernel  group  values, scales, zeros
=====  ===========================================  ======  =====  ==============================================
Q8_0   32: fp16 d, 32 int8                          int8    32     q, d, none
Q4_0   32: fp16 d, 16 B nibbles                     int4    32     q 0..15, d, 8
Q4_1   32: fp16 d, fp16 m, 16 B nibbles             int4    32     q 0..15, d, -m / d   (w = d q + m)
Q4_K   256: fp16 d, dmin, 12 B 6-bit sc/mn, 128 B   int4    32     q 0..15, d sc, dmin mn / (d sc)
Q5_K   256: as Q4_K plus 32 B of fifth bits         int8    32     q 0..31, d sc, dmin mn / (d sc)
Q6_K   256: 128 B low nibbles, 64 B high pairs,     int8    16     q - 32 (-32..31), d sc, none
       16 int8 sub-scales sc, fp16 d
=====  ===========================================  ======  =====  ==============================================

``int4``: ``kernels/cpu_int4_gemm.py`` (uint8 values 0..15, float zeros); ``int8``:
``kernels/cpu_grouped_int8_gemm.py`` (int8 values). An affine block (``w = d q + m``) whose scale is 0 holds
one value ``m`` for all its inputs; it is rewritten as values 1, scale ``m``, zero 0, which is the same weight.
llama.cpp's row permutation of q/k projections applies to values, scales and zeros alike (rows are channels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubellm.runtime.layers.checkpoint_error import CheckpointError
from kubellm.runtime.layers.quantized_weight import QuantizedWeight
from kubellm.runtime.quantization.base import QuantizationFormat

QK_K = 256
# type -> (weights per block, bytes per block)
BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176),
          "Q6_K": (QK_K, 210)}


@dataclass(frozen=True)
class BlockForm:
    """One GGUF tensor as ``w = (values - zeros) * scales`` per (output channel, group of inputs)."""

    values: torch.Tensor  # [N, K]: uint8 0..15 (kernel "int4") or int8 (kernel "int8")
    scales: torch.Tensor  # [N, K / group_size] float32
    zeros: torch.Tensor | None  # like scales; None: symmetric around 0
    group_size: int
    kernel: str  # int4 | int8


def dequantize(form: BlockForm) -> torch.Tensor:
    """The ``[N, K]`` float32 weight the form stands for (the reference the kernels are compared with)."""
    w = form.values.float()
    if form.zeros is not None:
        w = w - form.zeros.repeat_interleave(form.group_size, dim=1)
    return w * form.scales.repeat_interleave(form.group_size, dim=1)


def unpack(type_name: str, raw: torch.Tensor, in_features: int) -> BlockForm:
    """``raw`` ``[N, row bytes]`` uint8 of a GGUF tensor of ``type_name`` (``Q4_1``...) with ``in_features``
    inputs per row → its :class:`BlockForm`."""
    if type_name not in BLOCKS:
        raise ValueError(f"GGUF type {type_name} has no packed form here; supported: {', '.join(BLOCKS)}")
    per_block, block_bytes = BLOCKS[type_name]
    n = raw.shape[0]
    if in_features % per_block or raw.dim() != 2 or raw.dtype != torch.uint8 or \
            raw.shape[1] != in_features // per_block * block_bytes:
        raise ValueError(f"{type_name}: expected [N, {in_features // per_block * block_bytes}] uint8 for "
                         f"{in_features} inputs (blocks of {per_block}), got {list(raw.shape)} {raw.dtype}")
    blocks = raw.reshape(n, in_features // per_block, block_bytes)
    return _UNPACK[type_name](blocks)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """``[..., 2]`` little-endian fp16 bytes → ``[...]`` float32."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _nibbles(qs: torch.Tensor, span: int) -> torch.Tensor:
    """``[..., c * span]`` bytes → ``[..., 2c * span]``: each run of ``span`` bytes gives ``span`` low nibbles,
    then their ``span`` high nibbles (llama.cpp's order)."""
    runs = qs.reshape(*qs.shape[:-1], -1, 1, span)
    both = torch.cat([runs & 0xF, runs >> 4], dim=-2)
    return both.reshape(*qs.shape[:-1], -1)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[N, blocks, per block]`` → ``[N, blocks * per block]``."""
    return t.reshape(t.shape[0], -1).contiguous()


def _affine(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, group: int, kernel: str) -> BlockForm:
    """``w = d * q + m`` per group (``q`` ``[N, groups, group]``, ``d`` and ``m`` ``[N, groups]``) as
    ``(q - (-m / d)) * d``; a group with ``d == 0`` is the constant ``m``: values 1, scale ``m``, zero 0."""
    flat = d == 0
    q = torch.where(flat.unsqueeze(-1), torch.ones_like(q), q)
    scales = torch.where(flat, m, d)
    zeros = torch.where(flat, torch.zeros_like(m), -m / torch.where(flat, torch.ones_like(d), d))
    return BlockForm(_rows(q), scales, zeros, group, kernel)


def _q8_0(b: torch.Tensor) -> BlockForm:
    return BlockForm(_rows(b[..., 2:].contiguous().view(torch.int8)), _f16(b[..., :2]), None, 32, "int8")


def _q4_0(b: torch.Tensor) -> BlockForm:
    q = _nibbles(b[..., 2:], 16)
    return BlockForm(_rows(q), _f16(b[..., :2]), torch.full(b.shape[:2], 8.0), 32, "int4")


def _q4_1(b: torch.Tensor) -> BlockForm:
    return _affine(_nibbles(b[..., 4:], 16), _f16(b[..., :2]), _f16(b[..., 2:4]), 32, "int4")


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes of 6-bit sub-block scales and mins of Q4_K/Q5_K → ``[..., 8]`` each (as gguf.quants)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _k_affine(b: torch.Tensor, q: torch.Tensor, kernel: str) -> BlockForm:
    """Q4_K/Q5_K: ``w = d sc q - dmin mn`` per sub-block of 32 (``q`` ``[N, blocks, 8, 32]``)."""
    n, nb = b.shape[:2]
    sc, mn = _k_scales(b[..., 4:16])
    d = (_f16(b[..., 0:2]).unsqueeze(-1) * sc).reshape(n, nb * 8)
    m = -(_f16(b[..., 2:4]).unsqueeze(-1) * mn).reshape(n, nb * 8)
    return _affine(q.reshape(n, nb * 8, 32), d, m, 32, kernel)


def _q4_k(b: torch.Tensor) -> BlockForm:
    return _k_affine(b, _nibbles(b[..., 16:], 32), "int4")


def _q5_k(b: torch.Tensor) -> BlockForm:
    low = _nibbles(b[..., 48:], 32).reshape(*b.shape[:2], 8, 32)
    high = (b[..., 16:48].unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1  # bit j: sub-block j
    return _k_affine(b, (low | (high << 4)).to(torch.int8), "int8")


def _q6_k(b: torch.Tensor) -> BlockForm:
    n, nb = b.shape[:2]
    low = _nibbles(b[..., :128], 64).reshape(n, nb, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    high = ((b[..., 128:192].reshape(n, nb, 2, 1, 32) >> shifts) & 3).reshape(n, nb, 8, 32)
    q = (low | (high << 4)).to(torch.int8) - 32
    scales = _f16(b[..., 208:210]).unsqueeze(-1) * b[..., 192:208].contiguous().view(torch.int8).float()
    return BlockForm(_rows(q), scales.reshape(n, nb * 16), None, 16, "int8")


_UNPACK = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


@dataclass(frozen=True)
class GGUF(QuantizationFormat):
    """A GGUF file's packed linears (``weight``: a :class:`BlockForm` each, from the checkpoint's
    ``packed_tensors()``). Its settings are per tensor in fact: each form says its kernel and group."""

    name = "gguf"

    symmetric: bool = False
    group_size: int = 32

    def tensor_names(self) -> set[str]:
        return {"weight"}

    def check_tensor(self, name: str, tensor: object, where: str) -> None:
        if name.endswith(".weight") and isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{name}{where} is stored in a GGUF type without a packed form here")

    def read(self, tensors: dict) -> tuple[QuantizedWeight, int]:
        form = tensors["weight"]
        return (QuantizedWeight(form.values, form.scales, form.zeros, form.group_size),
                4 if form.kernel == "int4" else 8)
