"""Published quantized-checkpoint layouts (runtime/quantization/awq.py, gptq.py, compressed_tensors.py, fp8.py): each reader against an independent writer
of the same layout: compressed-tensors' own packer and compressor, and small writers here that follow the
AWQ and GPTQ v1 layouts as their projects document them."""

from __future__ import annotations

import pytest
import torch

from kubellm.runtime.models.checkpoint import CheckpointError
from kubellm.runtime.quantization.awq import AWQ, AWQ_ORDER, read_awq
from kubellm.runtime.quantization.compressed_tensors import CompressedTensors, read_compressed
from kubellm.runtime.quantization.fp8 import FP8, dequantize_fp8
from kubellm.runtime.quantization.gptq import GPTQ, read_gptq
from kubellm.runtime.quantization.registry import detect

OUT, IN = 24, 256


def _quantize(w: torch.Tensor, bits: int, group: int, symmetric: bool):
    """Reference asymmetric/symmetric round-to-nearest: (q [out, in] unsigned, scales, zeros [out, groups])."""
    g = w.view(w.shape[0], -1, group)
    top = (1 << bits) - 1
    if symmetric:
        scale = g.abs().amax(-1) / (top // 2)
        zero = torch.full_like(scale, float(1 << (bits - 1)))
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = (hi - lo) / top
        zero = torch.round(-lo / scale)
    q = torch.clamp(torch.round(g / scale.unsqueeze(-1)) + zero.unsqueeze(-1), 0, top)
    return q.view_as(w).to(torch.int32), scale, zero.to(torch.int32)


def _pack_cols(v: torch.Tensor, bits: int) -> torch.Tensor:
    per = 32 // bits
    v = v.view(v.shape[0], -1, per).to(torch.int64)
    words = sum(v[:, :, i] << (bits * i) for i in range(per))
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement into int32


def _pack_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    return _pack_cols(v.t().contiguous(), bits).t().contiguous()


def test_awq_reads_back_its_interleaved_nibbles():
    w = torch.randn(OUT, IN)
    q, scale, zero = _quantize(w, 4, 128, symmetric=False)
    # AWQ: [in, out] with each word's nibble i holding column AWQ_ORDER[i] of its eight.
    def awq_pack(m: torch.Tensor) -> torch.Tensor:  # m [r, c] → [r, c / 8]
        return _pack_cols(m.view(m.shape[0], -1, 8)[:, :, list(AWQ_ORDER)].reshape(m.shape[0], -1), 4)

    qw = read_awq(awq_pack(q.t().contiguous()), awq_pack(zero.t().contiguous()), scale.t().contiguous(), 128)
    assert torch.equal(qw.values, q) and torch.equal(qw.zeros, zero)
    expected = ((q - zero.repeat_interleave(128, 1)) * scale.repeat_interleave(128, 1)).float()
    torch.testing.assert_close(qw.dequantize(), expected)
    torch.testing.assert_close(qw.dequantize(), w, atol=scale.max().item(), rtol=0)  # within a step


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_v1_with_its_zero_convention_and_act_order(bits, symmetric, act_order):
    w = torch.randn(OUT, IN)
    group = 64
    if act_order:  # desc_act: inputs quantized in a permuted order, so groups are scattered over positions
        perm = torch.randperm(IN, generator=torch.Generator().manual_seed(bits))
        g_idx = torch.empty(IN, dtype=torch.int32)
        g_idx[perm] = (torch.arange(IN) // group).to(torch.int32)
        q_perm, scale, zero = _quantize(w[:, perm].contiguous(), bits, group, symmetric)
        q = torch.empty_like(q_perm)
        q[:, perm] = q_perm
    else:
        g_idx = (torch.arange(IN) // group).to(torch.int32)
        q, scale, zero = _quantize(w, bits, group, symmetric)
    qweight = _pack_rows(q.t().contiguous(), bits)  # [in * bits / 32, out]
    qzeros = _pack_cols((zero - 1).t().contiguous(), bits)  # v1: zero - 1, [groups, out * bits / 32]
    qw = read_gptq(qweight, qzeros, scale.t().contiguous(), g_idx, bits, group)
    assert torch.equal(qw.values, q) and torch.equal(qw.zeros, zero)
    assert (qw.g_idx is None) == (not act_order)
    g = g_idx.long()
    expected = (q - zero[:, g]) * scale[:, g]
    torch.testing.assert_close(qw.dequantize(), expected.float())


@pytest.mark.parametrize(("strategy", "symmetric"), [("group", True), ("group", False), ("channel", True),
                                                     ("channel", False)])
@pytest.mark.parametrize("bits", [4, 8])
def test_compressed_tensors_pack_quantized_equals_the_library(strategy, symmetric, bits):
    """compressed-tensors' own compressor writes the tensors and decompresses them: ours must agree."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    w = torch.randn(OUT, IN)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=128 if strategy == "group" else None)
    view = w.view(OUT, -1, 128) if strategy == "group" else w.view(OUT, 1, IN)
    scale, zp = calculate_qparams(view.amin(-1), view.amax(-1), args)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
    packed = PackedQuantizationCompressor.compress(state, scheme)
    theirs = PackedQuantizationCompressor.decompress(packed, scheme)["weight"]
    qw = read_compressed(packed["weight_packed"], packed["weight_scale"], packed["weight_shape"], bits,
                            128 if strategy == "group" else -1, packed.get("weight_zero_point"))
    torch.testing.assert_close(qw.dequantize(), theirs.float(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("layout", ["tensor", "channel", "block"])
def test_fp8_scales_per_tensor_channel_and_block(layout):
    w = torch.randn(OUT * 8, IN)  # 192 rows: blocks of 128 leave a partial one
    if layout == "block":
        scale = torch.rand(2, 2) + 0.5
        full = scale.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, :IN]
    else:
        scale = torch.tensor(0.7) if layout == "tensor" else torch.rand(w.shape[0], 1) + 0.5
        full = scale
    stored = (w / full).to(torch.float8_e4m3fn)
    out = dequantize_fp8(stored, scale, (128, 128) if layout == "block" else None)
    torch.testing.assert_close(out, stored.float() * full)
    torch.testing.assert_close(out, w, rtol=0.07, atol=1e-2)  # e4m3 keeps 3 mantissa bits


@pytest.mark.parametrize(("config", "expected"), [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
     AWQ(4, 128, symmetric=False)),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True},
     GPTQ(4, 128, symmetric=True, act_order=True)),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]},
     FP8(8, -1, True, block=(128, 128))),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                           "group_size": 128}}}},
     CompressedTensors(4, 128, symmetric=True)),
])  # fmt: skip
def test_detect_reads_quantization_config(config, expected):
    assert detect({"quantization_config": config}) == expected
    assert detect({}) is None


@pytest.mark.parametrize(("config", "message"), [
    ({"quant_method": "awq", "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "gptq", "bits": 3}, "GPTQ with 3 bits"),
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes' .* not supported; supported: awq"),
    ({"quant_method": "compressed-tensors", "format": "marlin-24", "config_groups": {"g": {"weights": {}}}},
     "format 'marlin-24'"),
])  # fmt: skip
def test_detect_refuses_what_is_not_supported_by_name(config, message):
    with pytest.raises(CheckpointError, match=message):
        detect({"quantization_config": config})
