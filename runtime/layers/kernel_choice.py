"""Which kernels run, decided in one place: attention, the fused layer ops, weight prepacking, quantized GEMMs.

Three engine settings choose (``--attention-backend``, ``--layer-ops``, ``--prepack-weights``); the quantized
GEMMs follow the device, the dtype and what loaded (``--cpu-int4-activations`` picks what the native int4 GEMM
multiplies the weights with). :func:`probe` finds out what can run here (loads or builds
kubellm's CPU extension, runs the Triton start-up checks), only for what the settings could pick;
:func:`choose` is a pure function of (settings, target, what loaded) to a frozen :class:`KernelChoice`. The
engine calls :func:`decide` once, which logs the choice, and hands it to quantization, to the model runner
and to every tensor-parallel rank.

What ``auto`` picks:

* attention: ``triton`` on CUDA once its start-up check passed here; ``cpu`` on CPU where kubellm's CPU kernels
  load and take the model's head size (a multiple of 16, up to 512); else ``torch``.
* layer ops (RMSNorm, rotary embedding, SiLU-and-mul): ``native`` under that same CPU condition; ``triton``
  (kernels/triton_layer_ops.py) on CUDA once its start-up check passed here; else ``torch``.
* prepacking linear weights: under that same CPU condition ``native`` (kubellm's bf16 linear,
  ``cpu_bf16_gemm``: AVX512-BF16, or AVX2 + FMA widening the weights in registers) for bfloat16 where it loaded, else ``onednn`` when oneDNN packs the dtype
  here (float32; bfloat16 only with AVX-512 BW/VL/DQ or AVX-NE-CONVERT: a start-up check packs and runs a small
  layer), else ``off`` (``F.linear``, which runs bfloat16 on any CPU). ``auto`` runs the native CPU path as one unit, as it is measured and
  tested. (``on`` is ``onednn``, its name from before the native kernel.)
* int8 GEMM: ``native`` (kubellm's AVX512-BF16 kernel) for bfloat16 on CPUs that have it, for layers it can
  pack; ``torch`` (torch's int8 GEMM for small steps) for the other CPU cases; ``triton`` on CUDA once its
  check passed; else ``dequantize`` per call.
* grouped 4-bit and 8-bit GEMMs (the forms pre-quantized checkpoints read into: per-group scales and zero
  points; GGUF blocks through runtime/quantization/gguf.py; the 4-bit one also serves ``--quantization int4``): ``native`` (``cpu_int4_gemm``, ``cpu_grouped_int8_gemm``)
  on CPU where the build has them for the activations' dtype, for layers they can pack: AVX512-BF16 builds take
  bfloat16, AVX2 builds (x86-64-v3 CPUs such as AMD EPYC before Zen 4) bfloat16 and float32, the dtype
  ``--dtype auto`` picks there, and only int8 activations for the 4-bit one; ``triton``
  (``triton_grouped_gemm``, 5..8-bit values packed as 8-bit) on CUDA once its checks passed, for layers it can
  pack; else ``dequantize`` (the reference). The native 4-bit GEMM's activations
  (every step): ``int8`` (quantized per group, integer dot products; AVX512-VNNI or AVX2) where the build has it,
  else ``bf16``; ``--cpu-int4-activations bf16|int8`` forces one (int8 refuses to start where only bf16 runs;
  bf16 dequantizes where only int8 runs); the setting has no effect where that kernel does not run.
* FP8 weight GEMM (e4m3, per-tensor / per-channel / block scales): ``native`` (``cpu_fp8_gemm``, AVX512-BF16)
  for bfloat16 on CPUs that have it, for layers it can pack (inputs and groups multiples of 4); ``triton``
  (``triton_fp8_gemm``) on CUDA once its check passed; else ``dequantize``.
* mixture-of-experts layers: ``native`` (``cpu_moe``: routing and every hit expert of a layer in one call,
  AVX512-BF16) with native layer ops for bfloat16 where it loaded, unquantized or with 4-bit or 8-bit experts
  (``--quantization int4``, a pre-quantized checkpoint or a GGUF file; the layers whose experts the kernels do
  not take, act-order, FP8, keep one GEMM per hit expert); else ``torch`` (one GEMM per hit expert through the
  linear layers above).

The Triton GEMMs for pre-quantized checkpoints are checked on CUDA when ``Target.quantization`` names a
pre-quantized method (:data:`PREQUANTIZED`): the loader sets it from the checkpoint before deciding.

An explicit choice that cannot run here is a ValueError that says why.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from kubellm.kernels import (
    cpu_bf16_gemm,
    cpu_extension,
    cpu_fp8_gemm,
    cpu_grouped_int8_gemm,
    cpu_int4_gemm,
    cpu_int8_gemm,
    cpu_moe,
)
from kubellm.runtime.layers.linear import prepack_unavailable

log = logging.getLogger("kubellm.kernels")

NOT_PROBED = "not probed"  # what a Loaded field holds when no setting could pick that kernel
PREQUANTIZED = ("awq", "gptq", "compressed-tensors", "fp8", "gguf")  # quantizations a checkpoint brings


@dataclass(frozen=True)
class KernelSettings:
    """What the user asked for (the engine settings of the same names)."""

    attention: str = "auto"  # auto | cpu | triton | torch
    layer_ops: str = "auto"  # auto | native | triton | torch
    prepack: str = "auto"  # auto | native | onednn | on (= onednn) | off
    int4_activations: str = "auto"  # auto | bf16 | int8: the native int4 GEMM's activations

    @classmethod
    def from_config(cls, config) -> KernelSettings:
        return cls(config.attention_backend, config.layer_ops, config.prepack_weights, config.cpu_int4_activations)


@dataclass(frozen=True)
class Target:
    """What the kernels serve: the device, the dtype, this rank's attention shape, the quantization."""

    device: str
    dtype: torch.dtype
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    block_size: int = 16
    quantization: str = "none"

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


@dataclass(frozen=True)
class Loaded:
    """What can run here: None where a kernel is usable, else why not (:func:`probe` fills it; tests build it)."""

    cpu_kernels: str | None = NOT_PROBED  # kubellm's native CPU extension
    triton_attention: str | None = NOT_PROBED
    triton_layer_ops: str | None = NOT_PROBED  # triton_layer_ops
    onednn_prepack: str | None = NOT_PROBED
    bf16_cpu_kernel: str | None = NOT_PROBED  # cpu_bf16_gemm (AVX512-BF16 or AVX2)
    int8_cpu_kernel: str | None = NOT_PROBED  # the AVX512-BF16 int8 GEMM of the CPU extension
    int8_torch_gemm: bool = False  # torch._weight_int8pack_mm exists
    triton_int8: str | None = NOT_PROBED
    grouped_int4_cpu_kernel: str | None = NOT_PROBED  # cpu_int4_gemm with bf16 activations (AVX512-BF16)
    int4_int8_activations: str | None = NOT_PROBED  # cpu_int4_gemm's int8 activations (AVX512-VNNI or AVX2)
    grouped_int8_cpu_kernel: str | None = NOT_PROBED  # cpu_grouped_int8_gemm (AVX512-BF16 or AVX2)
    float32_grouped_cpu: str | None = NOT_PROBED  # those two (int4: int8 activations) take float32 (AVX2)
    triton_grouped_int4: str | None = NOT_PROBED  # triton_grouped_gemm, bits=4
    triton_grouped_int8: str | None = NOT_PROBED  # triton_grouped_gemm, bits=8
    triton_fp8: str | None = NOT_PROBED  # triton_fp8_gemm
    fp8_cpu_kernel: str | None = NOT_PROBED  # cpu_fp8_gemm (AVX512-BF16)
    moe_cpu_kernel: str | None = NOT_PROBED  # cpu_moe (AVX512-BF16)


@dataclass(frozen=True)
class KernelChoice:
    """The kernels one engine (every rank alike) runs with."""

    attention: str = "torch"  # cpu | triton | torch
    layer_ops: str = "torch"  # native | triton | torch
    prepack: str = "off"  # native | onednn | off: dense linear weights packed once for that GEMM
    int8_gemm: str = "dequantize"  # native | triton | torch | dequantize
    int8_fallback: str = "dequantize"  # torch | dequantize: layers the native kernel cannot pack
    grouped_int4_gemm: str = "dequantize"  # native | triton | dequantize: 4-bit values, per-group scales, zeros
    int4_activations: str = "bf16"  # bf16 | int8: what the native 4-bit GEMM multiplies with
    grouped_int8_gemm: str = "dequantize"  # native | triton | dequantize: 8-bit values, per-group scales (zeros)
    fp8_gemm: str = "dequantize"  # native | triton | dequantize: e4m3 weights with their scales
    moe: str = "torch"  # native | torch: the routing and experts of mixture-of-experts layers

    def int8_path(self, weight: torch.Tensor) -> str:
        """The int8 GEMM of one layer (``weight`` ``[out, in]``): the native kernel needs packable shapes."""
        if self.int8_gemm == "native" and not cpu_int8_gemm.packable(weight):
            return self.int8_fallback
        return self.int8_gemm

    def grouped_path(self, bits: int, out_features: int, in_features: int, group_size: int) -> str:
        """The GEMM of one pre-quantized layer of ``bits``-bit values (4: ``cpu_int4_gemm``'s form, 5..8:
        ``cpu_grouped_int8_gemm``'s) with ``group_size`` inputs per scale (-1 or ``in_features``: per channel)."""
        group = in_features if group_size <= 0 else group_size
        if 4 <= bits <= 8 and (self.grouped_int4_gemm if bits == 4 else self.grouped_int8_gemm) == "triton":
            from kubellm.kernels import triton_grouped_gemm  # imports triton: only where its check passed

            packable = triton_grouped_gemm.packable(4 if bits == 4 else 8, out_features, in_features, group)
            return "triton" if packable else "dequantize"
        if bits == 4:
            packable = out_features % 16 == 0 and group % 4 == 0 and in_features % group == 0
            return self.grouped_int4_gemm if packable else "dequantize"
        if 4 < bits <= 8:
            packable = group % 2 == 0 and in_features % group == 0
            return self.grouped_int8_gemm if packable else "dequantize"
        raise ValueError(f"no grouped GEMM for {bits}-bit values (4..8)")

    def fp8_path(self, in_features: int, group_size: int) -> str:
        """The GEMM of one FP8 (e4m3) layer with a scale per (output, ``group_size`` inputs; -1: per channel):
        ``native`` or ``triton`` where it loaded and takes the layer's shape and scale layout, else
        ``dequantize``."""
        from kubellm.runtime.layers.quantized_linear import fp8_triton_packable

        if self.fp8_gemm == "native":
            return "native" if cpu_fp8_gemm.packable(in_features, group_size) else "dequantize"
        return "triton" if self.fp8_gemm == "triton" and fp8_triton_packable(in_features, group_size) else "dequantize"

    def describe(self, quantization: str = "none") -> str:
        int4 = self.grouped_int4_gemm + (" (int8 activations)" if self.int4_activations == "int8" else "")
        gemm = {"int8": f", int8 GEMM {self.int8_gemm}", "int4": f", int4 GEMM {int4}", "none": ""}
        grouped = (f", grouped 4-bit GEMM {int4}, 8-bit GEMM {self.grouped_int8_gemm}, "
                   f"FP8 GEMM {self.fp8_gemm}")
        return (f"attention {self.attention}, layer ops {self.layer_ops}, dense linears {self.dense_linears}"
                f"{gemm.get(quantization, grouped)}, MoE experts {self.moe}")

    @property
    def dense_linears(self) -> str:
        """The GEMM of the unquantized linear layers, in words."""
        return {"native": "native bf16 kernel", "onednn": "oneDNN prepacked"}.get(self.prepack, "F.linear")


def cpu_head_size_ok(head_dim: int) -> bool:
    """The head sizes kubellm's CPU attention kernels take."""
    return head_dim % 16 == 0 and 0 < head_dim <= 512


# ---- the decision (pure) ------------------------------------------------------------------------------------
def choose(settings: KernelSettings, target: Target, loaded: Loaded) -> KernelChoice:
    """The kernels for ``target`` given what loaded; raises ValueError for an explicit choice that cannot run."""
    native_cpu = target.cpu and cpu_head_size_ok(target.head_dim) and loaded.cpu_kernels is None
    int8_gemm, int8_fallback = _int8_gemm(target, loaded)
    layer_ops = _layer_ops(settings.layer_ops, target, loaded, native_cpu)
    grouped_int4, int4_activations = _grouped_int4(settings.int4_activations, target, loaded)
    return KernelChoice(
        attention=_attention(settings.attention, target, loaded, native_cpu),
        layer_ops=layer_ops,
        prepack=_prepack(settings.prepack, target, loaded, native_cpu),
        int8_gemm=int8_gemm, int8_fallback=int8_fallback,
        grouped_int4_gemm=grouped_int4, int4_activations=int4_activations,
        grouped_int8_gemm=_grouped(target, loaded.grouped_int8_cpu_kernel, loaded.triton_grouped_int8,
                                   loaded.float32_grouped_cpu),
        fp8_gemm=_grouped(target, loaded.fp8_cpu_kernel, loaded.triton_fp8),
        moe="native" if layer_ops == "native" and target.quantization in ("none", "int4", *PREQUANTIZED)
        and target.dtype == torch.bfloat16 and target.cpu and loaded.moe_cpu_kernel is None else "torch",
    )


def _grouped(target: Target, cpu_reason: str | None, triton_reason: str | None,
             float32_reason: str | None = "bfloat16 only") -> str:
    """A native CPU GEMM serves bfloat16 on CPU where it loaded (float32 too where ``float32_reason`` is None:
    the AVX2 build), the Triton one CUDA where its check passed; anything else dequantizes."""
    dtype_ok = target.dtype == torch.bfloat16 or (target.dtype == torch.float32 and float32_reason is None)
    if target.cpu and dtype_ok and cpu_reason is None:
        return "native"
    return "triton" if target.cuda and triton_reason is None else "dequantize"


def _grouped_int4(kind: str, target: Target, loaded: Loaded) -> tuple[str, str]:
    """(the 4-bit GEMM's path, the native CPU kernel's activations). ``auto`` takes int8 activations where the
    build has them, as llama.cpp quantizes activations for every quantized matmul on CPU (it cost 0.1-0.3%
    perplexity on SmolLM2, benchmarks/README.md), else bf16; each kind is native where its kernel loaded (bf16:
    AVX512-BF16 builds; int8: AVX512-VNNI or AVX2 builds, the latter for float32 too). The activations mean
    nothing off the native CPU path (bf16 there)."""
    if kind not in ("auto", "bf16", "int8"):
        raise ValueError(f"cpu int4 activations {kind!r}: use auto, bf16 or int8")
    has_int8 = loaded.int4_int8_activations is None
    bf16_path = _grouped(target, loaded.grouped_int4_cpu_kernel, loaded.triton_grouped_int4)
    if kind == "int8" and not has_int8 and target.cpu and bf16_path == "native":
        raise ValueError(f"int8 activations for the int4 GEMM cannot run here: {loaded.int4_int8_activations}; "
                         "use --cpu-int4-activations bf16")
    if kind == "auto":
        kind = "int8" if has_int8 else "bf16"
    path = _grouped(target, loaded.int4_int8_activations, loaded.triton_grouped_int4,
                    loaded.float32_grouped_cpu) if kind == "int8" else bf16_path
    return path, kind if path == "native" and target.cpu else "bf16"


def _attention(kind: str, target: Target, loaded: Loaded, native_cpu: bool) -> str:
    if kind == "auto":
        if target.cuda:
            return "triton" if loaded.triton_attention is None else "torch"
        return "cpu" if native_cpu else "torch"
    if kind == "cpu":
        why = ("they run on the CPU device only" if not target.cpu
               else loaded.cpu_kernels or (None if cpu_head_size_ok(target.head_dim)
                                           else f"head size {target.head_dim} is not a multiple of 16 up to 512"))
        if why:
            raise ValueError(f"the native CPU kernels cannot run here (device {target.device!r}): {why}; "
                             "use --attention-backend torch")
    elif kind == "triton":
        if loaded.triton_attention is not None:
            raise ValueError(f"{loaded.triton_attention}; use --attention-backend torch")
    elif kind != "torch":
        raise ValueError(f"attention backend {kind!r} is not available in this build; use auto, torch, cpu or triton")
    return kind


def _layer_ops(kind: str, target: Target, loaded: Loaded, native_cpu: bool) -> str:
    if kind == "auto":
        if target.cuda and loaded.triton_layer_ops is None:
            return "triton"
        return "native" if native_cpu else "torch"
    if kind == "triton" and loaded.triton_layer_ops is not None:
        raise ValueError(f"the Triton layer ops cannot run here: {loaded.triton_layer_ops}; use --layer-ops torch")
    if kind == "native" and (not target.cpu or loaded.cpu_kernels is not None):
        why = "they run on the CPU device only" if not target.cpu else loaded.cpu_kernels
        raise ValueError(f"the native layer ops cannot run here (device {target.device!r}): {why}; "
                         "use --layer-ops torch")
    if kind not in ("native", "triton", "torch"):
        raise ValueError(f"layer ops {kind!r}: use auto, native, triton or torch")
    return kind


def _prepack(kind: str, target: Target, loaded: Loaded, native_cpu: bool) -> str:
    native_ok = target.cpu and target.dtype == torch.bfloat16 and loaded.bf16_cpu_kernel is None
    if kind == "auto":
        if not native_cpu:
            return "off"
        return "native" if native_ok else "onednn" if loaded.onednn_prepack is None else "off"
    kind = "onednn" if kind == "on" else kind
    if kind == "native" and not native_ok:
        why = (loaded.bf16_cpu_kernel if target.cpu and target.dtype == torch.bfloat16
               else f"it takes bfloat16 weights on CPU (got {str(target.dtype).removeprefix('torch.')} on "
               f"{target.device!r})")
        raise ValueError(f"the native bf16 linear cannot run here: {why}; use --prepack-weights onednn or off")
    if kind == "onednn" and loaded.onednn_prepack is not None:
        raise ValueError(f"{loaded.onednn_prepack}; use --prepack-weights off")
    if kind not in ("native", "onednn", "off"):
        raise ValueError(f"prepack weights {kind!r}: use auto, native, onednn or off")
    return kind


def _int8_gemm(target: Target, loaded: Loaded) -> tuple[str, str]:
    """(the path of layers the native kernel packs, the path of the others)."""
    if target.cuda:
        path = "triton" if loaded.triton_int8 is None else "dequantize"
        return path, path
    if not target.cpu:
        return "dequantize", "dequantize"
    fallback = "torch" if loaded.int8_torch_gemm else "dequantize"
    if target.dtype == torch.bfloat16 and loaded.int8_cpu_kernel is None:
        return "native", fallback
    return fallback, fallback


# ---- what loaded (probes) -----------------------------------------------------------------------------------
def probe(settings: KernelSettings, target: Target) -> Loaded:
    """Load, build or check what ``settings`` could pick for ``target``; the rest stays :data:`NOT_PROBED`."""
    found: dict[str, object] = {}
    native_wanted = settings.attention == "cpu" or settings.layer_ops == "native" or (
        cpu_head_size_ok(target.head_dim) and "auto" in (settings.attention, settings.layer_ops, settings.prepack))
    if target.cpu and native_wanted:
        found["cpu_kernels"] = _cpu_kernels_reason()
    if settings.attention == "triton" or (settings.attention == "auto" and target.cuda):
        found["triton_attention"] = triton_attention_reason(target)
    if settings.layer_ops == "triton" or (settings.layer_ops == "auto" and target.cuda):
        found["triton_layer_ops"] = triton_layer_ops_reason(target)
    if target.cpu and target.dtype == torch.bfloat16 and (settings.prepack == "native" or (
            settings.prepack == "auto" and "cpu_kernels" in found)):
        found["bf16_cpu_kernel"] = None if cpu_bf16_gemm.available() else \
            "no cpu_bf16_gemm in this build (it needs AVX512-BF16, or AVX2 + FMA)"
    if settings.prepack != "off":
        found["onednn_prepack"] = prepack_unavailable(target.device, target.dtype)
    if target.quantization == "int8":
        found["int8_torch_gemm"] = hasattr(torch, "_weight_int8pack_mm")
        if target.cpu and target.dtype == torch.bfloat16:
            found["int8_cpu_kernel"] = None if cpu_int8_gemm.available() else "no AVX512-BF16 int8 kernel in this build"
        if target.cuda:
            found["triton_int8"] = triton_gemm_reason("int8", target.device, target.dtype)
    if target.cpu and target.dtype in (torch.bfloat16, torch.float32) and (
            target.quantization != "none" or "cpu_kernels" in found):
        # The formats a checkpoint brings (GGUF blocks, GPTQ...) are known only once it loads: check both here.
        for field, module in (("grouped_int4_cpu_kernel", cpu_int4_gemm),
                              ("grouped_int8_cpu_kernel", cpu_grouped_int8_gemm), ("fp8_cpu_kernel", cpu_fp8_gemm)):
            found[field] = None if module.available() else f"no {module.__name__} in this build (AVX512-BF16)"
        if settings.int4_activations in ("auto", "int8"):
            found["int4_int8_activations"] = None if cpu_int4_gemm.int8_available() else \
                "no int8 activations in this build of cpu_int4_gemm (AVX512-VNNI or AVX2)"
        found["float32_grouped_cpu"] = None if cpu_int4_gemm.takes_float32() and \
            cpu_grouped_int8_gemm.takes_float32() else "this build's grouped CPU GEMMs take bfloat16 only"
    if target.cpu and target.dtype == torch.bfloat16 and "cpu_kernels" in found:
        found["moe_cpu_kernel"] = None if cpu_moe.available() else "no AVX512-BF16 cpu_moe in this build"
    if target.quantization == "int4" and target.cuda:  # --quantization int4 computes with the 4-bit grouped GEMM
        found["triton_grouped_int4"] = triton_gemm_reason("grouped4", target.device, target.dtype)
    if target.quantization in PREQUANTIZED and target.cuda:
        for field, method in (("triton_grouped_int4", "grouped4"), ("triton_grouped_int8", "grouped8"),
                              ("triton_fp8", "fp8")):
            found[field] = triton_gemm_reason(method, target.device, target.dtype)
    return Loaded(**found)


def _cpu_kernels_reason() -> str | None:
    if cpu_extension.available():
        return None
    return str(cpu_extension.build_info()["error"] or f"disabled ({cpu_extension.DISABLE_ENV} is set)")


def _triton_device_reason(target: Target) -> str | None:
    """Why no Triton kernel can run on ``target``'s device: CUDA, or CPU under ``TRITON_INTERPRET=1`` (tests)."""
    try:
        from triton import knobs
    except ImportError:
        return "triton is not installed (pip install 'kubellm[gpu]')"
    if not (target.cuda or (target.cpu and knobs.runtime.interpret)):
        return (f"Triton kernels need a CUDA device (got {target.device!r}; TRITON_INTERPRET=1 runs them on CPU "
                "for tests)")
    return None


def triton_attention_reason(target: Target) -> str | None:
    """Why the Triton attention kernels cannot serve ``target``, or None when they built and matched their
    references here (kernels/triton_check.py). On CPU they run only under ``TRITON_INTERPRET=1`` (tests)."""
    if reason := _triton_device_reason(target):
        return reason
    from kubellm.kernels import triton_check

    return triton_check.check(target.device, target.dtype, target.num_heads, target.num_kv_heads, target.head_dim,
                              target.block_size)


def triton_layer_ops_reason(target: Target) -> str | None:
    """Why the Triton layer ops (kernels/triton_layer_ops.py) cannot serve ``target``, or None when each matched
    its reference here at the model's head shape (the same device rule as attention)."""
    if reason := _triton_device_reason(target):
        return reason
    from kubellm.kernels import triton_check

    return triton_check.check_layer_ops(target.device, target.dtype, target.num_heads, target.num_kv_heads,
                                        target.head_dim)


@functools.cache
def triton_gemm_reason(method: str, device: str, dtype: torch.dtype) -> str | None:
    """Why the Triton GEMM for ``method`` (int8, grouped4, grouped8, fp8) cannot run on ``device`` (its
    start-up check, once per process)."""
    try:
        from kubellm.kernels import triton_check
    except ImportError as e:  # no triton in this image
        reason = str(e)
    else:
        checks = {"int8": triton_check.check_int8_gemm,
                  "grouped4": functools.partial(triton_check.check_grouped_gemm, bits=4),
                  "grouped8": functools.partial(triton_check.check_grouped_gemm, bits=8),
                  "fp8": triton_check.check_fp8_gemm}
        reason = checks[method](device, dtype)
    if reason:
        log.warning("%s layers dequantize per call (slower; the memory saving holds): %s", method, reason)
    return reason


# ---- entry points -------------------------------------------------------------------------------------------
def decide(settings: KernelSettings, target: Target) -> KernelChoice:
    """Probe, choose and log: what an engine calls once at start-up."""
    loaded = probe(settings, target)
    choice = choose(settings, target, loaded)
    if settings.attention == "auto" and target.cuda and choice.attention != "triton":
        log.warning("Triton attention unavailable, using the PyTorch reference: %s", loaded.triton_attention)
    if settings.layer_ops == "auto" and target.cuda and choice.layer_ops != "triton":
        log.warning("Triton layer ops unavailable, using the PyTorch references: %s", loaded.triton_layer_ops)
    log.info("kernels: %s", choice.describe(target.quantization))
    return choice


def load(choice: KernelChoice) -> None:
    """Load in this process what ``choice`` runs: a tensor-parallel rank runs rank 0's choice, and the CPU
    extension is loaded per process."""
    native = "native" in (choice.layer_ops, choice.int8_gemm, choice.grouped_int4_gemm, choice.grouped_int8_gemm,
                          choice.fp8_gemm, choice.moe, choice.prepack) \
        or choice.attention == "cpu"
    if native and (reason := _cpu_kernels_reason()):
        raise RuntimeError(f"the chosen kernels need kubellm's CPU kernels, which cannot load here: {reason}")


_CPU_PATHS = {  # Loaded field -> what it is, for `kubellm kernels info`
    "cpu_kernels": "native CPU kernels (attention, layer ops)",
    "bf16_cpu_kernel": "native bf16 linear",
    "onednn_prepack": "oneDNN prepacked linear",
    "int8_cpu_kernel": "native int8 GEMM",
    "grouped_int4_cpu_kernel": "native 4-bit grouped GEMM, bf16 activations",
    "int4_int8_activations": "int8 activations of the 4-bit GEMM",
    "grouped_int8_cpu_kernel": "native 8-bit grouped GEMM",
    "float32_grouped_cpu": "float32 activations of the 4-bit (int8) and 8-bit GEMMs",
    "fp8_cpu_kernel": "native FP8 GEMM",
    "moe_cpu_kernel": "native mixture-of-experts kernel",
}


def cpu_report(dtype: torch.dtype, head_dim: int = 64) -> list[str]:
    """What ``auto`` picks on this CPU for a model of ``dtype`` (int8-quantized, to probe every GEMM), then each
    native path: available, or why not."""
    settings, target = KernelSettings(), Target("cpu", dtype, 4, 4, head_dim, quantization="int8")
    loaded = probe(settings, target)
    choice = choose(settings, target, loaded)
    lines = [f"{str(dtype).removeprefix('torch.')}: dense linears {choice.dense_linears}, attention "
             f"{choice.attention}, layer ops {choice.layer_ops}, int8 GEMM {choice.int8_gemm}, 4-bit GEMM "
             f"{choice.grouped_int4_gemm}, 8-bit GEMM {choice.grouped_int8_gemm}, FP8 GEMM {choice.fp8_gemm}, "
             f"MoE {choice.moe}"]
    for field, title in _CPU_PATHS.items():
        reason = getattr(loaded, field)
        if reason != NOT_PROBED:
            lines.append(f"  {title}: {'available' if reason is None else 'no: ' + reason}")
    return lines


def for_engine(config, model_config, tp_size: int = 1) -> KernelChoice:
    """:func:`decide` for an engine's settings and model (this rank's share of the heads)."""
    target = Target(config.device, config.dtype, model_config.num_heads // tp_size,
                    model_config.num_kv_heads // tp_size, model_config.head_dim, config.block_size,
                    config.quantization)
    return decide(KernelSettings.from_config(config), target)


def for_quantized_layer(device: str | torch.device, dtype: torch.dtype, method: str,
                        int4_activations: str = "bf16") -> KernelChoice:
    """The GEMM choice for a quantized layer built on its own (tests, tools): ``auto`` for ``device``/``dtype``."""
    settings = KernelSettings(attention="torch", layer_ops="torch", prepack="off", int4_activations=int4_activations)
    target = Target(str(torch.device(device)), dtype, quantization=method)
    return choose(settings, target, probe(settings, target))
