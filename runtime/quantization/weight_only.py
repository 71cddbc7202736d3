"""Weight-only quantization of the decoder's linear layers (``--quantization``).

``int8``: each output channel (weight row) gets one scale, ``max|w| / 127``, and its weights are rounded to
int8 in ``[-127, 127]``; activations stay in the model dtype. Weights take about half the memory of bf16 (a
quarter of fp32), which leaves more room for the KV cache. The GEMM, by what runs here (``kernel_choice`` decides):

* bf16 models on CPUs with AVX512-BF16: kubellm's kernel (``kernels/cpu_int8_gemm.py``), which widens the
  int8 weights to bf16 in registers: faster than bf16's prepacked GEMM up to ~64 rows (it reads half the
  bytes), level with it above.
* other CPU cases: PyTorch's int8 weight-only GEMM (``torch._weight_int8pack_mm``) for steps of up to 32
  rows, where it beats dequantizing; larger steps dequantize the weight for the call.
* CUDA: a Triton kernel (``kernels/triton_int8_gemm.py``) that reads the int8 weights and widens them in
  registers for the tensor cores, once its start-up check passed on the device (else dequantize per call).
  Correct on an H200 (the GPU kit, benchmarks/results/), not yet as fast as cuBLAS on the bf16 weight.
* other devices: dequantize per call (correct, the memory saving holds, no speed-up).

``int4``: asymmetric min-max per output channel and group of 32 inputs (one group per row where 32 does not
divide the input size): values 0..15 with ``w ≈ (q - z) * s``, ``s = (max - min) / 15``, a float zero point
``z = -min / s``, both kept in float16: 4 bits a weight plus 1 for the group's pair, about 31% of bf16's
weight memory. Asymmetric because 16 levels spread over a group's own range lose less than a symmetric grid
around 0 that leaves part of one side unused; groups of 32 because on the demo model 64 still lost 42% in
perplexity (benchmarks/README.md "Quality", which also says why 32 flatters that model) for 0.5 bits a weight
less. The layer is the :class:`QuantizedLinear` 4-bit checkpoints load into (experts' too), so it computes
with their GEMMs: the native kernel (``kernels/cpu_int4_gemm.py``) for bf16 on CPUs with AVX512-BF16, the
Triton grouped GEMM (``kernels/triton_grouped_gemm.py``) on CUDA once its start-up check passed, else
dequantize per call (correct, slow).

Embeddings, norms and the LM head stay in the model dtype, as in most weight-only schemes: they are a small
share of the weights of a large model and the LM head decides the tokens.

The other methods the LLMDeployment API names (fp8, awq, gptq, gguf) are formats of checkpoints quantized
elsewhere: the checkpoint decides (``runtime/quantization/prequantized.py`` detects it, ``runtime/quantization/loading.py``
loads it), and naming one is a check that the checkpoint is quantized that way (:func:`check_checkpoint`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kubellm.kernels import cpu_int8_gemm
from kubellm.runtime.layers import kernel_choice
from kubellm.runtime.layers.kernel_choice import KernelChoice
from kubellm.runtime.quantization.prequantized import QuantizedWeight

log = logging.getLogger("kubellm.quantization")

METHODS = ("none", "int8", "int4")
# Above this many rows torch's int8 GEMM loses to dequantize-then-GEMM (measured on 2 cores, SmolLM2 shapes).
INT8_GEMM_MAX_ROWS = 32
PREQUANTIZED = ("fp8", "awq", "gptq", "gguf")  # what a checkpoint brings: named only as a check
INT4_GROUP = 32


def check_method(method: str) -> None:
    if method not in METHODS + PREQUANTIZED:
        raise ValueError(f"quantization: unknown {method!r}; use {', '.join(METHODS + PREQUANTIZED)}")


def checkpoint_method(config: dict, source: str = "") -> str | None:
    """How the checkpoint is quantized (``prequantized.detect``'s method, or ``gguf``), None when it is not;
    a CheckpointError for a quantization it declares that is not supported."""
    from kubellm.runtime.quantization import prequantized
    spec = prequantized.detect(config, f" in {source}" if source else "")
    if spec is not None:
        return spec.method
    return "gguf" if str(source).endswith(".gguf") else None


def check_checkpoint(method: str, config: dict, source: str = "") -> None:
    """``--quantization`` against the checkpoint: none lets the checkpoint decide; a format's name must be the
    checkpoint's; int8/int4 quantize full-precision weights only."""
    found = checkpoint_method(config, source)
    if method in ("none", found):
        return
    if method in PREQUANTIZED:
        raise ValueError(f"quantization {method!r} was asked for, but {source or 'the checkpoint'} is "
                         f"{'quantized as ' + repr(found) if found else 'not quantized'}; set quantization to "
                         f"{found or 'none'} or leave it unset")
    if found is not None and found != "gguf":
        raise ValueError(f"quantization {method!r} quantizes full-precision weights, but {source or 'the checkpoint'}"
                         f" is already quantized as {found!r}; leave quantization unset (none) to serve it as stored")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` → (int8 ``[out, in]``, float32 scales ``[out]``), symmetric per output channel.
    An all-zero row gets scale 1 (its weights quantize to 0 either way)."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight an int8 layer computes with: ``q * scale`` per row (what reference models are given)."""
    return (q.float() * scales[:, None]).to(dtype)


PATHS = ("native", "triton", "torch", "dequantize")


class Int8Linear(nn.Module):
    """Drop-in for an ``nn.Linear``: int8 weight, one scale per output channel, activations in the model dtype.

    ``qweight`` is the int8 weight, in the native kernel's packed layout when ``path == "native"``. ``path``:
    the engine's :class:`~kubellm.runtime.layers.kernel_choice.KernelChoice` gives it; alone (tests, tools), ``auto``
    for the layer's device and dtype."""

    def __init__(self, linear: nn.Linear, path: str | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scales = quantize_int8(linear.weight)
        w = linear.weight
        self.path = path or kernel_choice.for_quantized_layer(w.device, w.dtype, "int8").int8_path(q)
        if self.path not in PATHS:
            raise ValueError(f"int8 GEMM path {self.path!r}; use one of {', '.join(PATHS)}")
        self.bias = linear.bias
        if self.path in ("native", "triton"):  # float32 scales and bias, applied before the output is rounded
            self.register_buffer("qweight", cpu_int8_gemm.pack(q) if self.path == "native" else q.contiguous())
            self.register_buffer("scales", scales)
            self.bias_f32 = None if linear.bias is None else linear.bias.detach().float().contiguous()
        else:
            self.register_buffer("qweight", q.contiguous())
            self.register_buffer("scales", scales.to(linear.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.path == "native" and x.dtype == torch.bfloat16:
            out = cpu_int8_gemm.int8_gemm(rows if rows.stride(-1) == 1 else rows.contiguous(), self.qweight,
                                          self.scales, self.bias_f32)
            return out.view(*x.shape[:-1], self.out_features)
        if self.path == "triton":
            from kubellm.kernels import triton_int8_gemm

            out = triton_int8_gemm.int8_gemm(rows, self.qweight, self.scales, self.bias_f32)
            return out.view(*x.shape[:-1], self.out_features)
        if self.path == "torch" and x.dtype == self.scales.dtype and rows.shape[0] <= INT8_GEMM_MAX_ROWS:
            out = torch._weight_int8pack_mm(rows.contiguous(), self.qweight, self.scales)
            out = out.view(*x.shape[:-1], self.out_features)
        else:
            out = nn.functional.linear(x, self.dequantized(x.dtype))
        return out if self.bias is None else out + self.bias

    def int8_gemm_args(self) -> tuple | None:
        """``(qweight, scales, bias)`` when :meth:`forward` on bfloat16 rows is exactly
        ``cpu_int8_gemm.int8_gemm(rows, *these)`` (the native path; the bias in float32), else None."""
        return (self.qweight, self.scales, self.bias_f32) if self.path == "native" else None

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The ``[out, in]`` weight this layer computes with."""
        q = self.qweight
        if self.path == "native":  # [N/16, K/2, 16, 2] -> [N, K]
            q = q.permute(0, 2, 1, 3).reshape(self.out_features, self.in_features)
        return q.to(dtype) * self.scales[:, None].to(dtype)


def int4_group(in_features: int) -> int:
    """:data:`INT4_GROUP` where it divides ``in_features``, else one group per row."""
    return INT4_GROUP if in_features % INT4_GROUP == 0 else in_features


def quantize_int4(weight: torch.Tensor, group: int) -> QuantizedWeight:
    """``weight [out, in]`` → values 0..15 ``[out, in]`` (uint8) with a scale and a zero point per output channel
    and group of ``group`` inputs (``[out, in/group]``), asymmetric min-max: ``w ≈ (q - z) * s`` with
    ``s = (max - min) / 15`` and ``z = -min / s``, so each group's 16 levels span exactly its own range. The
    zero point is a float (GGUF Q4_1's free minimum, not AWQ's integer one), and both are rounded to float16
    first and the values computed from the rounded pair, so the layer keeps them in float16 at no extra error;
    where float16 cannot hold one (a near-constant group far from zero), that layer keeps float32."""
    out_features, in_features = weight.shape
    if in_features % 2 or in_features % group:
        raise ValueError(f"int4 needs an even input size divisible by the group ({group}), got {in_features}")
    w = weight.detach().float().view(out_features, in_features // group, group)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    scales = (hi - lo) / 15.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # a constant group: q = 0 is the value
    scales = _fp16_where_exact_enough(scales)
    zeros = _fp16_where_exact_enough(-lo / scales)
    q = torch.round(w / scales[:, :, None] + zeros[:, :, None]).clamp_(0, 15)
    return QuantizedWeight(q.view(out_features, in_features).to(torch.uint8), scales, zeros, group)


def _fp16_where_exact_enough(t: torch.Tensor) -> torch.Tensor:
    """``t`` (float32) rounded to float16 where float16 holds it (finite, not flushed to zero), else as is."""
    half = t.to(torch.float16).float()
    return torch.where(torch.isfinite(half) & ((half != 0) | (t == 0)), half, t)


def int4_layer(linear: nn.Linear, kernels: KernelChoice | None = None):
    """``--quantization int4`` for one layer: :func:`quantize_int4`'s weights in a :class:`QuantizedLinear`, the
    layer every 4-bit checkpoint format loads into, on the GEMM ``kernels`` chose for its shape (native CPU
    kernel, Triton grouped GEMM on CUDA, else dequantize per call); ``auto`` for its device and dtype without."""
    from kubellm.runtime.layers.quantized_linear import QuantizedLinear

    w = linear.weight
    group = int4_group(linear.in_features)
    if kernels is None:
        kernels = kernel_choice.for_quantized_layer(w.device, w.dtype, "int4")
    path = kernels.grouped_path(4, linear.out_features, linear.in_features, group)
    return QuantizedLinear(quantize_int4(w, group), 4, path, None if linear.bias is None else linear.bias.detach(),
                           int8_activations=kernels.int4_activations == "int8")


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of weights ``model`` holds per storage type: the dtype's name, or ``int4``/``int8``/
    ``float8_e4m3fn`` for quantized values (their scales and zero points count under their own dtype).
    Tied tensors count once; buffers that are not weights (rotary tables) not at all."""
    from kubellm.runtime.layers.quantized_linear import QuantizedLinear

    out: dict[str, int] = {}
    seen: set[int] = set()

    def add(kind: str, t: torch.Tensor | None) -> None:
        if t is None or t.numel() == 0 or t.data_ptr() in seen:
            return
        seen.add(t.data_ptr())
        out[kind] = out.get(kind, 0) + t.numel() * t.element_size()

    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            for kind, n in m.weight_bytes().items():
                out[kind] = out.get(kind, 0) + n
        elif isinstance(m, Int8Linear):
            add("int8", m.qweight)
            add(str(m.scales.dtype).removeprefix("torch."), m.scales)
        for p in m.parameters(recurse=False):
            add(str(p.dtype).removeprefix("torch."), p)
    return dict(sorted(out.items()))


def log_weight_bytes(model: nn.Module) -> dict[str, int]:
    """One log line with :func:`weight_bytes` (as ``weight_bytes`` in JSON logs); returns it."""
    sizes = weight_bytes(model)
    log.info("weight bytes by dtype: %s (total %.1f MiB)", " ".join(f"{k}={v}" for k, v in sizes.items()),
             sum(sizes.values()) / 2**20, extra={"fields": {"weight_bytes": sizes}})
    return sizes


def quantize_model(model: nn.Module, method: str, kernels: KernelChoice | None = None) -> int:
    """Replace the decoder layers' ``nn.Linear`` modules (experts' too, not routers) per ``method``, each with
    the GEMM ``kernels`` chose (``auto`` per layer without); returns how many were replaced."""
    check_method(method)
    if method == "none" or method in PREQUANTIZED:
        return 0  # a pre-quantized checkpoint's layers were built quantized at load
    layers = model.get_submodule("model.layers")
    # Mixture-of-experts routers (mlp.gate) stay in the model dtype: a rounded router picks other experts.
    targets = [(name, m) for name, m in layers.named_modules() if isinstance(m, nn.Linear) and not name.endswith(".gate")]
    before = sum(m.weight.numel() * m.weight.element_size() for _, m in targets)
    from kubellm.runtime.layers.quantized_linear import QuantizedLinear

    for name, linear in targets:
        if method == "int8":
            layer = Int8Linear(linear, None if kernels is None else kernels.int8_path(linear.weight))
        else:
            layer = int4_layer(linear, kernels)
        parent_name, _, attr = name.rpartition(".")
        setattr(layers.get_submodule(parent_name) if parent_name else layers, attr, layer)
    after = sum(b.numel() * b.element_size() for m in layers.modules()
                if isinstance(m, (Int8Linear, QuantizedLinear))
                for b in (m.qweight, m.scales, getattr(m, "zeros", None)) if b is not None)
    log.info("quantized %d linear layers to %s: %.1f MiB -> %.1f MiB of weights", len(targets), method,
             before / 2**20, after / 2**20)
    return len(targets)
