"""runtime/layers/kernel_choice.py: one pure decision from (settings, target, what loaded) to the kernels; each setting
chooses only what it names, and ``auto`` keeps the native CPU path together."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kubellm.runtime.layers.kernel_choice import KernelChoice, KernelSettings, Loaded, Target, choose

AUTO = KernelSettings()
CPU = Target("cpu", torch.float32, num_heads=4, num_kv_heads=2, head_dim=64)
CUDA = Target("cuda", torch.bfloat16, num_heads=4, num_kv_heads=2, head_dim=64)
ALL_LOADED = Loaded(cpu_kernels=None, triton_attention=None, onednn_prepack=None, int8_cpu_kernel=None,
                    int8_torch_gemm=True, triton_int8=None)
NO_CPU_KERNELS = Loaded(cpu_kernels="no compiler", onednn_prepack=None, int8_torch_gemm=True)


def test_auto_on_cpu_runs_the_native_path_as_one_where_the_cpu_kernels_load():
    assert choose(AUTO, CPU, ALL_LOADED) == KernelChoice(attention="cpu", layer_ops="native", prepack="onednn",
                                                         int8_gemm="torch", int8_fallback="torch")
    plain = choose(AUTO, CPU, NO_CPU_KERNELS)
    assert (plain.attention, plain.layer_ops, plain.prepack) == ("torch", "torch", "off")
    odd_heads = Target("cpu", torch.float32, 4, 2, head_dim=72)  # not a head size the CPU kernels take
    assert choose(AUTO, odd_heads, ALL_LOADED).attention == "torch"
    assert choose(AUTO, odd_heads, ALL_LOADED).layer_ops == "torch"


def test_auto_on_cuda_is_triton_when_its_check_passed_and_never_the_cpu_ops():
    assert choose(AUTO, CUDA, ALL_LOADED) == KernelChoice(attention="triton", layer_ops="torch", prepack="off",
                                                          int8_gemm="triton", int8_fallback="triton")
    failed = Loaded(triton_attention="prefill kernel failed", triton_int8="bad")
    assert choose(AUTO, CUDA, failed) == KernelChoice(attention="torch")


def test_each_setting_chooses_only_what_it_names():
    torch_attention = choose(KernelSettings(attention="torch"), CPU, ALL_LOADED)
    assert (torch_attention.attention, torch_attention.layer_ops, torch_attention.prepack) == ("torch", "native",
                                                                                                 "onednn")
    ops = choose(KernelSettings(layer_ops="torch"), CPU, ALL_LOADED)
    assert (ops.attention, ops.layer_ops, ops.prepack) == ("cpu", "torch", "onednn")
    packed = choose(KernelSettings(prepack="off"), CPU, ALL_LOADED)
    assert (packed.attention, packed.layer_ops, packed.prepack) == ("cpu", "native", "off")
    reference = choose(KernelSettings("torch", "torch", "off"), CPU, ALL_LOADED)
    assert (reference.attention, reference.layer_ops, reference.prepack) == ("torch", "torch", "off")


def test_dense_linears_run_the_native_bf16_kernel_for_bfloat16_where_it_loaded():
    bf16 = Target("cpu", torch.bfloat16, num_heads=4, num_kv_heads=2, head_dim=64)
    loaded = dataclasses.replace(ALL_LOADED, bf16_cpu_kernel=None)
    assert choose(AUTO, bf16, loaded).prepack == "native"
    assert "dense linears native bf16 kernel" in choose(AUTO, bf16, loaded).describe()
    assert choose(AUTO, CPU, loaded).prepack == "onednn"  # float32: the kernel is bfloat16 only
    assert choose(AUTO, bf16, dataclasses.replace(loaded, bf16_cpu_kernel="no AVX512-BF16")).prepack == "onednn"
    assert choose(KernelSettings(prepack="onednn"), bf16, loaded).prepack == "onednn"
    assert choose(KernelSettings(prepack="on"), bf16, loaded).prepack == "onednn"  # the older name
    assert choose(AUTO, bf16, dataclasses.replace(loaded, cpu_kernels="no compiler")).prepack == "off"


def test_bf16_dense_linears_fall_back_to_f_linear_where_neither_packed_gemm_runs():
    bf16 = Target("cpu", torch.bfloat16, num_heads=4, num_kv_heads=2, head_dim=64)
    avx2 = dataclasses.replace(ALL_LOADED, bf16_cpu_kernel="no AVX512-BF16 cpu_bf16_gemm in this build",
                               onednn_prepack="oneDNN cannot prepack bfloat16 weights on this CPU")
    assert choose(AUTO, bf16, avx2).prepack == "off"
    assert "dense linears F.linear" in choose(AUTO, bf16, avx2).describe()
    with pytest.raises(ValueError, match="oneDNN cannot prepack bfloat16 weights on this CPU"):
        choose(KernelSettings(prepack="onednn"), bf16, avx2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_what_auto_picks_on_this_host_runs_here(dtype):
    """The real probe on this CPU (AVX-512 or AVX2-only, or capped by KUBELLM_CPU_ISA): the dense linears it
    picks pack and compute what nn.Linear computes, never a path the CPU cannot run."""
    from torch import nn

    from kubellm.runtime.layers.kernel_choice import decide
    from kubellm.runtime.layers.linear import pack_linears

    choice = decide(AUTO, Target("cpu", dtype, num_heads=4, num_kv_heads=2, head_dim=64))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48)).to(dtype)
    x = torch.randn(5, 64).to(dtype)
    expected = model(x)
    if choice.prepack != "off":
        assert pack_linears(model, choice.prepack) == 1
    torch.testing.assert_close(model(x).float(), expected.float(), rtol=2**-7, atol=2e-2)


def test_layer_ops_auto_on_cuda_are_triton_when_their_check_passed_else_torch():
    passed = dataclasses.replace(ALL_LOADED, triton_layer_ops=None)
    assert choose(AUTO, CUDA, passed).layer_ops == "triton"
    assert choose(KernelSettings(layer_ops="triton"), CUDA, passed).layer_ops == "triton"
    assert "layer ops triton" in choose(AUTO, CUDA, passed).describe()
    failed = dataclasses.replace(ALL_LOADED, triton_layer_ops="the Triton RMSNorm differs from its reference")
    assert choose(AUTO, CUDA, failed).layer_ops == "torch"
    assert choose(AUTO, CPU, passed).layer_ops == "native"  # CPU keeps its native ops
    assert choose(KernelSettings(layer_ops="torch"), CUDA, passed).layer_ops == "torch"
    assert choose(AUTO, CUDA, passed).moe == "torch"  # the CPU experts kernel follows native ops only


def test_probe_checks_the_triton_layer_ops_where_a_setting_could_pick_them(monkeypatch):
    from kubellm.runtime.layers import kernel_choice
    asked = []
    monkeypatch.setattr(kernel_choice, "triton_attention_reason", lambda target: None)
    monkeypatch.setattr(kernel_choice, "triton_layer_ops_reason", lambda target: asked.append(target.device) or None)
    assert kernel_choice.probe(AUTO, CUDA).triton_layer_ops is None and asked == ["cuda"]
    asked.clear()
    assert kernel_choice.probe(KernelSettings(layer_ops="torch"), CUDA).triton_layer_ops == kernel_choice.NOT_PROBED
    assert kernel_choice.probe(AUTO, CPU).triton_layer_ops == kernel_choice.NOT_PROBED and asked == []


def test_triton_layer_ops_on_cpu_are_refused_with_the_reason_unless_interpreted(monkeypatch):
    from triton import knobs

    from kubellm.runtime.layers import kernel_choice
    monkeypatch.setattr(knobs.runtime, "interpret", False)
    settings = KernelSettings(layer_ops="triton")
    with pytest.raises(ValueError, match=r"Triton layer ops cannot run here: Triton kernels need a CUDA device.*"
                                         r"use --layer-ops torch"):
        choose(settings, CPU, kernel_choice.probe(settings, CPU))
    monkeypatch.setattr(knobs.runtime, "interpret", True)  # the tests' hook: the real check, interpreted
    assert choose(settings, CPU, kernel_choice.probe(settings, CPU)).layer_ops == "triton"


@pytest.mark.parametrize("settings,target,loaded,message", [
    (KernelSettings(attention="cpu"), CPU, NO_CPU_KERNELS, r"native CPU kernels cannot run here.*no compiler.*"
                                                            r"--attention-backend torch"),
    (KernelSettings(attention="cpu"), CUDA, ALL_LOADED, r"CPU device only.*--attention-backend torch"),
    (KernelSettings(attention="triton"), CPU, Loaded(triton_attention="Triton kernels need a CUDA device"),
     r"Triton kernels need a CUDA device; use --attention-backend torch"),
    (KernelSettings(layer_ops="native"), CUDA, ALL_LOADED, r"native layer ops cannot run here.*--layer-ops torch"),
    (KernelSettings(layer_ops="native"), CPU, NO_CPU_KERNELS, r"no compiler; use --layer-ops torch"),
    (KernelSettings(prepack="on"), CUDA, Loaded(onednn_prepack="oneDNN cannot prepack"),
     r"oneDNN cannot prepack; use --prepack-weights off"),
    (KernelSettings(prepack="native"), Target("cpu", torch.bfloat16, 4, 2, 64),
     Loaded(bf16_cpu_kernel="no AVX512-BF16 cpu_bf16_gemm"), r"no AVX512-BF16 cpu_bf16_gemm; use --prepack-weights "
                                                            r"onednn or off"),
    (KernelSettings(prepack="native"), CPU, ALL_LOADED, r"takes bfloat16 weights on CPU \(got float32"),
    (KernelSettings(prepack="yes"), CPU, ALL_LOADED, r"use auto, native, onednn or off"),
    (KernelSettings(layer_ops="fused"), CPU, ALL_LOADED, r"use auto, native, triton or torch"),
    (KernelSettings(layer_ops="triton"), CUDA, Loaded(triton_layer_ops="the Triton RMSNorm failed"),
     r"Triton layer ops cannot run here: the Triton RMSNorm failed; use --layer-ops torch"),
])
def test_an_explicit_choice_that_cannot_run_is_a_clear_error(settings, target, loaded, message):
    with pytest.raises(ValueError, match=message):
        choose(settings, target, loaded)


def test_int8_gemm_by_dtype_kernel_and_layer_shape():
    bf16 = Target("cpu", torch.bfloat16, 4, 2, 64, quantization="int8")
    choice = choose(AUTO, bf16, ALL_LOADED)
    assert (choice.int8_gemm, choice.int8_fallback) == ("native", "torch")
    assert choice.int8_path(torch.empty(32, 64)) == "native"
    assert choice.int8_path(torch.empty(24, 64)) == "torch"  # 24 output channels: not packable
    no_avx512 = Loaded(cpu_kernels=None, int8_cpu_kernel="no AVX512-BF16 int8 kernel", int8_torch_gemm=False)
    assert choose(AUTO, bf16, no_avx512).int8_gemm == "dequantize"
    assert choose(AUTO, Target("mps", torch.float16), ALL_LOADED).int8_gemm == "dequantize"


def test_grouped_gemms_are_native_for_bf16_on_cpu_where_they_load_and_the_layer_packs():
    bf16 = Target("cpu", torch.bfloat16, 4, 2, 64, quantization="gptq")
    grouped = Loaded(cpu_kernels=None, grouped_int4_cpu_kernel=None, grouped_int8_cpu_kernel=None)
    choice = choose(AUTO, bf16, grouped)
    assert (choice.grouped_int4_gemm, choice.grouped_int8_gemm) == ("native", "native")
    assert choice.grouped_path(4, 576, 576, 32) == "native"
    assert choice.grouped_path(4, 584, 576, 32) == "dequantize"  # the int4 kernel needs N % 16 == 0
    assert choice.grouped_path(4, 576, 576, 6) == "dequantize"  # and groups of a multiple of 4
    assert choice.grouped_path(8, 584, 576, -1) == "native"  # per channel; any N
    assert choice.grouped_path(6, 584, 576, 16) == "native"  # Q6_K's values are int8 with group 16
    assert choice.grouped_path(8, 64, 100, 3) == "dequantize"  # an odd group
    with pytest.raises(ValueError, match="3-bit"):
        choice.grouped_path(3, 64, 64, 32)
    assert "grouped 4-bit GEMM native, 8-bit GEMM native" in choice.describe("gptq")
    for target, loaded in ((Target("cpu", torch.float32, quantization="gptq"), grouped),  # bf16 kernels only
                           (bf16, Loaded(grouped_int4_cpu_kernel="no AVX512-BF16", grouped_int8_cpu_kernel="no")),
                           (Target("cuda", torch.bfloat16, quantization="gptq"), grouped)):
        other = choose(AUTO, target, loaded)
        assert (other.grouped_int4_gemm, other.grouped_int8_gemm) == ("dequantize", "dequantize")
        assert other.grouped_path(4, 576, 576, 32) == "dequantize"


def test_int8_activations_only_where_the_native_int4_gemm_runs_and_has_them():
    bf16 = Target("cpu", torch.bfloat16, 4, 2, 64, quantization="int4")
    int8 = KernelSettings(int4_activations="int8")
    loaded = Loaded(cpu_kernels=None, grouped_int4_cpu_kernel=None, int4_int8_activations=None)
    assert choose(AUTO, bf16, loaded).int4_activations == "int8"  # the default (auto) takes them where they run
    no_vnni = dataclasses.replace(loaded, int4_int8_activations="no AVX512-VNNI in this build")
    assert choose(AUTO, bf16, no_vnni).int4_activations == "bf16"  # ... and bf16 where the build lacks them
    assert choose(KernelSettings(int4_activations="bf16"), bf16, loaded).int4_activations == "bf16"
    choice = choose(int8, bf16, loaded)
    assert choice.int4_activations == "int8" and "int4 GEMM native (int8 activations)" in choice.describe("int4")
    for target, other in ((Target("cpu", torch.float32, quantization="int4"), loaded),  # dequantizes: no effect
                          (Target("cuda", torch.bfloat16, quantization="int4"), loaded)):
        assert choose(int8, target, other).int4_activations == "bf16"
        assert choose(AUTO, target, other).int4_activations == "bf16"
    with pytest.raises(ValueError, match="no AVX512-VNNI.*--cpu-int4-activations bf16"):
        choose(int8, bf16, no_vnni)
    with pytest.raises(ValueError, match="use auto, bf16 or int8"):
        choose(KernelSettings(int4_activations="int4"), bf16, loaded)


def test_fp8_gemm_is_native_for_bf16_on_cpu_where_it_loads_and_the_layer_packs():
    bf16 = Target("cpu", torch.bfloat16, 4, 2, 64, quantization="fp8")
    choice = choose(AUTO, bf16, Loaded(cpu_kernels=None, fp8_cpu_kernel=None))
    assert choice.fp8_gemm == "native" and "FP8 GEMM native" in choice.describe("fp8")
    assert choice.fp8_path(576, -1) == choice.fp8_path(576, 128) == "native"  # 576 = 4 groups of 128 + 64
    assert choice.fp8_path(98, -1) == "dequantize"  # inputs not a multiple of 4
    for target, loaded in ((Target("cpu", torch.float32, quantization="fp8"), Loaded(fp8_cpu_kernel=None)),
                           (bf16, Loaded(fp8_cpu_kernel="no AVX512-BF16 cpu_fp8_gemm in this build"))):
        assert choose(AUTO, target, loaded).fp8_path(576, 128) == "dequantize"


def test_probe_checks_the_grouped_kernels_for_bf16_and_float32_on_cpu_only(monkeypatch):
    from kubellm.kernels import cpu_fp8_gemm, cpu_grouped_int8_gemm, cpu_int4_gemm
    from kubellm.runtime.layers import kernel_choice
    monkeypatch.setattr(cpu_int4_gemm, "available", lambda: True)
    monkeypatch.setattr(cpu_int4_gemm, "int8_available", lambda: True)
    monkeypatch.setattr(cpu_int4_gemm, "takes_float32", lambda: False)
    monkeypatch.setattr(cpu_grouped_int8_gemm, "available", lambda: False)
    monkeypatch.setattr(cpu_grouped_int8_gemm, "takes_float32", lambda: False)
    monkeypatch.setattr(cpu_fp8_gemm, "available", lambda: True)
    off = KernelSettings("torch", "torch", "off")
    for dtype in (torch.bfloat16, torch.float32):
        loaded = kernel_choice.probe(off, Target("cpu", dtype, quantization="gptq"))
        assert loaded.grouped_int4_cpu_kernel is None and "cpu_grouped_int8_gemm" in loaded.grouped_int8_cpu_kernel
        assert loaded.fp8_cpu_kernel is None and loaded.int4_int8_activations is None
        assert "bfloat16 only" in loaded.float32_grouped_cpu
    for target in (Target("cpu", torch.float16, quantization="gptq"), Target("cpu", torch.bfloat16)):
        skipped = kernel_choice.probe(off, target)
        assert skipped.grouped_int4_cpu_kernel == skipped.grouped_int8_cpu_kernel == skipped.fp8_cpu_kernel \
            == kernel_choice.NOT_PROBED


def test_an_avx2_build_serves_float32_and_bf16_with_int8_activations_only():
    """The AVX2 build: the 4-bit GEMM with int8 activations and the 8-bit one, on float32 (what --dtype auto
    picks there) and bfloat16; bf16 activations and FP8 dequantize, never a kernel the build lacks."""
    avx2 = Loaded(cpu_kernels=None, grouped_int4_cpu_kernel="no cpu_int4_gemm in this build (AVX512-BF16)",
                  int4_int8_activations=None, grouped_int8_cpu_kernel=None, float32_grouped_cpu=None,
                  fp8_cpu_kernel="no cpu_fp8_gemm in this build (AVX512-BF16)")
    for dtype in (torch.float32, torch.bfloat16):
        target = Target("cpu", dtype, 4, 2, 64, quantization="gguf")
        choice = choose(AUTO, target, avx2)
        assert (choice.grouped_int4_gemm, choice.int4_activations, choice.grouped_int8_gemm, choice.fp8_gemm) == \
            ("native", "int8", "native", "dequantize")
        assert choice.grouped_path(4, 576, 576, 32) == choice.grouped_path(8, 49152, 576, 32) == "native"
        bf16_acts = choose(KernelSettings(int4_activations="bf16"), target, avx2)
        assert (bf16_acts.grouped_int4_gemm, bf16_acts.grouped_int8_gemm) == ("dequantize", "native")
    no_float32 = dataclasses.replace(avx2, float32_grouped_cpu="this build's grouped CPU GEMMs take bfloat16 only")
    choice = choose(AUTO, Target("cpu", torch.float32, 4, 2, 64, quantization="gguf"), no_float32)
    assert (choice.grouped_int4_gemm, choice.grouped_int8_gemm) == ("dequantize", "dequantize")


TRITON_QUANT = Loaded(triton_attention=None, triton_grouped_int4=None, triton_grouped_int8=None, triton_fp8=None)


def test_pre_quantized_gemms_are_triton_on_cuda_where_their_checks_passed_and_the_layer_packs():
    cuda = Target("cuda", torch.bfloat16, quantization="awq")
    choice = choose(AUTO, cuda, TRITON_QUANT)
    assert (choice.grouped_int4_gemm, choice.grouped_int8_gemm, choice.fp8_gemm) == ("triton",) * 3
    assert choice.grouped_path(4, 584, 576, 32) == "triton"  # any N (the CPU kernel wants N % 16 == 0)
    assert choice.grouped_path(4, 64, 576, -1) == "triton"  # per channel
    assert choice.grouped_path(6, 64, 576, 16) == "triton"  # Q6_K's int8 values, packed as 8-bit
    assert choice.grouped_path(4, 64, 100, -1) == "dequantize"  # K not a whole number of 8-value words
    assert choice.grouped_path(8, 64, 96, 12) == "dequantize"  # a group the K tile cannot fit
    assert "grouped 4-bit GEMM triton, 8-bit GEMM triton, FP8 GEMM triton" in choice.describe("awq")
    failed = Loaded(triton_grouped_int4="bad", triton_grouped_int8="bad", triton_fp8="bad")
    for target, loaded in ((cuda, failed), (Target("cpu", torch.bfloat16, quantization="awq"), TRITON_QUANT)):
        other = choose(AUTO, target, loaded)
        assert (other.grouped_int4_gemm, other.grouped_int8_gemm, other.fp8_gemm) == ("dequantize",) * 3


def test_probe_checks_the_pre_quantized_triton_gemms_on_cuda_for_those_methods_only(monkeypatch):
    from kubellm.runtime.layers import kernel_choice
    asked = []
    monkeypatch.setattr(kernel_choice, "triton_gemm_reason", lambda method, *a: asked.append(method) or None)
    monkeypatch.setattr(kernel_choice, "triton_attention_reason", lambda target: None)
    monkeypatch.setattr(kernel_choice, "triton_layer_ops_reason", lambda target: None)
    loaded = kernel_choice.probe(AUTO, Target("cuda", torch.bfloat16, quantization="gptq"))
    assert asked == ["grouped4", "grouped8", "fp8"]
    assert loaded.triton_grouped_int4 is loaded.triton_grouped_int8 is loaded.triton_fp8 is None
    asked.clear()
    skipped = kernel_choice.probe(AUTO, Target("cuda", torch.bfloat16, quantization="none"))
    assert "grouped4" not in asked and skipped.triton_fp8 == kernel_choice.NOT_PROBED
    asked.clear()  # --quantization int4 computes with the 4-bit grouped GEMM: that one only
    int4 = kernel_choice.probe(AUTO, Target("cuda", torch.bfloat16, quantization="int4"))
    assert asked == ["grouped4"] and int4.triton_fp8 == kernel_choice.NOT_PROBED
    assert choose(AUTO, Target("cuda", torch.bfloat16, quantization="int4"), int4).grouped_int4_gemm == "triton"


@pytest.mark.parametrize("method", ["grouped4", "grouped8", "fp8"])
def test_the_pre_quantized_triton_checks_run_for_real_under_the_interpreter(method):
    from kubellm.runtime.layers import kernel_choice
    assert kernel_choice.triton_gemm_reason(method, "cpu", torch.float32) is None


def test_the_engine_passes_its_choice_down(tiny_llama):
    """One decision reaches the runner's attention backend, the model's layer-op switches and its linears."""
    from kubellm.kernels import cpu_extension
    from kubellm.runtime.engine.llm_engine import LLM
    from kubellm.runtime.layers.linear import PackedLinear

    llm = LLM(str(tiny_llama), progress=False, dtype="float32", num_kv_blocks=16, max_model_len=64,
              attention_backend="torch")
    engine = llm.engine
    assert engine.runner.kernels is engine.kernels and type(engine.runner.backend).__name__ == "TorchAttentionBackend"
    native = cpu_extension.available()
    assert engine.kernels.layer_ops == ("native" if native else "torch")
    switches = {m.native for m in engine.runner.model.modules() if isinstance(getattr(type(m), "native", None), bool)}
    assert switches == {native}
    assert any(isinstance(m, PackedLinear) for m in engine.runner.model.modules()) == (
        engine.kernels.prepack == "onednn")
    reference = LLM(str(tiny_llama), progress=False, dtype="float32", num_kv_blocks=16, max_model_len=64,
                    attention_backend="torch", layer_ops="torch", prepack_weights="off").engine
    assert (reference.kernels.attention, reference.kernels.layer_ops, reference.kernels.prepack) == ("torch", "torch",
                                                                                                  "off")
    assert not any(m.native for m in reference.runner.model.modules()
                   if isinstance(getattr(type(m), "native", None), bool))


def test_the_engine_gives_its_int4_layers_int8_activations_when_asked(tiny_llama, native_int4_int8):
    """--cpu-int4-activations int8 reaches every native 4-bit layer, and the engine decodes with them."""
    from kubellm.kernels import cpu_int4_gemm
    from kubellm.runtime.engine.llm_engine import LLM
    from kubellm.runtime.layers.quantized_linear import QuantizedLinear
    from kubellm.runtime.sampling.params import SamplingParams

    # AVX2 builds: int8 activations only, on float32 (what --dtype auto runs there)
    avx512 = cpu_int4_gemm.available()
    for activations in ("bf16", "int8") if avx512 else ("int8",):
        llm = LLM(str(tiny_llama), progress=False, dtype="bfloat16" if avx512 else "float32", num_kv_blocks=16,
                  max_model_len=64, quantization="int4", cpu_int4_activations=activations)
        layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear) and m.path == "native"]
        assert llm.engine.kernels.int4_activations == activations and layers
        assert {m.int8_activations for m in layers} == {activations == "int8"}
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].token_ids) == 4
        llm.close()


def test_moe_experts_run_natively_for_bfloat16_unquantized_or_4bit_experts_with_native_layer_ops():
    bf16 = Target("cpu", torch.bfloat16, num_heads=4, num_kv_heads=2, head_dim=64)
    loaded = dataclasses.replace(ALL_LOADED, moe_cpu_kernel=None)
    assert choose(AUTO, bf16, loaded).moe == "native"
    assert "MoE experts native" in choose(AUTO, bf16, loaded).describe()
    assert choose(AUTO, CPU, loaded).moe == "torch"  # float32: the kernel is bfloat16 only
    assert choose(AUTO, dataclasses.replace(bf16, quantization="int8"), loaded).moe == "torch"  # int8 experts
    for quantization in ("int4", "awq", "gptq", "compressed-tensors", "gguf"):  # 4-bit experts where they load so
        assert choose(AUTO, dataclasses.replace(bf16, quantization=quantization), loaded).moe == "native"
    assert choose(KernelSettings(layer_ops="torch"), bf16, loaded).moe == "torch"
    assert choose(AUTO, bf16, dataclasses.replace(loaded, moe_cpu_kernel="no AVX512-BF16")).moe == "torch"
    assert choose(AUTO, bf16, ALL_LOADED).moe == "torch"  # not probed
