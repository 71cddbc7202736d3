"""Mixtures of experts quantized elsewhere (runtime/quantization/loading.py): every expert's gate/up and down
load as :class:`QuantizedLinear` layers straight from the stored tensors, the routers are float (dequantized at
load where a checkpoint stores them quantized), and the engine routes as the bf16 path does.

Tiny Qwen3-MoE (experts ``mlp.experts.E.gate_proj``/``up_proj``/``down_proj``, layer 1 dense) and Mixtral
(``block_sparse_moe.experts.E.w1``/``w3``/``w2``) checkpoints are written in each format's published layout by
test_prequantized_loading.py's writers, with a dense twin holding the stored weights dequantized by the
format's documented math; the engine (chunked prefill, a batch of several prompts) on the quantized checkpoint
must compute what transformers computes on the twin."""

from __future__ import annotations

import json
import logging

import pytest
import test_engine_parity
import torch
from safetensors.torch import load_file, save_file
from test_engine_parity import _engine, _prompts, _run_and_compare, mean_logit_errors
from test_prequantized_loading import write_quantized

from kubellm.kernels import cpu_grouped_int8_gemm, cpu_moe
from kubellm.runtime.distributed.tp_group import Group
from kubellm.runtime.layers.linear import pack_linears
from kubellm.runtime.layers.moe import FusedMoE, pack_experts
from kubellm.runtime.layers.quantized_linear import QuantizedLinear
from kubellm.runtime.layers.quantized_weight import QuantizedWeight
from kubellm.runtime.models.checkpoint import CheckpointError

# Experts 128 wide (groups of 128 on down_proj's inputs; native int4 wants outputs in multiples of 16).
SHAPE = dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=128, head_dim=32)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe(request, tiny_checkpoint_factory):
    return tiny_checkpoint_factory(request.param, **SHAPE)


def _check_layers(model, path: str, fused: bool = False):
    """Every expert and attention linear quantized (on ``path``), every router float; with ``fused`` the
    experts stacked for kernels/cpu_moe.py's quantized kernel instead of per-expert layers."""
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(isinstance(m.packed, cpu_moe.QuantizedExperts) if fused else m.packed is None for m in moes)
    for m in moes:
        assert not isinstance(m.gate, QuantizedLinear)  # float, prepacked where the CPU path prepacks
        assert len(m.experts) == (0 if fused else m.num_experts)
        for expert in m.experts:
            assert isinstance(expert.gate_up_proj, QuantizedLinear) and isinstance(expert.down_proj, QuantizedLinear)
            assert expert.gate_up_proj.out_features == 2 * m.inter
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    dense_mlps = len(model.model.layers) - len(moes)
    assert len(layers) == 2 * len(model.model.layers) + 2 * dense_mlps + sum(2 * len(m.experts) for m in moes)
    # AVX2 builds' 8-bit GEMM takes float32 rows: their 8-bit layers run it where others dequantize
    native_8bit = path == "dequantize" and cpu_grouped_int8_gemm.takes_float32()
    assert all(m.path == ("native" if native_8bit and m.bits == 8 and not m.float_values else path)
               for m in layers), [(m.bits, m.path) for m in layers]


@pytest.mark.parametrize("fmt", ["awq-4bit-g128", "gptq-4bit-asym-g128", "gptq-4bit-sym-desc_act-g32",
                                 "w4a16-group128", "fp8-channel", "fp8-block128"])
def test_engine_on_quantized_experts_equals_transformers_on_the_dequantized_twin(fmt, moe, tmp_path):
    """float32: every expert dequantizes per call; greedy tokens equal, logits within the parity tolerance."""
    quant_dir, twin_dir = write_quantized(moe, tmp_path, fmt)
    llm = _engine(quant_dir)
    _check_layers(llm.engine.runner.model, "dequantize")
    _run_and_compare(llm, twin_dir, _prompts())


@pytest.mark.parametrize(("fmt", "activations"), [
    ("awq-4bit-g128", "bf16"), ("w4a16-group128", "bf16"), ("gptq-4bit-sym-desc_act-g32", "bf16"),
    ("gptq-8bit-sym-g128", "bf16"), ("fp8-channel", "bf16"), ("fp8-block128", "bf16"), ("w4a16-group128", "int8")])
def test_native_cpu_kernels_serve_quantized_experts(fmt, activations, moe, tmp_path, native_int4, native_grouped_int8,
                                                     native_moe, native_fp8, native_int4_int8):
    """bfloat16 on the AVX512-BF16 kernels: 4-bit and 8-bit experts without act-order stacked and run by cpu_moe's
    quantized kernel, every hit expert of a layer in one call; act-order 4-bit and FP8 experts run cpu_int4_gemm /
    cpu_fp8_gemm over the tokens routed to them (act-order through the load-time column sort), one GEMM per hit
    expert. Compared on average with the float32 twin on
    the engine's own tokens: in bfloat16 a rounding difference can swap a token's 2nd and 3rd expert, which moves
    single logits by up to ~5 on these tiny models whatever the weights (the dense twin in bf16 measured
    0.04-0.42 mean |error| per prompt, 0.11 overall); a wrong kernel moves them all by the logits' own size."""
    quant_dir, twin_dir = write_quantized(moe, tmp_path, fmt)
    llm = _engine(quant_dir, dtype="bfloat16", cpu_int4_activations=activations)
    _check_layers(llm.engine.runner.model, "native",
                  fused=fmt in ("awq-4bit-g128", "w4a16-group128", "gptq-8bit-sym-g128"))
    errors = mean_logit_errors(llm, twin_dir, _prompts())
    # int8 activations (the default on VNNI for the 4-bit attention linears) round each activation group too,
    # which swaps more near-tied experts: 0.30 measured on the tiny Mixtral; a wrong kernel gives the logits' size.
    limit = 0.4 if activations == "int8" else 0.25
    assert sum(errors) / len(errors) < limit, f"mean |logit error| per prompt {errors}"


@pytest.mark.parametrize("path", ["dequantize", "native"])
def test_quantized_experts_route_and_sum_as_the_dense_layer_does(path, request):
    """One layer, the same router and inputs: experts as QuantizedLinear layers give what the same layer with
    the dequantized weights as plain linears gives (float32 exactly; bfloat16 on the native kernels within
    rounding, the routing identical since the router is shared)."""
    if path == "native":
        request.getfixturevalue("native_int4")
    hidden, inter, experts = 64, 32, 8
    dtype = torch.bfloat16 if path == "native" else torch.float32
    gen = torch.Generator().manual_seed(0)
    dense = FusedMoE(hidden, inter, experts, 2, True, Group()).eval().to(dtype)
    quantized = FusedMoE(hidden, inter, experts, 2, True, Group()).eval().to(dtype)  # as loaded: cast, then swap
    with torch.no_grad():
        dense.gate.weight.copy_(torch.randn(experts, hidden, generator=gen).to(dtype))
        quantized.gate.weight.copy_(dense.gate.weight)
        for d, q in zip(dense.experts, quantized.experts, strict=True):
            for name, (out_f, in_f) in (("gate_up_proj", (2 * inter, hidden)), ("down_proj", (hidden, inter))):
                weight = QuantizedWeight(torch.randint(0, 16, (out_f, in_f), generator=gen),
                                         torch.rand(out_f, in_f // 32, generator=gen) / 8 + 0.01,
                                         torch.randint(0, 16, (out_f, in_f // 32), generator=gen).float(), 32)
                getattr(d, name).weight.copy_(weight.dequantize().to(dtype))
                setattr(q, name, QuantizedLinear(weight, 4, path))
    x = torch.randn(11, hidden, generator=gen).to(dtype)
    with torch.inference_mode():
        expected, got = dense(x).float(), quantized(x).float()
    assert all(e.gate_up_proj.path == path for e in quantized.experts)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.05 * expected.abs().max().item(), rtol=0)
    torch.testing.assert_close(got, expected, **tol)


def _quantized_moe(hidden: int, inter: int, experts: int, top_k: int, group: int, seed: int,
                   bits: tuple[int, int] = (4, 4)) -> FusedMoE:
    """A bfloat16 layer whose experts are native QuantizedLinear layers of random values, scales and zero points
    (scales float16 for gate/up, float32 for down: both kinds the loader keeps); ``bits`` of gate/up and down, 4
    (values 0..15, zero points) or 8 (int8 values, symmetric as GGUF Q8_0/Q6_K)."""
    gen = torch.Generator().manual_seed(seed)
    moe = FusedMoE(hidden, inter, experts, top_k, True, Group()).eval().to(torch.bfloat16)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(experts, hidden, generator=gen).to(torch.bfloat16))
    for expert in moe.experts:
        for name, (out_f, in_f), b in zip(("gate_up_proj", "down_proj"), ((2 * inter, hidden), (hidden, inter)), bits,
                                          strict=True):
            top = 16 if b == 4 else 128
            scales = (torch.rand(out_f, in_f // group, generator=gen) + 0.5) / (top / 4 * in_f**0.5)
            if name == "gate_up_proj":
                scales = scales.half().float()
            zeros = torch.randint(0, 16, (out_f, in_f // group), generator=gen).float() if b == 4 else None
            weight = QuantizedWeight(torch.randint(0 if b == 4 else -128, top, (out_f, in_f), generator=gen), scales,
                                     zeros, group)
            setattr(expert, name, QuantizedLinear(weight, b, "native"))
    return moe


@pytest.mark.parametrize("tokens", [1, 7, 40])
@pytest.mark.parametrize(("experts", "top_k"), [(64, 2), (128, 8)])
@pytest.mark.parametrize("bits", [(4, 4), (8, 8), (4, 8)], ids=["4-bit", "8-bit", "4-bit-gate-up-8-bit-down"])
def test_fused_quantized_experts_equal_the_per_expert_path(tokens, experts, top_k, bits, native_moe):
    """pack_experts stacks a layer of native 4-bit, 8-bit or mixed experts for cpu_moe's quantized kernel (the
    per-expert layers dropped, the stacked bytes those of the layers), and the layer then computes what it
    computed one GEMM per hit expert, within bfloat16 rounding: the per-expert path sums the k weighted outputs
    in bfloat16, the kernel in float32 (and from 16 rows the per-expert 8-bit GEMM rounds its dequantized
    weights to bfloat16). Some experts get no token in every case (checked)."""
    import copy

    hidden, inter = max(64, experts), 32
    moe = _quantized_moe(hidden, inter, experts, top_k, 32, seed=tokens + experts, bits=bits)
    # Router logits that never tie (bfloat16 ones among 128 experts often do, and torch.topk breaks ties in no
    # fixed order): expert e's logit is input e, each row's first inputs a permutation of distinct values.
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=gen)
    x[:, :experts] = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)]) / 32
    x = x.to(torch.bfloat16)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.eye(experts, hidden))
    fused = copy.deepcopy(moe)
    layer_bytes = sum(b.numel() * b.element_size() for e in moe.experts for b in e.buffers() if b is not None)
    assert pack_experts(fused) == 1
    assert isinstance(fused.packed, cpu_moe.QuantizedExperts) and len(fused.experts) == 0
    stacked = [t for t in fused.packed if isinstance(t, torch.Tensor)]
    assert sum(t.numel() * t.element_size() for t in stacked) == layer_bytes
    assert fused.packed.s13.dtype == torch.float16 and fused.packed.s2.dtype == torch.float32
    gate = fused.gate
    pack_linears(fused, "native")  # a native router: the fused decode layer still takes only bfloat16 experts
    assert fused.fused_decode_args() is None
    fused.gate = gate
    with torch.inference_mode():
        assert torch.unique(moe.gate(x).topk(top_k, dim=-1).indices).numel() < experts  # some experts idle
        expected, got = moe(x).float(), fused(x).float()
    torch.testing.assert_close(got, expected, atol=0.02 * expected.abs().max().item(), rtol=0.02)


def test_experts_the_kernel_does_not_take_keep_the_per_expert_path(native_moe):
    """Act-order (a column permutation per expert) and a linear whose experts differ in width (one 8-bit expert
    among 4-bit ones) are not stacked."""
    moe = _quantized_moe(64, 32, 4, 2, 32, seed=0)
    moe.experts[1].down_proj.perm = torch.arange(32).flip(0)
    assert pack_experts(moe) == 0 and moe.packed is None and len(moe.experts) == 4
    moe = _quantized_moe(64, 32, 4, 2, 32, seed=0)
    weight = QuantizedWeight(torch.randint(-128, 128, (64, 32)), torch.rand(64, 1) / 100, None, 32)
    moe.experts[2].down_proj = QuantizedLinear(weight, 8, "native")
    assert pack_experts(moe) == 0 and moe.packed is None


def test_experts_the_config_ignores_load_in_float(tiny_checkpoint_factory, tmp_path):
    """compressed-tensors ``ignore`` naming the experts: they load as the dense layers they are stored as."""
    quant_dir, _ = write_quantized(tiny_checkpoint_factory("mixtral", **SHAPE), tmp_path, "w4a16-group128")
    dense = load_file(tiny_checkpoint_factory("mixtral", **SHAPE) / "model.safetensors")
    tensors = {n: t for n, t in load_file(quant_dir / "model.safetensors").items() if ".experts." not in n}
    tensors |= {n: t for n, t in dense.items() if ".experts." in n}
    save_file(tensors, quant_dir / "model.safetensors")
    config = json.loads((quant_dir / "config.json").read_text())
    config["quantization_config"]["ignore"] += ["re:.*block_sparse_moe\\.experts\\..*"]
    (quant_dir / "config.json").write_text(json.dumps(config))
    model = _engine(quant_dir).engine.runner.model
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert all(type(e.down_proj) is not QuantizedLinear for m in moes for e in m.experts)
    assert isinstance(model.model.layers[0].self_attn.o_proj, QuantizedLinear)


@pytest.mark.parametrize("fmt", ["gptq-4bit-asym-g128", "gptq-4bit-sym-desc_act-g32", "gptq-8bit-sym-g128",
                                 "w4a16-group128", "w8a16-channel", "fp8-block128"])
def test_a_quantized_router_is_dequantized_at_load(fmt, moe, tmp_path, caplog, monkeypatch):
    """Routers stored quantized (GPTQ, compressed-tensors pack-quantized, FP8 blocks with weight_scale_inv; act-order
    too) are dequantized once by the format's reader and served float: the router equals the twin's (the stored
    router dequantized by the format's math, which is not the float one, so a router from anywhere else would
    route differently), a log line counts them, and greedy tokens and logits equal transformers' on the twin."""
    quant_dir, twin_dir = write_quantized(moe, tmp_path, fmt, routers=True)
    stored = load_file(quant_dir / "model.safetensors")
    twin, dense = load_file(twin_dir / "model.safetensors"), load_file(moe / "model.safetensors")
    names = sorted(n for n in twin if n.endswith(".gate.weight"))
    assert names and all(n not in stored or stored[n].dtype == torch.float8_e4m3fn for n in names)  # none float
    with caplog.at_level(logging.INFO, logger="kubellm"):
        llm = _engine(quant_dir)
    assert f"{len(names)} mixture-of-experts routers stored quantized" in caplog.text
    model = llm.engine.runner.model
    _check_layers(model, "dequantize")
    x = torch.randn(3, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(0))
    gates = [m.gate for m in model.modules() if isinstance(m, FusedMoE)]
    for gate, name in zip(gates, names, strict=True):
        assert not torch.allclose(twin[name], dense[name], rtol=0, atol=1e-4)
        with torch.no_grad():  # prepacked on CPU: compared by its output
            torch.testing.assert_close(gate(x), x @ twin[name].float().t(), rtol=1e-5, atol=1e-5)
    # float32 logits of O(1-10): a wrong router moves them by O(1); the oneDNN-packed router's summation order
    # alone moved one logit of Mixtral's act-order case by 1.05e-4, just past the parity default of 1e-4.
    monkeypatch.setattr(test_engine_parity, "LOGIT_ATOL", 5e-4)
    _run_and_compare(llm, twin_dir, _prompts())


def test_an_incomplete_quantized_router_is_named(tiny_checkpoint_factory, tmp_path):
    quant_dir, _ = write_quantized(tiny_checkpoint_factory("qwen3_moe", **SHAPE), tmp_path, "gptq-4bit-asym-g128",
                                   routers=True)
    tensors = load_file(quant_dir / "model.safetensors")
    del tensors["model.layers.0.mlp.gate.qzeros"]
    save_file(tensors, quant_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing 1 tensors, e.g. model.layers.0.mlp.gate.weight"):
        _engine(quant_dir)


def test_a_missing_expert_tensor_is_named(tiny_checkpoint_factory, tmp_path):
    quant_dir, _ = write_quantized(tiny_checkpoint_factory("mixtral", **SHAPE), tmp_path, "awq-4bit-g128")
    tensors = load_file(quant_dir / "model.safetensors")
    del tensors["model.layers.2.block_sparse_moe.experts.5.w3.scales"]
    save_file(tensors, quant_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing quantized tensors of 1 layers, e.g. "
                                              r"model.layers.2.mlp.experts.5.gate_up_proj"):
        _engine(quant_dir)

