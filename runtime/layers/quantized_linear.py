"""A linear layer that computes from weights quantized elsewhere (AWQ, GPTQ, compressed-tensors, FP8, GGUF).

It takes the one form every format's reader returns (runtime/layers/quantized_weight.py's :class:`QuantizedWeight`:
values ``[out, in]``, scales and zero points per (output, group of inputs), an optional input → group map)
and keeps it in what its GEMM reads, chosen per layer (``KernelChoice.grouped_path``):

* ``native`` 4-bit: ``kernels/cpu_int4_gemm.py`` (values 0..15 packed by its ``pack``; zeros always given:
  signed formats are shifted by 8, values and zeros alike, which leaves ``values - zeros`` unchanged), with
  ``int8_activations`` (``--cpu-int4-activations int8``) quantizing ``x`` to int8 in the kernel. bfloat16
  activations; float32 too in AVX2 builds (int8 activations only there), as for the 5..8-bit kernel.
* ``native`` 5..8-bit: ``kernels/cpu_grouped_int8_gemm.py`` (int8 values; unsigned 0..255 formats are
  shifted by -128, values and zeros alike).
* ``native`` FP8: ``kernels/cpu_fp8_gemm.py`` (the e4m3 bytes packed by its ``pack``; per-channel scales, or
  per (output, group of inputs) for block scales, the last group possibly shorter).
* ``dequantize``: values kept compact (two 4-bit values per byte, else one per byte; FP8 as e4m3), the
  ``[out, in]`` weight rebuilt in the activation dtype on every call. Correct on every device and dtype;
  the memory saving holds, the speed-up does not (what runs where the native kernels do not load or do not take
  the activations' dtype).

* ``triton`` (CUDA, once its start-up check passed): 4 and 8 bits through ``kernels/triton_grouped_gemm.py``, in
  its own packed layout (GPTQ-style int32 words, act-order sorted by its ``pack``); FP8 through
  ``kernels/triton_fp8_gemm.py`` on the e4m3 bytes and scales as stored (per channel, or per group of a power
  of two from 16 inputs: :func:`fp8_triton_packable`; other FP8 layers dequantize).

Scales and zero points are kept in float16 where that holds them exactly (GGUF's d, fp16 checkpoint scales,
integer zero points), else float32; the kernels widen them per tile. Other kernels plug in as entries of
:data:`GEMMS` (``path -> fn(layer, x_rows) -> y_rows``, named by the kernel choice).

:meth:`QuantizedLinear.rows` dequantizes a few rows: a GGUF token embedding stays packed in one of these layers
(runtime/layers/quantized_embedding.py), which then also serves as the tied LM head.

Act-order (GPTQ ``desc_act``, compressed-tensors ``actorder: group``): the inputs of a group are scattered.
When every group has ``group_size`` members, the layer sorts the weight's input columns by group once at
load and gathers ``x``'s columns into that order on every call (``x[:, perm]``), so the GEMM sees contiguous
groups; otherwise it keeps ``g_idx`` and dequantizes per call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kubellm.kernels import cpu_decode_layer, cpu_fp8_gemm, cpu_grouped_int8_gemm, cpu_int4_gemm
from kubellm.runtime.layers.quantized_weight import QuantizedWeight

PATHS = ("native", "triton", "dequantize")
# AVX2 builds quantize a 4-bit layer's activations to int8 only for steps of at most this many rows (decode):
# a prompt's logits, where the first token is chosen, stay exact. There int8 buys ~25x at one row but only
# 1.0-1.2x over the float GEMM at 256 rows, and on SmolLM2's demo prompt int8 prefill flipped a 0.08-nat tie
# and the answer with it. AVX-512 builds (VNNI, twice the rate) keep int8 at every row count.
AVX2_INT8_MAX_ROWS = 32


class QuantizedLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` with ``W = (values - zeros) * scales`` per group; ``bits`` of each value
    (4, 5..8; 8 for FP8). Buffers only: loaders and ``load_state_dict`` never see it as an ``nn.Linear``."""

    def __init__(self, weight: QuantizedWeight, bits: int, path: str = "dequantize",
                 bias: torch.Tensor | None = None, int8_activations: bool = False):
        super().__init__()
        self.int8_activations = int8_activations  # the native 4-bit GEMM's activations
        if path not in PATHS and path not in GEMMS:
            raise ValueError(f"quantized GEMM path {path!r}; use one of {', '.join((*PATHS, *GEMMS))}")
        self.out_features, self.in_features = weight.values.shape
        if path == "triton" and not weight.values.is_floating_point():
            self._pack_for_triton(weight, bits, bias)
            return
        self.bits = bits
        self.float_values = weight.values.is_floating_point()  # FP8
        self.group_size = self.in_features if weight.group_size <= 0 else weight.group_size
        values, scales, zeros, g_idx = weight.values, weight.scales.float(), weight.zeros, weight.g_idx
        zeros = None if zeros is None else zeros.float()
        perm = None
        if g_idx is not None:
            perm = contiguous_order(g_idx, self.group_size)
            if perm is None:
                path = "dequantize"  # groups of unequal sizes: only the general g_idx gather serves them
            else:
                values, g_idx = values[:, perm], None
                if torch.equal(perm, torch.arange(perm.numel(), device=perm.device)):
                    perm = None  # already in order
        self.register_buffer("perm", perm)
        self.register_buffer("g_idx", None if g_idx is None else g_idx.long())
        if not self.float_values:
            values, zeros = _kernel_range(values, zeros, scales, bits)
        if path == "native" and not (cpu_fp8_gemm.packable(self.in_features, self.group_size) if self.float_values
                                     else self.in_features % self.group_size == 0):
            path = "dequantize"
        if path == "native" and bits == 4 and not self.float_values and not int8_activations \
                and not cpu_int4_gemm.available():
            path = "dequantize"  # bf16 activations: AVX512-BF16 builds only (AVX2 builds take int8 ones)
        if path == "triton" and self.float_values and not fp8_triton_packable(self.in_features, weight.group_size):
            path = "dequantize"
        self.path = path
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())
        if path == "native" and bits == 4 and zeros is None:
            zeros = torch.zeros_like(scales)
        scales, zeros = _narrow(scales), None if zeros is None else _narrow(zeros)
        # the activations the native kernel takes: bfloat16, and float32 in AVX2 builds (not FP8)
        takes_float32 = path == "native" and not self.float_values and (
            cpu_int4_gemm.takes_float32() if bits == 4 else cpu_grouped_int8_gemm.takes_float32())
        self.native_dtypes = (torch.bfloat16, torch.float32) if takes_float32 else (torch.bfloat16,)
        # steps above this many rows dequantize instead (AVX2 builds' int8 activations: AVX2_INT8_MAX_ROWS)
        self.native_max_rows = AVX2_INT8_MAX_ROWS if takes_float32 and bits == 4 and int8_activations else None
        if path == "native":
            pack = cpu_fp8_gemm.pack if self.float_values else cpu_int4_gemm.pack if bits == 4 else \
                cpu_grouped_int8_gemm.pack
            self.register_buffer("qweight", pack(values))
            self.register_buffer("scales", scales.t().contiguous())  # [groups, out]: the kernels' order
            self.register_buffer("zeros", None if zeros is None else zeros.t().contiguous())
        else:
            packed = bits == 4 and not self.float_values and self.in_features % 2 == 0
            self.nibbles = packed
            self.register_buffer("qweight", _pack_nibbles(values) if packed else values.contiguous())
            self.register_buffer("scales", scales.contiguous())  # [out, groups]
            self.register_buffer("zeros", None if zeros is None else zeros.contiguous())

    def _pack_for_triton(self, weight: QuantizedWeight, bits: int, bias: torch.Tensor | None) -> None:
        """CUDA: ``kernels/triton_grouped_gemm.py``'s layout (it sorts act-order inputs and gathers x itself)."""
        from kubellm.kernels import triton_grouped_gemm

        self.bits, self.path, self.float_values, self.nibbles = bits, "triton", False, False
        packed = triton_grouped_gemm.pack(weight, 4 if bits == 4 else 8)
        self.group_size = packed.group
        self.register_buffer("qweight", packed.packed)
        self.register_buffer("scales", packed.scales)  # [groups, out]
        self.register_buffer("zeros", packed.zeros)
        self.register_buffer("triton_perm", packed.perm)
        self.register_buffer("perm", None)
        self.register_buffer("g_idx", None)
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.path == "triton" and self.float_values:
            from kubellm.kernels import triton_fp8_gemm

            # Per-channel scales as they are; groups along the inputs as blocks of one row by group_size inputs.
            block = None if self.scales.shape[1] == 1 else (1, self.group_size)
            out = triton_fp8_gemm.fp8_gemm(rows, self.qweight, self.scales, self.bias, block)
            return out.view(*x.shape[:-1], self.out_features)
        if self.path == "triton":
            from kubellm.kernels import triton_grouped_gemm

            out = triton_grouped_gemm.grouped_gemm(rows, self.qweight, self.scales, self.zeros, self.triton_perm,
                                                   self.bias, self.group_size, 4 if self.bits == 4 else 8)
            return out.view(*x.shape[:-1], self.out_features)
        if self.perm is not None:
            rows = rows.index_select(1, self.perm)
        if self.path == "native" and rows.dtype in self.native_dtypes and (
                self.native_max_rows is None or rows.shape[0] <= self.native_max_rows):
            rows = rows if rows.stride(-1) == 1 else rows.contiguous()
            if self.float_values:
                out = cpu_fp8_gemm.fp8_gemm(rows, self.qweight, self.scales, self.group_size, self.bias)
            elif self.bits == 4:
                out = cpu_int4_gemm.int4_gemm(rows, self.qweight, self.scales, self.zeros, self.group_size, self.bias,
                                              self.int8_activations)
            else:
                out = cpu_grouped_int8_gemm.grouped_int8_gemm(rows, self.qweight, self.scales, self.zeros,
                                                              self.group_size, self.bias)
        elif self.path in GEMMS:
            out = GEMMS[self.path](self, rows)
        else:
            out = nn.functional.linear(rows, self.dequantized(rows.dtype),
                                       None if self.bias is None else self.bias.to(rows.dtype))
        return out.view(*x.shape[:-1], self.out_features)

    def fused_decode_linear(self) -> tuple | None:
        """This layer's arguments of the fused decode layer (runtime/layers/fused_decode.py): ``(kind, qweight,
        scales, zeros, group_size, int8_activations, bias)``, exactly what :meth:`forward` hands its native kernel
        on bfloat16 rows (``cpu_int4_gemm.int4_gemm``, ``cpu_fp8_gemm.fp8_gemm``,
        ``cpu_grouped_int8_gemm.grouped_int8_gemm``), or None off the native path or with an act-order gather."""
        if self.path != "native" or self.perm is not None or self.g_idx is not None:
            return None
        if self.float_values:
            return cpu_decode_layer.FP8, self.qweight, self.scales, None, self.group_size, False, self.bias
        if self.bits == 4:
            return (cpu_decode_layer.INT4, self.qweight, self.scales, self.zeros, self.group_size,
                    self.int8_activations, self.bias)
        return cpu_decode_layer.GROUPED_INT8, self.qweight, self.scales, self.zeros, self.group_size, False, self.bias

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[out, in]`` weight in the layer's own input order (after the act-order sort, if any)."""
        values = self.values().float()
        scales = self.scales if self.path != "native" else self.scales.t()
        zeros = self.zeros if self.path != "native" or self.zeros is None else self.zeros.t()
        if self.g_idx is not None or self.in_features % self.group_size:
            g = self.g_idx if self.g_idx is not None else torch.arange(self.in_features,
                                                                       device=values.device) // self.group_size
            w = values if zeros is None else values - zeros[:, g]
            return (w * scales[:, g]).to(dtype)
        return _dequantize_groups(values, scales, zeros, self.group_size).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` (any shape) of the dequantized weight, ``[*ids.shape, in]``: an embedding lookup from
        the packed table, which dequantizes only the rows it reads."""
        if self.path == "triton" or self.g_idx is not None or self.perm is not None or \
                self.in_features % self.group_size:
            raise ValueError("row lookup needs contiguous groups in input order (no act-order), off the Triton path")
        flat = ids.reshape(-1)
        q = self.qweight
        if self.path == "native" and self.float_values:
            q, scales, zeros = self.values()[flat], self.scales[:, flat].t(), None
        elif self.path == "native":
            q = q[flat // 16, :, flat % 16, :]  # [T, K/4, 2] bytes (4-bit) or [T, K/2, 2] int8
            if self.bits == 4:  # low nibbles are inputs k + j, high nibbles k + 2 + j (see values())
                q = torch.stack([q & 0xF, q >> 4], dim=-2)
            scales, zeros = self.scales[:, flat].t(), None if self.zeros is None else self.zeros[:, flat].t()
        else:
            q = _unpack_nibbles(q[flat]) if self.nibbles else q[flat]
            scales, zeros = self.scales[flat], None if self.zeros is None else self.zeros[flat]
        w = _dequantize_groups(q.reshape(flat.numel(), self.in_features).float(), scales, zeros, self.group_size)
        return w.to(dtype).view(*ids.shape, self.in_features)

    def values(self) -> torch.Tensor:
        """``[out, in]`` values as the GEMM sees them (int4: 0..15; 8-bit: int8; FP8: e4m3)."""
        q = self.qweight
        if self.path == "native":
            n = self.out_features
            if self.float_values:
                return cpu_fp8_gemm.unpack(q, n)
            if self.bits == 4:
                return cpu_int4_gemm.unpack(q)[:n]
            return cpu_grouped_int8_gemm.unpack(q)[:n]
        return _unpack_nibbles(q) if self.nibbles else q

    def weight_bytes(self) -> dict[str, int]:
        """Bytes held per dtype name (the load log's accounting)."""
        out: dict[str, int] = {}
        for key, b in self.named_buffers():
            if key in ("perm", "g_idx", "triton_perm"):
                name = "index"
            elif b is self.qweight:
                name = f"int{self.bits}" if not self.float_values else "float8_e4m3fn"
            else:
                name = str(b.dtype).removeprefix("torch.")
            out[name] = out.get(name, 0) + b.numel() * b.element_size()
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, path={self.path}, act_order={self.perm is not None}")


# path -> GEMM(layer, x_rows [M, in] in the layer's input order) -> [M, out]; a CUDA kernel registers here.
GEMMS: dict[str, Callable[[QuantizedLinear, torch.Tensor], torch.Tensor]] = {}


def fp8_triton_packable(in_features: int, group_size: int) -> bool:
    """Whether ``kernels/triton_fp8_gemm.py`` takes FP8 scales per (output, ``group_size`` inputs): per channel
    (``group_size`` -1 or ``in_features``), or groups that are powers of two from 16 (its K tiles)."""
    return group_size <= 0 or group_size >= in_features or group_size >= 16 and group_size & (group_size - 1) == 0


def contiguous_order(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The input order that makes act-order groups contiguous (a stable sort by group), or None when the
    groups do not each hold ``group_size`` inputs (the last one may hold fewer), which a sort cannot fix."""
    g = g_idx.long()
    counts = torch.bincount(g)
    if counts.numel() > 1 and not bool((counts[:-1] == group_size).all()) or int(counts[-1]) > group_size:
        return None
    return torch.argsort(g, stable=True)


def _kernel_range(values: torch.Tensor, zeros: torch.Tensor | None, scales: torch.Tensor, bits: int
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shift values (and zeros by the same amount) into the kernels' ranges: 4-bit 0..15, 5..8-bit int8."""
    lo, hi = int(values.min()), int(values.max())
    if bits == 4:
        shift = 8 if lo < 0 else 0
        if lo + shift < 0 or hi + shift > 15:
            raise ValueError(f"4-bit values must lie in 0..15 or -8..7, got {lo}..{hi}")
        target = torch.uint8
    else:
        shift = -128 if hi > 127 else 0
        if lo + shift < -128 or hi + shift > 127:
            raise ValueError(f"{bits}-bit values must lie in -128..127 or 0..255, got {lo}..{hi}")
        target = torch.int8
    if shift:
        values = values.to(torch.int16) + shift
        zeros = (zeros if zeros is not None else torch.zeros_like(scales)) + shift
    return values.to(target), zeros


def _dequantize_groups(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int
                       ) -> torch.Tensor:
    """``(values - zeros) * scales`` in float32 for float ``values`` ``[n, in]`` with contiguous groups of
    ``group_size`` inputs (``scales``, ``zeros`` ``[n, in / group_size]``)."""
    n, k = values.shape
    w = values.view(n, k // group_size, group_size)
    if zeros is not None:
        w = w - zeros.float().unsqueeze(-1)
    return (w * scales.float().unsqueeze(-1)).view(n, k)


def _narrow(t: torch.Tensor) -> torch.Tensor:
    """float16 when that holds every value exactly (GGUF's d, AWQ/GPTQ fp16 scales, integer zero points): half
    the bytes of float32 at no cost in accuracy; the kernels widen per tile. Else float32, as given."""
    half = t.to(torch.float16)
    return half if torch.equal(half.float(), t) else t


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` integers in ``[-8, 7]`` or ``0..15`` (K even; their low four bits) → ``[N, K/2]`` uint8: input
    ``2j`` in the low nibble of byte ``j``, ``2j + 1`` in its high one (the dequantize path's compact form)."""
    q = q.to(torch.int16)
    return ((q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)).to(torch.uint8)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """:func:`_pack_nibbles`' bytes back to unsigned 0..15."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
