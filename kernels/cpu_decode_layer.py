"""One Llama decoder layer of a pure decode step in one native call (``csrc/decode_layer_cpu.cpp``) beside its
plain-PyTorch reference.

Contract (bfloat16 activations and pool; the weights packed by :func:`kubellm.kernels.cpu_bf16_gemm.pack`), for
``T`` decode rows (one query token each, e.g. a batch-1 step's single token):

* ``hidden`` ``[T, hidden]``: the previous layer's MLP output (the embedding before the first layer);
  ``residual`` ``[T, hidden]``: the residual stream before it (zeros before the first layer). On return
  ``residual`` holds ``residual + hidden`` after attention, i.e. what the next layer adds the returned MLP
  output to; ``hidden`` is overwritten (it held the normed input).
* ``positions``, ``slots`` ``[T]`` int64; ``block_tables`` ``[T, max_blocks]`` and ``context_lens`` ``[T]``
  int32 (the context including this token), as :mod:`kubellm.kernels.cpu_paged_attention` takes them.
* ``k_cache``/``v_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]``: this token's K/V are written at
  ``slots`` before attention reads the pool.
* The layer: ``x = norm1(residual += hidden)``; ``q, k, v = qkv(x)`` (+ bias); with ``q_norm``/``k_norm``
  ``[head_dim]`` (Qwen3) RMSNorm each head of q and of k (``eps`` too); rotate q and k (``cos``/``sin``
  ``[max_positions, head_dim]``); write k, v; ``a = attention(q)``; ``y = norm2(residual += o(a))``; returns
  ``down(silu(gate(y)) * up(y))``, or with ``router`` (a packed ``[num_experts, hidden]`` linear: a mixture of
  experts) the ``top_k`` experts of :mod:`kubellm.kernels.cpu_moe` on ``router(y)``, ``gate_up``/``down``
  then holding every expert as :func:`kubellm.kernels.cpu_moe.pack` packs them.

The kernel calls the same native kernels the unfused model runs (bf16 linear, add + RMSNorm, rotary or q/k norm +
rotary, paged decode attention, SiLU-and-mul or the experts), in the same order on the same inputs, so its output equals the unfused path's
bit for bit; against the reference below (float32 GEMM sums in another order) it agrees to bfloat16 rounding.
A one-row layer on several threads runs in one parallel region whose threads share each GEMM's work items, not
one region per kernel (``KUBELLM_LAYER_REGION=0`` turns that off, for A/B runs; the bits are the same).

:func:`decode_layer_q_` is the same dense layer with each linear on any native CPU GEMM, per linear a kind code
(:data:`BF16` ``bf16_linear``, :data:`INT4` :mod:`~kubellm.kernels.cpu_int4_gemm`, :data:`FP8`
:mod:`~kubellm.kernels.cpu_fp8_gemm`, :data:`GROUPED_INT8` :mod:`~kubellm.kernels.cpu_grouped_int8_gemm`,
:data:`INT8` :mod:`~kubellm.kernels.cpu_int8_gemm`) and its arguments: ``kinds``, ``weights``, ``scales``,
``zeros``, ``group_sizes`` and ``int8_activations`` each list qkv, o, gate_up and down, as their layers pass
them to their kernel (entries a kind does not take: None, 0, False; ``qkv_bias`` as the qkv layer passes it,
float32), so 4-bit and 8-bit linears mix within a layer (GGUF Q4_K_M). Each kernel runs in its own parallel
region.
"""

from __future__ import annotations

import torch

from kubellm.kernels import (
    cpu_bf16_gemm,
    cpu_fp8_gemm,
    cpu_grouped_int8_gemm,
    cpu_int4_gemm,
    cpu_int8_gemm,
    cpu_layer_ops,
    cpu_moe,
)
from kubellm.kernels.cpu_paged_attention import reference_paged_decode_attention

__all__ = ["BF16", "FP8", "GROUPED_INT8", "INT4", "INT8", "decode_layer_", "decode_layer_q_", "reference_decode_layer_",
           "reference_decode_layer_q_"]

# decode_layer_q_'s kinds of linear (enum Kind in csrc/decode_layer_cpu.cpp)
BF16, INT4, FP8, GROUPED_INT8, INT8 = range(5)


def decode_layer_(hidden, residual, positions, slots, block_tables, context_lens, input_norm, post_norm,
                  eps: float, qkv, qkv_bias, o, gate_up, down, intermediate: int, cos, sin, k_cache, v_cache,
                  num_heads: int, num_kv_heads: int, scale: float, window: int = 0, softcap: float = 0.0,
                  q_norm=None, k_norm=None, router=None, top_k: int = 0, renormalize: bool = False):
    """The native layer (see the module docstring); ``window``/``softcap`` 0 mean off. Called 30 times a step:
    the one overload is named to skip the overload lookup (~4 us a call)."""
    return torch.ops.kubellm_cpu.decode_layer_.default(hidden, residual, positions, slots, block_tables,
                                                      context_lens, input_norm, post_norm, eps, qkv, qkv_bias, o,
                                                      gate_up, down, intermediate, cos, sin, k_cache, v_cache,
                                                      num_heads, num_kv_heads, scale, window, softcap, q_norm,
                                                      k_norm, router, top_k, renormalize)


def reference_decode_layer_(hidden, residual, positions, slots, block_tables, context_lens, input_norm, post_norm,
                            eps: float, qkv, qkv_bias, o, gate_up, down, intermediate: int, cos, sin, k_cache,
                            v_cache, num_heads: int, num_kv_heads: int, scale: float, window: int = 0,
                            softcap: float = 0.0, q_norm=None, k_norm=None, router=None, top_k: int = 0,
                            renormalize: bool = False):
    """The same layer from the plain-PyTorch references (weights unpacked on every call)."""
    def linear(x, packed, n, bias=None):
        return cpu_bf16_gemm.reference_bf16_linear(x, cpu_bf16_gemm.unpack(packed, n, x.shape[1]), bias)

    out = _reference_attention(linear, hidden, residual, positions, slots, block_tables, context_lens, input_norm,
                               post_norm, eps, qkv, qkv_bias, o, cos, sin, k_cache, v_cache, num_heads,
                               num_kv_heads, scale, window, softcap, q_norm, k_norm)
    size = hidden.shape[1]
    if router is not None:
        logits = linear(out, router, gate_up.shape[0])
        return cpu_moe.reference_moe_experts(out, logits, *cpu_moe.unpack(gate_up, down), top_k, renormalize)
    return linear(cpu_layer_ops.reference_silu_and_mul(linear(out, gate_up, 2 * intermediate)), down, size)


def decode_layer_q_(hidden, residual, positions, slots, block_tables, context_lens, input_norm, post_norm,
                    eps: float, kinds, weights, scales, zeros, group_sizes, int8_activations, qkv_bias,
                    intermediate: int, cos, sin, k_cache, v_cache, num_heads: int, num_kv_heads: int, scale: float,
                    window: int = 0, softcap: float = 0.0, q_norm=None, k_norm=None):
    """The native layer on a native GEMM per linear (see the module docstring)."""
    return torch.ops.kubellm_cpu.decode_layer_q_.default(hidden, residual, positions, slots, block_tables,
                                                        context_lens, input_norm, post_norm, eps, kinds, weights,
                                                        scales, zeros, group_sizes, int8_activations, qkv_bias,
                                                        intermediate, cos, sin, k_cache, v_cache, num_heads,
                                                        num_kv_heads, scale, window, softcap, q_norm, k_norm)


def reference_decode_layer_q_(hidden, residual, positions, slots, block_tables, context_lens, input_norm,
                              post_norm, eps: float, kinds, weights, scales, zeros, group_sizes, int8_activations,
                              qkv_bias, intermediate: int, cos, sin, k_cache, v_cache, num_heads: int,
                              num_kv_heads: int, scale: float, window: int = 0, softcap: float = 0.0, q_norm=None,
                              k_norm=None):
    """:func:`decode_layer_q_` from the references, each linear through its kernel's reference on its unpacked
    values (4-bit: ``reference_w4a8_gemm`` with int8 activations, else ``reference_int4_gemm``)."""
    def linear(x, i, n, bias=None):  # the i-th linear: 0 qkv, 1 o, 2 gate_up, 3 down
        w, s, z, group, kind = weights[i], scales[i], zeros[i], group_sizes[i], kinds[i]
        if kind == BF16:
            return cpu_bf16_gemm.reference_bf16_linear(x, cpu_bf16_gemm.unpack(w, n, x.shape[1]), bias)
        if kind == INT4:
            q = cpu_int4_gemm.unpack(w)
            assert q.shape[0] == n, (q.shape, n)
            gemm = cpu_int4_gemm.reference_w4a8_gemm if int8_activations[i] else cpu_int4_gemm.reference_int4_gemm
            return gemm(x, q, s.float(), z.float(), group, bias)
        if kind == FP8:  # decode rows: the kernel's widened bytes, the scale on the sums
            assert not cpu_fp8_gemm.rounds_weights(x.shape[0], x.shape[1], group)
            return cpu_fp8_gemm.reference_fp8_gemm(x, cpu_fp8_gemm.unpack(w, n), s, group, bias)
        if kind == GROUPED_INT8:
            assert x.shape[0] < cpu_grouped_int8_gemm.DEQUANTIZE_ROWS  # weights as stored, not rounded to bf16
            q = cpu_grouped_int8_gemm.unpack(w)[:n]
            return cpu_grouped_int8_gemm.reference_grouped_int8_gemm(x, q, s, z, group, bias)
        assert kind == INT8, kind
        q = w.permute(0, 2, 1, 3).reshape(-1, x.shape[1])  # cpu_int8_gemm.pack's layout back to [N, K]
        assert q.shape[0] == n, (q.shape, n)
        return cpu_int8_gemm.reference_int8_gemm(x, q, s, bias)

    out = _reference_attention(linear, hidden, residual, positions, slots, block_tables, context_lens, input_norm,
                               post_norm, eps, 0, qkv_bias, 1, cos, sin, k_cache, v_cache, num_heads, num_kv_heads,
                               scale, window, softcap, q_norm, k_norm)
    return linear(cpu_layer_ops.reference_silu_and_mul(linear(out, 2, 2 * intermediate)), 3, hidden.shape[1])


def _reference_attention(linear, hidden, residual, positions, slots, block_tables, context_lens, input_norm,
                         post_norm, eps, qkv, qkv_bias, o, cos, sin, k_cache, v_cache, num_heads, num_kv_heads, scale,
                         window, softcap, q_norm, k_norm):
    """The layer up to the MLP's input (``norm2(residual += o(attention))``), ``linear(x, qkv or o, n, bias)``
    running its GEMMs."""
    t, size = hidden.shape
    d = k_cache.shape[-1]
    q_size, kv_size = num_heads * d, num_kv_heads * d
    cpu_layer_ops.reference_add_rms_norm_(hidden, residual, input_norm, eps)
    q, k, v = linear(hidden, qkv, q_size + 2 * kv_size, qkv_bias).split([q_size, kv_size, kv_size], dim=-1)
    q, k, v = q.reshape(t, num_heads, d), k.reshape(t, num_kv_heads, d), v.reshape(t, num_kv_heads, d)
    if q_norm is not None:
        cpu_layer_ops.reference_qk_norm_rotary_(positions, q, k, q_norm, k_norm, eps, cos, sin)
    else:
        cpu_layer_ops.reference_rotary_embedding_(positions, q, k, cos, sin)
    k_cache.view(-1, num_kv_heads, d).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, d).index_copy_(0, slots, v)
    attn = reference_paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                            window=window or None, softcap=softcap or None)
    out = linear(attn.reshape(t, q_size), o, size)
    cpu_layer_ops.reference_add_rms_norm_(out, residual, post_norm, eps)
    return out
