"""Every quantization format by name, and what the engine and the loader ask of them by name: is this
``--quantization`` known, how is a checkpoint quantized, do the two agree, quantize a model at load, and how
many bytes its weights take.

Adding a format is one module with a :class:`~kubellm.runtime.quantization.base.QuantizationFormat` subclass
and one entry in :data:`FORMATS` (CONTRIBUTING.md, "Add a quantization format").

Embeddings, norms and the LM head stay in the model dtype under the methods applied at load, as in most
weight-only schemes: they are a small share of the weights of a large model and the LM head decides the tokens.
"""

from __future__ import annotations

import logging

from torch import nn

from kubellm.runtime.layers.checkpoint_error import CheckpointError
from kubellm.runtime.layers.kernel_choice import KernelChoice
from kubellm.runtime.layers.quantized_linear import QuantizedLinear
from kubellm.runtime.quantization.awq import AWQ
from kubellm.runtime.quantization.base import QuantizationFormat
from kubellm.runtime.quantization.compressed_tensors import CompressedTensors
from kubellm.runtime.quantization.fp8 import FP8
from kubellm.runtime.quantization.gguf import GGUF
from kubellm.runtime.quantization.gptq import GPTQ
from kubellm.runtime.quantization.int4 import Int4
from kubellm.runtime.quantization.int8 import Int8, Int8Linear

log = logging.getLogger("kubellm.quantization")

# In --quantization's order: the methods applied at load, then the checkpoint formats.
FORMATS: dict[str, type[QuantizationFormat]] = {f.name: f for f in (Int8, Int4, FP8, AWQ, GPTQ, GGUF,
                                                                     CompressedTensors)}
METHODS = ("none", *(name for name, f in FORMATS.items() if f.flag_choice))  # the --quantization choices
_BY_QUANT_METHOD = {m: f for f in FORMATS.values() for m in f.quant_methods}


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"quantization: unknown {method!r}; use {', '.join(METHODS)}")


def detect(config: dict, where: str = "") -> QuantizationFormat | None:
    """The quantization config.json declares (``quantization_config``, or ``compression_config``), or None;
    a CheckpointError naming what is not supported."""
    qc = config.get("quantization_config") or config.get("compression_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method not in _BY_QUANT_METHOD:
        raise CheckpointError(f"quantization method {method!r}{where} is not supported; supported: "
                              f"{', '.join(sorted(_BY_QUANT_METHOD))}")
    return _BY_QUANT_METHOD[method].from_config(qc, where)


def checkpoint_method(config: dict, source: str = "") -> str | None:
    """How the checkpoint is quantized (its format's name, or ``gguf`` for a .gguf file), None when it is not;
    a CheckpointError for a quantization it declares that is not supported."""
    found = detect(config, f" in {source}" if source else "")
    if found is not None:
        return found.name
    return GGUF.name if str(source).endswith(".gguf") else None


def check_checkpoint(method: str, config: dict, source: str = "") -> None:
    """``--quantization`` against the checkpoint: none lets the checkpoint decide; a format's name must be the
    checkpoint's; int8/int4 quantize full-precision weights only."""
    found = checkpoint_method(config, source)
    if method in ("none", found):
        return
    if FORMATS[method].prequantized:
        raise ValueError(f"quantization {method!r} was asked for, but {source or 'the checkpoint'} is "
                         f"{'quantized as ' + repr(found) if found else 'not quantized'}; set quantization to "
                         f"{found or 'none'} or leave it unset")
    if found is not None and found != GGUF.name:
        raise ValueError(f"quantization {method!r} quantizes full-precision weights, but {source or 'the checkpoint'}"
                         f" is already quantized as {found!r}; leave quantization unset (none) to serve it as stored")


def quantize_model(model: nn.Module, method: str, kernels: KernelChoice | None = None) -> int:
    """Replace the decoder layers' ``nn.Linear`` modules (experts' too, not routers) per ``method``, each with
    the GEMM ``kernels`` chose (``auto`` per layer without); returns how many were replaced."""
    check_method(method)
    if method == "none" or FORMATS[method].prequantized:
        return 0  # a pre-quantized checkpoint's layers were built quantized at load
    fmt = FORMATS[method]()
    layers = model.get_submodule("model.layers")
    # Mixture-of-experts routers (mlp.gate) stay in the model dtype: a rounded router picks other experts.
    targets = [(name, m) for name, m in layers.named_modules() if isinstance(m, nn.Linear) and not name.endswith(".gate")]
    before = sum(m.weight.numel() * m.weight.element_size() for _, m in targets)
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(layers.get_submodule(parent_name) if parent_name else layers, attr, fmt.quantize_linear(linear, kernels))
    after = sum(b.numel() * b.element_size() for m in layers.modules()
                if isinstance(m, (Int8Linear, QuantizedLinear))
                for b in (m.qweight, m.scales, getattr(m, "zeros", None)) if b is not None)
    log.info("quantized %d linear layers to %s: %.1f MiB -> %.1f MiB of weights", len(targets), method,
             before / 2**20, after / 2**20)
    return len(targets)


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of weights ``model`` holds per storage type: the dtype's name, or ``int4``/``int8``/
    ``float8_e4m3fn`` for quantized values (their scales and zero points count under their own dtype).
    Tied tensors count once; buffers that are not weights (rotary tables) not at all."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for m in model.modules():
        if isinstance(m, (QuantizedLinear, Int8Linear)):  # quantized values are buffers: the layer counts them
            for kind, n in m.weight_bytes().items():
                out[kind] = out.get(kind, 0) + n
        for p in m.parameters(recurse=False):
            if p.numel() and p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                kind = str(p.dtype).removeprefix("torch.")
                out[kind] = out.get(kind, 0) + p.numel() * p.element_size()
    return dict(sorted(out.items()))


def log_weight_bytes(model: nn.Module) -> dict[str, int]:
    """One log line with :func:`weight_bytes` (as ``weight_bytes`` in JSON logs); returns it."""
    sizes = weight_bytes(model)
    log.info("weight bytes by dtype: %s (total %.1f MiB)", " ".join(f"{k}={v}" for k, v in sizes.items()),
             sum(sizes.values()) / 2**20, extra={"fields": {"weight_bytes": sizes}})
    return sizes

