"""The fused decode layer on native 4-bit linears (kernels/cpu_decode_layer.py's decode_layer_q_): an int4 model's
pure decode steps run one native call per layer that calls the module tree's own kernels (int4_gemm with each
layer's activations, add + RMSNorm, rotary or Qwen3's q/k norms, paged attention, SiLU-and-mul) in its order, so
every sampled row's logits are the same bits as with ``KUBELLM_FUSED_DECODE=0``: ``--quantization int4``,
pre-quantized AWQ / GPTQ checkpoints and a GGUF file's 4-bit blocks, with bf16 and with int8 activations. Act-order layers (a column gather
before the GEMM) keep the module tree."""

from __future__ import annotations

import pytest
import torch
from test_engine_parity import LogitRecorder, _engine, _prompts
from test_gguf import Q, byte_level_metadata, tiny_config, tiny_model, train_byte_level_tokenizer, write_gguf
from test_prequantized_loading import SHAPE, write_quantized

from kubellm.kernels import cpu_decode_layer
from kubellm.runtime.layers import fused_decode
from kubellm.runtime.layers.quantized_linear import QuantizedLinear
from kubellm.runtime.models import llama
from kubellm.runtime.quantization.int8 import Int8Linear
from kubellm.runtime.sampling.params import SamplingParams

# int8 activations need VNNI, which every AVX512-BF16 CPU has (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("native_int4", "native_int4_int8", "native_bf16_gemm")


def _is_native_4bit(layers, activations):
    assert all(m.path == "native" and m.bits == 4 for m in layers)
    assert {m.int8_activations for m in layers} == {activations == "int8"}


def _fused_vs_tree(model_dir, monkeypatch, activations: str, fused_expected: bool = True, vocab: int = 512,
                   check_layers=_is_native_4bit, kinds: set | None = None, **engine_kw):
    """Greedy-generate with the fused layer on, then off; assert what ran (``check_layers(quantized linears,
    activations)``; with ``kinds``, the set of per-layer kind lists decode_layer_q_ was called with) and return
    (tokens, logits) of each."""
    calls = []

    def spy(*a):
        calls.append(tuple(a[9]))  # kinds
        return cpu_decode_layer.decode_layer_q_(*a)

    monkeypatch.setattr(fused_decode, "decode_layer_q_", spy)
    runs = {}
    for fused in ("1", "0"):
        monkeypatch.setenv(llama.FUSED_DECODE_ENV, fused)
        calls.clear()
        llm = _engine(model_dir, dtype="bfloat16", cpu_int4_activations=activations, **engine_kw)
        try:
            model = llm.engine.runner.model
            layers = [m for m in model.model.layers.modules() if isinstance(m, QuantizedLinear | Int8Linear)]
            assert len(layers) == 4 * len(model.model.layers)
            check_layers(layers, activations)
            assert (model.model.fused_layers is not None) == (fused == "1" and fused_expected)
            recorder = llm.engine.runner.sampler = LogitRecorder(llm.engine.runner.sampler)
            outs = llm.generate(_prompts(vocab=vocab)[:4], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)
        finally:
            llm.close()
        # pure decode steps came after the prefills and ran the fused layer on the expected kernels
        assert bool(calls) == (fused == "1" and fused_expected)
        if calls:
            assert set(calls) == (kinds or {(cpu_decode_layer.INT4,) * 4})
        runs[fused] = ([o.token_ids for o in outs], [torch.stack(recorder.rows[o.request_id]) for o in outs])
    return runs


def _assert_same_bits(runs):
    (tokens, rows), (tree_tokens, tree_rows) = runs["1"], runs["0"]
    assert tokens == tree_tokens
    for fused_rows, rows_of_tree in zip(rows, tree_rows, strict=True):
        assert torch.equal(fused_rows, rows_of_tree)


@pytest.mark.parametrize("activations", ["bf16", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_int4_models_fused_decode_gives_the_module_trees_logits_bit_for_bit(arch, activations, tiny_checkpoint_factory,
                                                                            monkeypatch):
    """``--quantization int4`` in bfloat16: Llama, Qwen2 (q/k/v bias, float32 into int4_gemm), Qwen3 (q/k norms)."""
    model_dir = tiny_checkpoint_factory(arch, dtype=torch.bfloat16, **SHAPE)
    _assert_same_bits(_fused_vs_tree(model_dir, monkeypatch, activations, quantization="int4"))


@pytest.mark.parametrize(("fmt", "activations"), [("awq-4bit-g128", "bf16"), ("awq-4bit-g128", "int8"),
                                                  ("gptq-4bit-asym-g128", "int8")])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prequantized_4bit_fused_decode_gives_the_module_trees_logits_bit_for_bit(arch, fmt, activations,
                                                                                  tiny_checkpoint_factory, tmp_path,
                                                                                  monkeypatch):
    """AWQ (fp16 scales, integer zero points) and GPTQ (asymmetric) checkpoints, fused q/k/v and gate/up parts."""
    quant_dir, _ = write_quantized(tiny_checkpoint_factory(arch, **SHAPE), tmp_path, fmt)
    _assert_same_bits(_fused_vs_tree(quant_dir, monkeypatch, activations))


@pytest.mark.parametrize("activations", ["bf16", "int8"])
def test_gguf_4bit_fused_decode_gives_the_module_trees_logits_bit_for_bit(activations, tmp_path, monkeypatch):
    """A GGUF file's Q4_0 attention and Q4_1 MLP linears kept packed (Q4_1: float32 zero points -min / d)."""
    meta = byte_level_metadata(train_byte_level_tokenizer())
    model = tiny_model(tiny_config(len(meta["tokens"])), seed=2)
    quants = {n: Q.Q4_1 if "mlp" in n else Q.Q4_0 for n in model.state_dict() if n.endswith("proj.weight")}
    path = tmp_path / "packed.gguf"
    write_gguf(path, model, meta, quants=quants)
    _assert_same_bits(_fused_vs_tree(path, monkeypatch, activations, vocab=len(meta["tokens"])))


def test_act_order_layers_keep_the_module_tree(tiny_checkpoint_factory, tmp_path, monkeypatch):
    """GPTQ desc_act: the layer gathers x's columns before int4_gemm (QuantizedLinear.perm), which the fused layer
    does not, so the model keeps running decode steps through the module tree."""
    quant_dir, _ = write_quantized(tiny_checkpoint_factory("llama", **SHAPE), tmp_path, "gptq-4bit-sym-desc_act-g32")
    _fused_vs_tree(quant_dir, monkeypatch, "bf16", fused_expected=False)
