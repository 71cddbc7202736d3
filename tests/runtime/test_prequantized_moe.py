"""Mixtures of experts quantized elsewhere (runtime/models/quantized_loading.py): every expert's gate/up and down
load as :class:`QuantizedLinear` layers straight from the stored tensors, the routers stay float, and the engine
routes as the bf16 path does.

Tiny Qwen3-MoE (experts ``mlp.experts.E.gate_proj``/``up_proj``/``down_proj``, layer 1 dense) and Mixtral
(``block_sparse_moe.experts.E.w1``/``w3``/``w2``) checkpoints are written in each format's published layout by
test_prequantized_loading.py's writers, with a dense twin holding the stored weights dequantized by the
format's documented math; the engine (chunked prefill, a batch of several prompts) on the quantized checkpoint
must compute what transformers computes on the twin."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_parity import LogitRecorder, _engine, _prompts, _run_and_compare
from test_prequantized_loading import write_quantized

from kubellm.runtime.layers.moe import FusedMoE
from kubellm.runtime.layers.quantized_linear import QuantizedLinear
from kubellm.runtime.models.checkpoint import CheckpointError
from kubellm.runtime.prequantized import QuantizedWeight
from kubellm.runtime.sampling_params import SamplingParams
from kubellm.runtime.tp_group import Group
from tiny_checkpoints import load_hf_model

# Experts 128 wide (groups of 128 on down_proj's inputs; native int4 wants outputs in multiples of 16).
SHAPE = dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=128, head_dim=32)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe(request, tiny_checkpoint_factory):
    return tiny_checkpoint_factory(request.param, **SHAPE)


def _check_layers(model, path: str):
    """Every expert and attention linear quantized (on ``path``), every router float."""
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(m.packed is None for m in moes)
    for m in moes:
        assert not isinstance(m.gate, QuantizedLinear)  # float, prepacked where the CPU path prepacks
        for expert in m.experts:
            assert isinstance(expert.gate_up_proj, QuantizedLinear) and isinstance(expert.down_proj, QuantizedLinear)
            assert expert.gate_up_proj.out_features == 2 * m.inter
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    dense_mlps = len(model.model.layers) - len(moes)
    assert len(layers) == 2 * len(model.model.layers) + 2 * dense_mlps + sum(2 * m.num_experts for m in moes)
    assert all(m.path == path for m in layers)


@pytest.mark.parametrize("fmt", ["awq-4bit-g128", "gptq-4bit-asym-g128", "gptq-4bit-sym-desc_act-g32",
                                 "w4a16-group128", "fp8-channel", "fp8-block128"])
def test_engine_on_quantized_experts_equals_transformers_on_the_dequantized_twin(fmt, moe, tmp_path):
    """float32: every expert dequantizes per call; greedy tokens equal, logits within the parity tolerance."""
    quant_dir, twin_dir = write_quantized(moe, tmp_path, fmt)
    llm = _engine(quant_dir)
    _check_layers(llm.engine.runner.model, "dequantize")
    _run_and_compare(llm, twin_dir, _prompts())


@pytest.mark.parametrize("fmt", ["awq-4bit-g128", "gptq-4bit-sym-desc_act-g32", "gptq-8bit-sym-g128"])
def test_native_cpu_kernels_serve_quantized_experts(fmt, moe, tmp_path, native_int4, native_grouped_int8):
    """bfloat16 on the AVX512-BF16 kernels: experts run cpu_int4_gemm / cpu_grouped_int8_gemm over the tokens
    routed to them (act-order through the load-time column sort). Compared on average with the float32 twin on
    the engine's own tokens: in bfloat16 a rounding difference can swap a token's 2nd and 3rd expert, which moves
    single logits by up to ~5 on these tiny models whatever the weights (the dense twin in bf16 measured
    0.04-0.42 mean |error| per prompt, 0.11 overall); a wrong kernel moves them all by the logits' own size."""
    quant_dir, twin_dir = write_quantized(moe, tmp_path, fmt)
    llm = _engine(quant_dir, dtype="bfloat16")
    _check_layers(llm.engine.runner.model, "native")
    recorder = LogitRecorder(llm.engine.runner.sampler)
    llm.engine.runner.sampler = recorder
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    model = load_hf_model(twin_dir, torch.float32)
    errors = []
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs, strict=True):
            ref = model(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1:].float()
            errors.append((torch.stack(recorder.rows[out.request_id]) - ref).abs().mean().item())
    assert sum(errors) / len(errors) < 0.25, f"mean |logit error| per prompt {errors}"


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


def test_a_quantized_router_is_refused_by_name(tiny_checkpoint_factory, tmp_path):
    quant_dir, _ = write_quantized(tiny_checkpoint_factory("qwen3_moe", **SHAPE), tmp_path, "fp8-channel")
    tensors = load_file(quant_dir / "model.safetensors")
    router = tensors.pop("model.layers.0.mlp.gate.weight")
    scale = router.abs().amax(dim=1, keepdim=True) / 448
    tensors |= {"model.layers.0.mlp.gate.weight": (router / scale).to(torch.float8_e4m3fn),
                "model.layers.0.mlp.gate.weight_scale": scale}
    save_file(tensors, quant_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"quantized mixture-of-experts router \(model.layers.0.mlp.gate"):
        _engine(quant_dir)


def test_a_missing_expert_tensor_is_named(tiny_checkpoint_factory, tmp_path):
    quant_dir, _ = write_quantized(tiny_checkpoint_factory("mixtral", **SHAPE), tmp_path, "awq-4bit-g128")
    tensors = load_file(quant_dir / "model.safetensors")
    del tensors["model.layers.2.block_sparse_moe.experts.5.w3.scales"]
    save_file(tensors, quant_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing quantized tensors of 1 layers, e.g. "
                                              r"model.layers.2.mlp.experts.5.gate_up_proj"):
        _engine(quant_dir)

