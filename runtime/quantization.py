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
  Not yet run on a GPU.
* other devices: dequantize per call (correct, the memory saving holds, no speed-up).

``int4``: signed 4-bit weights in ``[-8, 7]`` with one scale (``max|w| / 7``) per output channel and group of
128 inputs (fewer where the layer's input size is not a multiple of 128), two weights per byte: about a
quarter of bf16's weight memory. On CUDA a Triton kernel (``kernels/triton_int4_gemm.py``) unpacks the
nibbles in registers, once its start-up check passed (not yet run on a GPU); bf16 on CPUs with AVX512-BF16
runs the native int4 kernel (``kernels/cpu_int4_gemm.py``, the same weights as values + 8 with zero point 8 in
a ``QuantizedLinear``; experts keep ``Int4Linear``); elsewhere the layer dequantizes per call (correct, slow;
the LLMDeployment API admits int4 only on GPUs).

Embeddings, norms and the LM head stay in the model dtype, as in most weight-only schemes: they are a small
share of the weights of a large model and the LM head decides the tokens.

The other methods the LLMDeployment API names (fp8, awq, gptq, gguf) are formats of checkpoints quantized
elsewhere: the checkpoint decides (``runtime/prequantized.py`` detects it, ``runtime/models/quantized_loading.py``
loads it), and naming one is a check that the checkpoint is quantized that way (:func:`check_checkpoint`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kubellm.kernels import cpu_int8_gemm, int4_weights
from kubellm.runtime import kernel_choice
from kubellm.runtime.kernel_choice import KernelChoice

log = logging.getLogger("kubellm.quantization")

METHODS = ("none", "int8", "int4")
# Above this many rows torch's int8 GEMM loses to dequantize-then-GEMM (measured on 2 cores, SmolLM2 shapes).
INT8_GEMM_MAX_ROWS = 32
PREQUANTIZED = ("fp8", "awq", "gptq", "gguf")  # what a checkpoint brings: named only as a check
INT4_GROUP = 128


def check_method(method: str) -> None:
    if method not in METHODS + PREQUANTIZED:
        raise ValueError(f"quantization: unknown {method!r}; use {', '.join(METHODS + PREQUANTIZED)}")


def checkpoint_method(config: dict, source: str = "") -> str | None:
    """How the checkpoint is quantized (``prequantized.detect``'s method, or ``gguf``), None when it is not;
    a CheckpointError for a quantization it declares that is not supported."""
    from kubellm.runtime import prequantized

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
    the engine's :class:`~kubellm.runtime.kernel_choice.KernelChoice` gives it; alone (tests, tools), ``auto``
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

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The ``[out, in]`` weight this layer computes with."""
        q = self.qweight
        if self.path == "native":  # [N/16, K/2, 16, 2] -> [N, K]
            q = q.permute(0, 2, 1, 3).reshape(self.out_features, self.in_features)
        return q.to(dtype) * self.scales[:, None].to(dtype)


def int4_group(in_features: int) -> int:
    """128, or the largest of 64/32 dividing ``in_features``, else one group per row."""
    return next((g for g in (INT4_GROUP, 64, 32) if in_features % g == 0), in_features)


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` → (uint8 ``[out, in/2]``: two signed nibbles per byte, low = even input; float32
    scales ``[out, in/group]``), symmetric per output channel and group of ``group`` inputs."""
    out_features, in_features = weight.shape
    if in_features % 2 or in_features % group:
        raise ValueError(f"int4 needs an even input size divisible by the group ({group}), got {in_features}")
    w = weight.detach().float().view(out_features, in_features // group, group)
    scales = w.abs().amax(dim=2) / 7.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, :, None]).clamp_(-8, 7).view(out_features, in_features)
    return int4_weights.pack_int4(q), scales


class Int4Linear(nn.Module):
    """Drop-in for an ``nn.Linear``: packed int4 weight, group-wise float32 scales, activations in the model
    dtype. ``path``: ``triton`` (CUDA, checked at start-up) or ``dequantize``; given as for :class:`Int8Linear`."""

    def __init__(self, linear: nn.Linear, path: str | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group = int4_group(linear.in_features)
        packed, scales = quantize_int4(linear.weight, self.group)
        if path is None:
            path = kernel_choice.for_quantized_layer(packed.device, linear.weight.dtype, "int4").int4_gemm
        if path not in ("triton", "dequantize"):
            raise ValueError(f"int4 GEMM path {path!r}; use triton or dequantize")
        self.path = path
        self.register_buffer("qweight", packed)
        self.register_buffer("scales", scales)
        self.bias = linear.bias
        self.bias_f32 = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.path == "triton":
            from kubellm.kernels import triton_int4_gemm

            rows = x.reshape(-1, self.in_features)
            out = triton_int4_gemm.int4_gemm(rows, self.qweight, self.scales, self.group, self.bias_f32)
            return out.view(*x.shape[:-1], self.out_features)
        out = nn.functional.linear(x, self.dequantized(x.dtype))
        return out if self.bias is None else out + self.bias

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return int4_weights.dequantize_int4(self.qweight, self.scales, self.group, dtype)


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
        elif isinstance(m, (Int8Linear, Int4Linear)):
            add("int8" if isinstance(m, Int8Linear) else "int4", m.qweight)
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


def _native_int4(linear: nn.Linear, kernels: KernelChoice | None):
    """``--quantization int4`` where the native CPU int4 kernel takes the layer (bf16, AVX512-BF16): the same
    signed 4-bit weights and group scales as :class:`Int4Linear`, as unsigned values q + 8 with zero point 8 in
    a :class:`QuantizedLinear` that runs ``kernels/cpu_int4_gemm.py``; None where it does not."""
    from kubellm.runtime.layers.quantized_linear import QuantizedLinear
    from kubellm.runtime.prequantized import QuantizedWeight

    if kernels is None or linear.weight.dtype != torch.bfloat16:
        return None
    group = int4_group(linear.in_features)
    if kernels.grouped_path(4, linear.out_features, linear.in_features, group) != "native":
        return None
    packed, scales = quantize_int4(linear.weight, group)
    values = (int4_weights.unpack_int4(packed).to(torch.int16) + 8).to(torch.uint8)
    weight = QuantizedWeight(values, scales, torch.full_like(scales, 8.0), group)
    return QuantizedLinear(weight, 4, "native", None if linear.bias is None else linear.bias.detach())


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
        elif ".experts." not in name and (native := _native_int4(linear, kernels)) is not None:
            layer = native
        else:
            layer = Int4Linear(linear, None if kernels is None else kernels.int4_gemm)
        parent_name, _, attr = name.rpartition(".")
        setattr(layers.get_submodule(parent_name) if parent_name else layers, attr, layer)
    after = sum(b.numel() * b.element_size() for m in layers.modules()
                if isinstance(m, (Int8Linear, Int4Linear, QuantizedLinear))
                for b in (m.qweight, m.scales, getattr(m, "zeros", None)) if b is not None)
    log.info("quantized %d linear layers to %s: %.1f MiB -> %.1f MiB of weights", len(targets), method,
             before / 2**20, after / 2**20)
    return len(targets)
