"""Weight-only int8 (``--quantization int8``): the quantizer's bounds, the layer against a plain matmul on the
dequantized weight, and the whole engine against transformers running on the same dequantized weights: an
int8 model must compute what its dequantized twin computes, token for token."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_parity import _engine, _prompts, _run_and_compare, tiny_mixtral  # noqa: F401 (fixture)
from torch import nn

from kubellm.kernels import cpu_int8_gemm
from kubellm.runtime.engine.config import EngineConfig
from kubellm.runtime.quantization.int4 import int4_group, int4_layer, quantize_int4
from kubellm.runtime.quantization.int8 import Int8Linear, dequantize_int8, quantize_int8

LAYER_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                 "w1", "w2", "w3")  # Mixtral's experts; routers (mlp.gate, block_sparse_moe.gate) stay


def test_quantize_int8_bounds_and_round_trip():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 100, generator=g) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different scale
    w[5] = 0.0
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scales.shape == (48,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert scales[5] == 1.0 and not q[5].any()
    torch.testing.assert_close(scales[:5], w[:5].abs().amax(dim=1) / 127)
    error = (dequantize_int8(q, scales) - w).abs()
    assert (error <= scales[:, None] / 2 + 1e-7).all(), "rounding must be to the nearest step"


@pytest.mark.parametrize("dtype,path", [(torch.float32, "torch"), (torch.float32, "dequantize"),
                                        (torch.bfloat16, "native"), (torch.bfloat16, "torch"),
                                        (torch.bfloat16, "dequantize"), (torch.float32, "triton"),
                                        (torch.bfloat16, "triton")])  # native: bf16 only
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 15, 40])  # 40: past INT8_GEMM_MAX_ROWS (torch path) and 3 native row tiles
def test_int8_linear_equals_a_matmul_on_the_dequantized_weight(dtype, bias, path, rows, request):
    """Every GEMM path of the layer; ``triton`` (the CUDA path) runs through Triton's interpreter here."""
    if path == "native":
        request.getfixturevalue("native_int8")  # skips without the kernel; fails under CI where the CPU has it
    device = "cuda" if path == "triton" and torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    linear = nn.Linear(96, 48, bias=bias).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 96, generator=g))
        if bias:
            linear.bias.copy_(torch.randn(48, generator=g))
    q, scales = quantize_int8(linear.weight)
    weight = dequantize_int8(q, scales)
    expected_bias = None if linear.bias is None else linear.bias.detach().float()
    layer = Int8Linear(linear.to(device), path=path)
    assert layer.path == path and layer.qweight.dtype == torch.int8 and layer.qweight.numel() == 48 * 96
    torch.testing.assert_close(layer.dequantized(torch.float32).cpu(), weight, atol=0, rtol=2**-8)
    x = torch.randn(rows, 1, 96, generator=g).to(dtype)
    expected = nn.functional.linear(x.float(), weight, expected_bias)
    out = layer(x.to(device)).cpu()
    assert out.shape == (rows, 1, 48) and out.dtype == dtype
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 1.6e-2}
    torch.testing.assert_close(out.float(), expected, **tol)


def test_int8_linear_picks_its_path_from_the_device_and_refuses_unknown_ones():
    linear = nn.Linear(64, 32).to(torch.bfloat16)
    expected = "native" if cpu_int8_gemm.available() else "torch"
    assert Int8Linear(linear).path == expected
    assert Int8Linear(nn.Linear(64, 32)).path == "torch"
    with pytest.raises(ValueError, match="int8 GEMM path 'int4'"):
        Int8Linear(linear, path="int4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_int8_kernel_and_its_start_up_check(dtype, monkeypatch):
    """The kernel against its reference with partial tiles on every side, and the check that gates it on a
    GPU: passes for the sound kernel, names a broken one."""
    from kubellm.kernels import triton_check, triton_int8_gemm

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    x = torch.randn(21, 70, generator=g).to(dtype)
    q = torch.randint(-127, 128, (33, 70), generator=g, dtype=torch.int8)
    scales, bias = torch.rand(33, generator=g) / 50, torch.randn(33, generator=g)
    for b in (None, bias):
        out = triton_int8_gemm.int8_gemm(*(t.to(device) for t in (x, q, scales)),
                                         None if b is None else b.to(device), block_m=16, block_n=16,
                                         block_k=16).cpu()
        ref = triton_int8_gemm.reference_int8_gemm(x, q, scales, b)
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=2**-7)
    assert triton_check.check_int8_gemm(device, dtype) is None
    sound = triton_int8_gemm.int8_gemm
    monkeypatch.setattr(triton_int8_gemm, "int8_gemm", lambda *a, **k: sound(*a, **k) * 1.05)
    assert "int8 GEMM differs from its reference" in triton_check.check_int8_gemm(device, dtype)


def _dequantized_twin(model_dir, out_dir, method="int8"):
    """A copy of the checkpoint whose decoder linear weights are what ``method`` makes of them."""
    shutil.copytree(model_dir, out_dir)
    tensors = load_file(out_dir / "model.safetensors")
    changed = 0
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith(".weight") and name.split(".")[-2] in LAYER_WEIGHTS:
            if method == "int8":
                tensors[name] = dequantize_int8(*quantize_int8(t), t.dtype)
            else:
                tensors[name] = quantize_int4(t, int4_group(t.shape[1])).dequantize(t.dtype)
            changed += 1
    assert changed > 0
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


@pytest.mark.parametrize("fixture,budget", [("tiny_llama", 16), ("tiny_qwen2", 64), ("tiny_mixtral", 16)])
def test_int8_engine_equals_transformers_on_the_dequantized_weights(fixture, budget, request, tmp_path):
    """Per-row quantization of the fused q/k/v and gate/up weights equals quantizing each projection alone, so
    the twin's weights are exactly the engine's. Qwen2 adds the qkv bias, and its 64-token budget sends
    prefill steps down the dequantize path while decodes take the int8 GEMM."""
    model_dir = request.getfixturevalue(fixture)
    twin = _dequantized_twin(model_dir, tmp_path / "twin")
    llm = _engine(model_dir, quantization="int8", max_num_batched_tokens=budget)
    model = llm.engine.runner.model
    int8 = [m for m in model.modules() if isinstance(m, Int8Linear)]
    # qkv and o, then gate_up and down of the MLP or of every expert; the LM head and routers stay.
    mlps = [len(layer.mlp.experts) if hasattr(layer.mlp, "experts") else 1 for layer in model.model.layers]
    assert len(int8) == sum(2 + 2 * n for n in mlps)
    assert not isinstance(model.lm_head, Int8Linear)
    _run_and_compare(llm, twin, _prompts())
    assert llm.engine.block_manager.num_used_blocks == 0


def test_int8_changes_the_model():
    """Guards the twin test against a no-op: the quantized weight is not the original one."""
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    assert not torch.equal(dequantize_int8(*quantize_int8(w)), w)


@pytest.mark.parametrize("method", ["fp8", "awq", "gptq", "gguf"])
def test_checkpoint_formats_are_accepted_as_checks(method):
    """A format's name is checked against the checkpoint at load (test_prequantized_loading.py), not refused."""
    assert EngineConfig(model="x", device="cpu", quantization=method).quantization == method


def test_unknown_method_and_a_bad_tensor_parallel_size_are_refused():
    with pytest.raises(ValueError, match="quantization: unknown 'int3'; use none, int8, int4, fp8, awq, gptq, gguf"):
        EngineConfig(model="x", device="cpu", quantization="int3")
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        EngineConfig(model="x", device="cpu", tensor_parallel_size=0)



def test_the_settings_table_offers_every_named_format_and_only_those():
    from kubellm.runtime.engine.settings import QUANTIZATIONS
    from kubellm.runtime.quantization.registry import FORMATS, METHODS

    assert QUANTIZATIONS == METHODS
    assert {f.name for f in FORMATS.values() if not f.flag_choice} == {"compressed-tensors"}  # detected, not named


# ------------------------------------------------------------------------------------------------------ int4


def test_int4_quantizer_is_asymmetric_min_max_within_half_a_step():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(24, 256, generator=g) * torch.logspace(-2, 1, 24)[:, None] + 0.3  # off-centre groups
    w[3, :32] = 0.7  # a constant group
    qw = quantize_int4(w, 32)
    q, scales, zeros = qw.values, qw.scales, qw.zeros
    assert q.dtype == torch.uint8 and q.shape == (24, 256) and scales.shape == zeros.shape == (24, 8)
    assert qw.group_size == 32 and int(q.min()) == 0 and int(q.max()) == 15
    groups = q.view(24, 8, 32)
    spans = groups.amax(dim=2) == 15  # each group's 16 levels span its range (the constant one: all 0)
    assert (groups.amin(dim=2) == 0).all() and not spans[3, 0] and spans.sum() == 24 * 8 - 1
    for t in (scales, zeros):  # float16 holds them: the layer stores them in half the bytes
        assert torch.equal(t.half().float(), t)
    step = scales.repeat_interleave(32, dim=1)
    error = (qw.dequantize() - w).abs()
    assert (error <= step / 2 + 1e-3 * step + 1e-6).all()
    assert torch.allclose(qw.dequantize()[3, :32], torch.full((32,), 0.7), atol=1e-3)


def test_int4_reproduces_weights_already_on_a_q4_1_grid_of_its_groups():
    """What flatters the demo model's number: weights that are ``m + d * q`` per block of 32 (GGUF Q4_1, every
    level used at both ends) come back to float16 rounding (the symmetric quantizer this replaced: 7% off)."""
    g = torch.Generator().manual_seed(7)
    d, m = torch.rand(16, 4, 1, generator=g) * 0.01 + 1e-3, torch.randn(16, 4, 1, generator=g) * 0.02
    levels = torch.randint(0, 16, (16, 4, 32), generator=g)
    levels[..., 0], levels[..., 1] = 0, 15
    w = (m + d * levels).view(16, 128)
    err = (quantize_int4(w, 32).dequantize() - w).abs().max() / w.abs().max()
    assert err < 2e-3


@pytest.mark.parametrize("in_features,group", [(1536, 32), (576, 32), (96, 32), (40, 40)])
def test_int4_group_is_32_where_the_layer_allows(in_features, group):
    assert int4_group(in_features) == group


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_layer_equals_a_matmul_on_the_dequantized_weight(dtype, bias):
    """Off the native kernel (float32 anywhere, bfloat16 without it) the layer dequantizes per call."""
    from kubellm.runtime.layers.kernel_choice import KernelChoice
    from kubellm.runtime.layers.quantized_linear import QuantizedLinear

    g = torch.Generator().manual_seed(5)
    linear = nn.Linear(192, 40, bias=bias).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 192, generator=g))
    weight = quantize_int4(linear.weight, 32).dequantize()
    expected_bias = None if linear.bias is None else linear.bias.detach().float()
    layer = int4_layer(linear, KernelChoice())
    assert isinstance(layer, QuantizedLinear) and layer.path == "dequantize" and layer.group_size == 32
    assert layer.qweight.numel() == 40 * 96 and layer.scales.dtype == layer.zeros.dtype == torch.float16
    x = torch.randn(9, 192, generator=g).to(dtype)
    out = layer(x)
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 1.6e-2}
    torch.testing.assert_close(out.float(), nn.functional.linear(x.float(), weight, expected_bias), **tol)


def test_int4_layer_takes_int8_activations_from_the_kernel_choice():
    from kubellm.runtime.layers.kernel_choice import KernelChoice

    linear = nn.Linear(64, 32).to(torch.bfloat16)
    assert not int4_layer(linear, KernelChoice(grouped_int4_gemm="native")).int8_activations
    assert int4_layer(linear, KernelChoice(grouped_int4_gemm="native", int4_activations="int8")).int8_activations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_layer_on_cuda_runs_the_triton_grouped_gemm_on_the_same_weights(dtype):
    """The CUDA path of --quantization int4 (Triton's interpreter here): float zero points and all."""
    from kubellm.runtime.layers.kernel_choice import KernelChoice

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(8)
    linear = nn.Linear(128, 48, bias=True).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 128, generator=g) * 0.05 + 0.01)
    weight = quantize_int4(linear.weight, 32).dequantize()
    layer = int4_layer(linear.to(device), KernelChoice(grouped_int4_gemm="triton"))
    assert layer.path == "triton" and layer.group_size == 32
    x = torch.randn(5, 128, generator=g).to(dtype)
    expected = nn.functional.linear(x.float(), weight, linear.bias.detach().float().cpu())
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.02, "rtol": 1.6e-2}
    torch.testing.assert_close(layer(x.to(device)).float().cpu(), expected, **tol)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_mixtral"])
def test_int4_engine_equals_transformers_on_the_dequantized_weights(fixture, request, tmp_path):
    """Groups run along the inputs, so the fused q/k/v and gate/up rows quantize as the separate projections
    do: the twin's weights are exactly the engine's (float32 on CPU: the dequantize path), experts' included."""
    from kubellm.runtime.layers.quantized_linear import QuantizedLinear

    model_dir = request.getfixturevalue(fixture)
    twin = _dequantized_twin(model_dir, tmp_path / "twin", method="int4")
    llm = _engine(model_dir, quantization="int4")
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    mlps = [len(layer.mlp.experts) if hasattr(layer.mlp, "experts") else 1 for layer in model.model.layers]
    assert len(layers) == sum(2 + 2 * n for n in mlps) and all(m.bits == 4 for m in layers)
    _run_and_compare(llm, twin, _prompts())
    assert llm.engine.block_manager.num_used_blocks == 0


def test_int4_on_bf16_cpu_runs_the_native_int4_kernel_on_the_same_weights(native_int4):
    """Where cpu_int4_gemm loads, --quantization int4 computes with it on quantize_int4's weights."""
    from kubellm.runtime.layers.kernel_choice import KernelChoice
    from kubellm.runtime.layers.quantized_linear import QuantizedLinear
    from kubellm.runtime.quantization.registry import quantize_model

    gen = torch.Generator().manual_seed(5)
    linear = nn.Linear(256, 48, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 256, generator=gen) * 0.05)
        linear.bias.copy_(torch.randn(48, generator=gen) * 0.1)
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.ModuleDict({"proj": linear})])
    reference = quantize_int4(linear.weight, 32).dequantize()
    assert quantize_model(model, "int4", KernelChoice(grouped_int4_gemm="native")) == 1
    layer = model.model.layers[0]["proj"]
    assert isinstance(layer, QuantizedLinear) and layer.path == "native" and layer.group_size == 32
    torch.testing.assert_close(layer.dequantized(), reference)
    x = torch.randn(3, 256, generator=gen).to(torch.bfloat16)
    expected = x.float() @ reference.T + linear.bias.float()
    torch.testing.assert_close(layer(x).float(), expected, atol=0.02, rtol=0.02)


def test_int4_experts_on_bf16_cpu_run_the_fused_int4_moe_kernel(request, native_moe, native_int4, tmp_path):
    """--quantization int4 in bfloat16 where cpu_moe loads: every layer's 4-bit experts are stacked for its fused
    int4 kernel, and the logits of the engine's own greedy tokens are close on average to transformers' (float32)
    on the dequantized twin. On average: in bfloat16 a rounding difference can swap a token's 2nd and 3rd expert,
    which moves single logits a lot on these tiny models (test_prequantized_moe's native test measures it); a
    wrong kernel moves them all by the logits' own size."""
    from test_engine_parity import mean_logit_errors

    from kubellm.kernels import cpu_moe
    from kubellm.runtime.layers.moe import FusedMoE

    model_dir = request.getfixturevalue("tiny_mixtral")
    twin = _dequantized_twin(model_dir, tmp_path / "twin", method="int4")
    llm = _engine(model_dir, quantization="int4", dtype="bfloat16")
    moes = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(isinstance(m.packed, cpu_moe.QuantizedExperts) and not m.experts for m in moes)
    errors = mean_logit_errors(llm, twin, _prompts())
    assert sum(errors) / len(errors) < 0.25, f"mean |logit error| per prompt {errors}"
