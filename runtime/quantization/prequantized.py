"""Checkpoints quantized by someone else: their ``quantization_config`` and their tensor layouts.

What each format stores for one linear layer of ``out`` x ``in`` weights, and how to read it back:

* AWQ (GEMM layout, ``quant_method: awq``): ``qweight`` int32 ``[in, out / 8]``, eight 4-bit values per word
  in AWQ's interleaved order (word bits 4i..4i+3 hold column ``AWQ_ORDER[i]`` of the eight); ``qzeros`` int32
  ``[in / group, out / 8]`` packed the same way; ``scales`` ``[in / group, out]``. Always asymmetric.
* GPTQ v1 (AutoGPTQ, GPTQModel, optimum; ``quant_method: gptq``): ``qweight`` int32 ``[in * bits / 32, out]``,
  packed along the input dimension in order; ``qzeros`` int32 ``[groups, out * bits / 32]`` packed along the
  output dimension, each stored as zero - 1 (v1's convention); ``scales`` ``[groups, out]``; ``g_idx`` ``[in]``
  maps each input to its group (act-order / ``desc_act`` permutes it; without it group = input // group_size).
  Symmetric checkpoints store the zero 2^(bits-1) as well. 4 and 8 bits.
* compressed-tensors ``pack-quantized`` (``quant_method: compressed-tensors``, W4A16 / W8A16):
  ``weight_packed`` int32 ``[out, in * bits / 32]`` densely packed along the input dimension from the low bits,
  values offset by 2^(bits-1); ``weight_scale`` ``[out, groups]`` (group strategy) or ``[out, 1]`` (channel);
  ``weight_zero_point`` when asymmetric; ``weight_shape`` the original ``[out, in]``.
* FP8 (``quant_method: fp8`` or compressed-tensors ``float-quantized``): e4m3 ``weight`` ``[out, in]`` with
  ``weight_scale`` per tensor or per output channel, or ``weight_scale_inv`` per 128 x 128 block
  (DeepSeek, Qwen3-FP8).

Every reader returns :class:`QuantizedWeight`: integer values ``[out, in]``, scales and zero points per
(output, group) and the input → group map, the one form the dequantize reference and the kernels take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubellm.runtime.models.checkpoint import CheckpointError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word nibble i holds column AWQ_ORDER[i] of its eight
METHODS = ("awq", "gptq", "compressed-tensors", "fp8")


@dataclass(frozen=True)
class QuantSpec:
    """A checkpoint's quantization, from config.json's ``quantization_config``."""

    method: str  # one of METHODS
    bits: int  # 4 or 8 (8 for fp8)
    group_size: int  # inputs per scale; -1: one group per output channel
    symmetric: bool
    act_order: bool = False  # GPTQ desc_act: inputs grouped by g_idx, not by position
    float_weights: bool = False  # fp8 e4m3 weights instead of integers
    block: tuple[int, int] | None = None  # fp8 block-wise scales (rows, columns)


def detect(config: dict, where: str = "") -> QuantSpec | None:
    """The quantization config.json declares, or None; a clear error for what is not supported."""
    qc = config.get("quantization_config") or config.get("compression_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "awq":
        if (qc.get("version") or "gemm").lower() != "gemm":
            raise CheckpointError(f"AWQ version {qc.get('version')!r}{where} is not supported (GEMM only)")
        return QuantSpec("awq", int(qc.get("bits") or qc.get("w_bit") or 4), int(qc.get("group_size")
                         or qc.get("q_group_size") or 128), symmetric=not qc.get("zero_point", True))
    if method == "gptq":
        bits = int(qc.get("bits", 4))
        if bits not in (4, 8):
            raise CheckpointError(f"GPTQ with {bits} bits{where} is not supported (4 or 8)")
        if qc.get("checkpoint_format", "gptq") not in ("gptq", None):
            raise CheckpointError(f"GPTQ checkpoint format {qc.get('checkpoint_format')!r}{where} is not supported "
                                  "(the v1 'gptq' layout)")
        return QuantSpec("gptq", bits, int(qc.get("group_size", 128)), symmetric=bool(qc.get("sym", True)),
                         act_order=bool(qc.get("desc_act", False)))
    if method == "fp8":
        block = qc.get("weight_block_size")
        return QuantSpec("fp8", 8, -1, True, float_weights=True, block=tuple(block) if block else None)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    raise CheckpointError(f"quantization method {method!r}{where} is not supported; supported: {', '.join(METHODS)}")


def _compressed_tensors(qc: dict, where: str) -> QuantSpec:
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise CheckpointError(f"compressed-tensors with {len(groups)} config groups{where} is not supported (one)")
    weights = groups[0].get("weights") or {}
    fmt = qc.get("format")
    if groups[0].get("input_activations") and fmt != "float-quantized":
        raise CheckpointError(f"compressed-tensors format {fmt!r} with quantized activations{where} is not supported")
    if fmt == "float-quantized":
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise CheckpointError(f"compressed-tensors float-quantized weights must be fp8{where}")
        block = weights.get("block_structure")
        return QuantSpec("fp8", 8, -1, True, float_weights=True, block=tuple(block) if block else None)
    if fmt != "pack-quantized":
        raise CheckpointError(f"compressed-tensors format {fmt!r}{where} is not supported (pack-quantized, "
                              "float-quantized)")
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel"):
        raise CheckpointError(f"compressed-tensors strategy {strategy!r}{where} is not supported (group, channel)")
    return QuantSpec("compressed-tensors", int(weights["num_bits"]),
                     int(weights.get("group_size") or -1) if strategy == "group" else -1,
                     symmetric=bool(weights.get("symmetric", True)), act_order=weights.get("actorder") == "group")


@dataclass
class QuantizedWeight:
    """One layer's weights as stored: ``values`` ``[out, in]`` (integers, or fp8), ``scales`` and ``zeros``
    ``[out, groups]`` (zeros None when symmetric around 0), ``g_idx`` ``[in]`` (None: input // group_size)."""

    values: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    g_idx: torch.Tensor | None = None

    def groups_of_inputs(self) -> torch.Tensor:
        n = self.values.shape[1]
        if self.g_idx is not None:
            return self.g_idx.long()
        size = n if self.group_size <= 0 else self.group_size
        return torch.arange(n, device=self.values.device) // size

    def output_slice(self, start: int, n: int) -> QuantizedWeight:
        """Outputs ``start .. start + n`` (a column-parallel shard): rows of values, scales and zeros; the
        input → group map is the whole layer's."""
        return QuantizedWeight(self.values.narrow(0, start, n), self.scales.narrow(0, start, n),
                               None if self.zeros is None else self.zeros.narrow(0, start, n), self.group_size,
                               self.g_idx)

    def input_slice(self, start: int, n: int) -> QuantizedWeight:
        """Inputs ``start .. start + n`` (a row-parallel shard). Contiguous groups must not be cut: the slice
        takes whole groups and their scales. With an act-order map the inputs of a group lie anywhere, so the
        slice takes its part of ``g_idx`` and keeps every group's scales (each output row's few group scales;
        the map indexes them as before). One group per output (``group_size`` -1) stays one group."""
        values = self.values.narrow(1, start, n)
        if self.g_idx is not None:
            return QuantizedWeight(values, self.scales, self.zeros, self.group_size, self.g_idx.narrow(0, start, n))
        if self.group_size <= 0:
            return QuantizedWeight(values, self.scales, self.zeros, -1)
        if start % self.group_size or n % self.group_size:
            raise ValueError(f"inputs {start}..{start + n} of each rank cut groups of {self.group_size} inputs")
        g0, groups = start // self.group_size, n // self.group_size
        return QuantizedWeight(values, self.scales.narrow(1, g0, groups),
                               None if self.zeros is None else self.zeros.narrow(1, g0, groups), self.group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The reference: ``(values - zeros) * scales`` per (output, group of each input), in float32."""
        g = self.groups_of_inputs()
        scale = self.scales.float()[:, g]
        w = self.values.float()
        if self.zeros is not None:
            w = w - self.zeros.float()[:, g]
        return (w * scale).to(dtype)


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[r, c]`` holding 32 / bits values per word along dim 0, low bits first → ``[r * 32 / bits, c]``."""
    per = 32 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    values = (packed.unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)  # [r, per, c]
    return values.reshape(-1, packed.shape[1])


def _unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[r, c]`` holding 32 / bits values per word along dim 1, low bits first → ``[r, c * 32 / bits]``."""
    return _unpack_rows(packed.t().contiguous(), bits).t()


def read_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> QuantizedWeight:
    reverse = torch.tensor([AWQ_ORDER.index(j) for j in range(8)], device=qweight.device)

    def unpack(packed: torch.Tensor) -> torch.Tensor:  # [r, c / 8] → [r, c] in column order
        nibbles = _unpack_cols(packed, 4).view(packed.shape[0], -1, 8)  # word nibble i of each word
        return nibbles[:, :, reverse].reshape(packed.shape[0], -1)

    return QuantizedWeight(unpack(qweight).t().contiguous(), scales.t().contiguous(), unpack(qzeros).t().contiguous(),
                           group_size)


def read_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
              bits: int, group_size: int) -> QuantizedWeight:
    values = _unpack_rows(qweight, bits)  # [in, out]
    zeros = _unpack_cols(qzeros, bits) + 1  # v1 stores zero - 1
    n_in = values.shape[0]
    if g_idx is not None and torch.equal(g_idx.long(), torch.arange(n_in) // (group_size if group_size > 0 else n_in)):
        g_idx = None  # the trivial map: keep groups contiguous (the fast path)
    return QuantizedWeight(values.t().contiguous(), scales.t().contiguous(), zeros.t().contiguous(), group_size,
                           None if g_idx is None else g_idx.to(torch.int32))


def read_compressed(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor | tuple, bits: int,
                    group_size: int, zero_point: torch.Tensor | None = None,
                    g_idx: torch.Tensor | None = None) -> QuantizedWeight:
    out_features, in_features = (int(x) for x in shape)
    offset = 1 << (bits - 1)
    values = _unpack_cols(packed, bits)[:, :in_features] - offset
    if zero_point is not None and zero_point.dtype == torch.int32:  # packed along the output dimension
        zero_point = _unpack_rows(zero_point, bits)[:out_features] - offset
    return QuantizedWeight(values.to(torch.int8), scale, zero_point, group_size, g_idx)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 weight ``[out, in]`` times its scale: a scalar, ``[out]``/``[out, 1]``, or one per block."""
    w = weight.float()
    s = scale.float()
    if block is not None:
        rows, cols = block
        s = s.repeat_interleave(rows, 0)[: w.shape[0]].repeat_interleave(cols, 1)[:, : w.shape[1]]
    elif s.dim() == 1 and s.numel() == w.shape[0] and s.numel() > 1:
        s = s.unsqueeze(1)
    return (w * s).to(dtype)
