"""The fused decode layer's arguments: a pure decode step runs one native call per decoder layer
(kernels/cpu_decode_layer.py) instead of the module tree, when every part of the layer runs on the native CPU
kernels that call would run.

Each part says what it hands the call: a linear through its ``fused_decode_linear()`` (``NativeLinear``,
``QuantizedLinear``, the int8 method's ``Int8Linear``), an MLP through its ``fused_decode_args()`` (the dense MLP
via :func:`dense_mlp_args`, a mixture of experts via ``FusedMoE.fused_decode_args``). A model gathers its layer's
parts (norm weights, rotary tables, cache, attention shape, q/k norms) and :func:`decode_layer_call` picks the
kernel entry and orders its arguments; models never call the kernels themselves.
"""

from __future__ import annotations

from torch import nn

from kubellm.kernels.cpu_decode_layer import BF16, decode_layer_, decode_layer_q_

# A linear's arguments: (kind, weight, scales, zeros, group_size, int8_activations, bias), kernels/cpu_decode_layer.py's
# kinds, exactly what its forward hands its native kernel on bfloat16 rows.
FusedLinear = tuple


def fused_linear(m: nn.Module | None) -> FusedLinear | None:
    """What the fused decode layer takes for linear ``m``, or None: the module tree runs it (other paths, act-order
    gathers, layers without a native kernel)."""
    get = getattr(m, "fused_decode_linear", None)
    return None if get is None else get()


def dense_mlp_args(gate_up: nn.Module, down: nn.Module, intermediate: int) -> tuple | None:
    """A dense SiLU-gated MLP's arguments (gate_up, down, intermediate, router, top_k, renormalize) on native
    linears without biases, else None."""
    gate_up_args, down_args = fused_linear(gate_up), fused_linear(down)
    if gate_up_args is None or down_args is None or gate_up_args[-1] is not None or down_args[-1] is not None:
        return None
    return gate_up_args, down_args, intermediate, None, 0, False


def decode_layer_call(norms: tuple, qkv: FusedLinear, o: FusedLinear, mlp: tuple, rest: tuple) -> tuple | None:
    """``(fn, args)``: :func:`decode_layer_` (bf16 linears, or packed bf16 experts) or ``decode_layer_q_`` (each
    linear on its native GEMM, bf16, 4-bit, FP8 or 8-bit, mixed as they come; a dense MLP) with the layer's
    constant arguments, or None when no entry takes this mix (packed experts beside quantized attention).
    ``norms``: (input norm weight, post-attention norm weight, eps); ``rest``: (cos, sin, k_cache, v_cache,
    heads, kv heads, scale, window, softcap, q norm, k norm); ``mlp`` as :func:`dense_mlp_args` gives it."""
    gate_up, down, intermediate, router, top_k, renormalize = mlp
    qkv_bias = qkv[-1]
    if router is not None:  # packed bf16 experts: their kernel runs in decode_layer_ only
        if qkv[0] != BF16 or o[0] != BF16:
            return None
        return decode_layer_, (*norms, qkv[1], qkv_bias, o[1], gate_up, down, intermediate, *rest, router, top_k,
                               renormalize)
    linears = (qkv, o, gate_up, down)
    if all(lin[0] == BF16 for lin in linears):
        return decode_layer_, (*norms, qkv[1], qkv_bias, o[1], gate_up[1], down[1], intermediate, *rest, None, 0,
                               False)
    kinds, weights, scales, zeros, group_sizes, int8_activations, _ = (list(c) for c in zip(*linears, strict=True))
    return decode_layer_q_, (*norms, kinds, weights, scales, zeros, group_sizes, int8_activations, qkv_bias,
                             intermediate, *rest)
