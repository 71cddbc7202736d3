"""The fused decode layer (kernels/cpu_decode_layer.py's decode_layer_q_) on every native quantized GEMM beside
4-bit (tests/runtime/test_fused_decode_int4.py): FP8 checkpoints (compressed-tensors per channel, 128 x 128
blocks), 8-bit GPTQ and W8A16, ``--quantization int8`` and a GGUF file mixing 4-bit and 8-bit linears within a
layer (Q4_K_M-like). Pure decode steps run one native call per layer that calls each linear's own kernel with the
module tree's arguments, so the sampled rows' logits are the same bits as with ``KUBELLM_FUSED_DECODE=0``."""

from __future__ import annotations

import pytest
import torch
from test_fused_decode_int4 import _assert_same_bits, _fused_vs_tree
from test_gguf import Q, byte_level_metadata, tiny_config, tiny_model, train_byte_level_tokenizer, write_gguf
from test_prequantized_loading import SHAPE, write_quantized

from kubellm.kernels.cpu_decode_layer import FP8, GROUPED_INT8, INT4, INT8
from kubellm.runtime.quantization.int8 import Int8Linear

pytestmark = pytest.mark.usefixtures("native_int4", "native_fp8", "native_grouped_int8", "native_int8",
                                     "native_bf16_gemm")


def _native_fp8(layers, _):
    assert all(m.path == "native" and m.float_values for m in layers)


def _native_8bit(layers, _):
    assert all(m.path == "native" and m.bits == 8 and not m.float_values for m in layers)


def _native_int8(layers, _):
    assert all(isinstance(m, Int8Linear) and m.path == "native" for m in layers)


@pytest.mark.parametrize(("fmt", "arch"), [("fp8-channel", "llama"), ("fp8-channel", "qwen3"),
                                           ("fp8-block128", "llama"), ("fp8-block128", "qwen3")])
def test_fp8_fused_decode_gives_the_module_trees_logits_bit_for_bit(fmt, arch, tiny_checkpoint_factory, tmp_path,
                                                                    monkeypatch):
    """cpu_fp8_gemm's few-row path: scales per channel, and per 128 inputs (blocks of 128 x 128)."""
    quant_dir, _ = write_quantized(tiny_checkpoint_factory(arch, **SHAPE), tmp_path, fmt)
    _assert_same_bits(_fused_vs_tree(quant_dir, monkeypatch, "bf16", check_layers=_native_fp8,
                                     kinds={(FP8,) * 4}))


@pytest.mark.parametrize(("fmt", "arch"), [("gptq-8bit-sym-g128", "llama"), ("gptq-8bit-sym-g128", "qwen3"),
                                           ("w8a16-channel", "llama")])
def test_8bit_fused_decode_gives_the_module_trees_logits_bit_for_bit(fmt, arch, tiny_checkpoint_factory, tmp_path,
                                                                     monkeypatch):
    """cpu_grouped_int8_gemm: GPTQ 8-bit (groups of 128) and compressed-tensors W8A16 (per channel)."""
    quant_dir, _ = write_quantized(tiny_checkpoint_factory(arch, **SHAPE), tmp_path, fmt)
    _assert_same_bits(_fused_vs_tree(quant_dir, monkeypatch, "bf16", check_layers=_native_8bit,
                                     kinds={(GROUPED_INT8,) * 4}))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_int8_fused_decode_gives_the_module_trees_logits_bit_for_bit(arch, tiny_checkpoint_factory, monkeypatch):
    """``--quantization int8`` (cpu_int8_gemm; Qwen2's q/k/v bias in float32, as Int8Linear passes it)."""
    model_dir = tiny_checkpoint_factory(arch, dtype=torch.bfloat16, **SHAPE)
    _assert_same_bits(_fused_vs_tree(model_dir, monkeypatch, "bf16", check_layers=_native_int8, kinds={(INT8,) * 4},
                                     quantization="int8"))


@pytest.mark.parametrize("activations", ["bf16", "int8"])
def test_gguf_mixed_4_and_8bit_fused_decode_gives_the_module_trees_logits_bit_for_bit(activations, tmp_path,
                                                                                      monkeypatch):
    """Q4_K_M-like: q/k Q4_K beside a Q6_K v (the fused qkv joins in the 8-bit form, groups of 16), o Q4_1,
    gate/up Q4_K; down Q6_K in layer 0 and Q8_0 in layer 1. K-quants want 256 inputs per row."""
    meta = byte_level_metadata(train_byte_level_tokenizer())
    model = tiny_model(tiny_config(len(meta["tokens"]), hidden_size=256, intermediate_size=256), seed=3)
    part = {"q_proj": Q.Q4_K, "k_proj": Q.Q4_K, "v_proj": Q.Q6_K, "o_proj": Q.Q4_1, "gate_proj": Q.Q4_K,
            "up_proj": Q.Q4_K}
    quants = {}
    for n in model.state_dict():
        if n.endswith("proj.weight"):
            name = n.split(".")[-2]
            quants[n] = part.get(name) or (Q.Q6_K if ".layers.0." in n else Q.Q8_0)
    path = tmp_path / "mixed.gguf"
    write_gguf(path, model, meta, quants=quants)

    def check(layers, activations):
        assert all(m.path == "native" for m in layers)
        assert [m.bits == 4 for m in layers] == [False, True, True, False] * 2
        assert {m.int8_activations for m in layers if m.bits == 4} == {activations == "int8"}

    _assert_same_bits(_fused_vs_tree(path, monkeypatch, activations, vocab=len(meta["tokens"]), check_layers=check,
                                     kinds={(GROUPED_INT8, INT4, INT4, GROUPED_INT8)}))
