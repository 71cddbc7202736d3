"""Weight-only int8 (``--quantization int8``): the quantizer's bounds, the layer against a plain matmul on the
dequantized weight, and the whole engine against transformers running on the same dequantized weights: an
int8 model must compute what its dequantized twin computes, token for token."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_parity import _engine, _prompts, _run_and_compare
from torch import nn

from kubellm.runtime.config import EngineConfig
from kubellm.runtime.quantization import Int8Linear, dequantize_int8, quantize_int8

LAYER_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("packed", [True, False], ids=["int8-gemm", "dequantize"])
@pytest.mark.parametrize("rows", [1, 15, 40])  # 40: past INT8_GEMM_MAX_ROWS, the prefill path
def test_int8_linear_equals_a_matmul_on_the_dequantized_weight(dtype, bias, packed, rows):
    g = torch.Generator().manual_seed(1)
    linear = nn.Linear(96, 40, bias=bias).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=g))
    layer = Int8Linear(linear)
    layer._packed_gemm &= packed
    assert layer.qweight.dtype == torch.int8 and layer.qweight.shape == (40, 96)
    x = torch.randn(rows, 1, 96, generator=g).to(dtype)
    weight = dequantize_int8(layer.qweight, layer.scales.float())
    expected = nn.functional.linear(x.float(), weight, None if linear.bias is None else linear.bias.float())
    out = layer(x)
    assert out.shape == (rows, 1, 40) and out.dtype == dtype
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.25, "rtol": 2e-2}
    torch.testing.assert_close(out.float(), expected, **tol)


def _dequantized_twin(model_dir, out_dir):
    """A copy of the checkpoint whose decoder linear weights are what int8 makes of them."""
    shutil.copytree(model_dir, out_dir)
    tensors = load_file(out_dir / "model.safetensors")
    changed = 0
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith(".weight") and name.split(".")[-2] in LAYER_WEIGHTS:
            q, scales = quantize_int8(t)
            tensors[name] = dequantize_int8(q, scales, t.dtype)
            changed += 1
    assert changed > 0
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


@pytest.mark.parametrize("fixture,budget", [("tiny_llama", 16), ("tiny_qwen2", 64)])
def test_int8_engine_equals_transformers_on_the_dequantized_weights(fixture, budget, request, tmp_path):
    """Per-row quantization of the fused q/k/v and gate/up weights equals quantizing each projection alone, so
    the twin's weights are exactly the engine's. Qwen2 adds the qkv bias, and its 64-token budget sends
    prefill steps down the dequantize path while decodes take the int8 GEMM."""
    model_dir = request.getfixturevalue(fixture)
    twin = _dequantized_twin(model_dir, tmp_path / "twin")
    llm = _engine(model_dir, quantization="int8", max_num_batched_tokens=budget)
    model = llm.engine.runner.model
    int8 = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(int8) == 4 * len(model.model.layers)  # qkv, o, gate_up, down per layer; the LM head stays
    assert not isinstance(model.lm_head, Int8Linear)
    _run_and_compare(llm, twin, _prompts())
    assert llm.engine.block_manager.num_used_blocks == 0


def test_int8_changes_the_model():
    """Guards the twin test against a no-op: the quantized weight is not the original one."""
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    assert not torch.equal(dequantize_int8(*quantize_int8(w)), w)


@pytest.mark.parametrize("method", ["int4", "fp8", "awq", "gptq", "gguf"])
def test_methods_not_implemented_yet_are_refused_by_name(method):
    with pytest.raises(ValueError, match=f"quantization '{method}' is not implemented in this runtime yet"):
        EngineConfig(model="x", device="cpu", quantization=method)


def test_unknown_method_and_tensor_parallelism_are_refused():
    with pytest.raises(ValueError, match="quantization: unknown 'int3'"):
        EngineConfig(model="x", device="cpu", quantization="int3")
    with pytest.raises(ValueError, match="tensor_parallel_size 2: tensor parallelism is not implemented"):
        EngineConfig(model="x", device="cpu", tensor_parallel_size=2)


@pytest.mark.parametrize("argv", [["serve", "--quantization", "int4"], ["serve", "--tensor-parallel-size", "2"]])
def test_the_runtime_refuses_what_it_cannot_run_with_exit_2_and_one_line(argv, capfd):
    """What the operator renders for int4 / TP=2 specs: a pod that exits at once with the reason in its
    termination message, before loading anything (the model path here does not even exist)."""
    from kubellm.runtime.cli import main

    assert main([*argv, "--model", "/nonexistent/model"]) == 2
    err = capfd.readouterr().err
    assert "not implemented in this runtime yet" in err and "Traceback" not in err
