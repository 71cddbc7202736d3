"""Linear layers whose weights are packed once for a CPU GEMM: kubellm's own bf16 kernel or oneDNN's.

:class:`NativeLinear` (bfloat16; CPUs with AVX512-BF16, or AVX2 + FMA, which widen the same layout in registers)
holds the weight in the vdpbf16ps operand layout of kernels/cpu_bf16_gemm.py: on AVX512-BF16 it streams the
weight at 1-8 rows (a decode step) closer to the read bandwidth than oneDNN and tiles more rows in registers,
faster than oneDNN's prepacked GEMM at the SmolLM2-135M and Qwen3-0.6B shapes from 1 to 1024 rows
(benchmarks/README.md, "bf16 linear"). A tied LM head's embedding then reads its rows from the same packed
weight, so the table is held once.

:class:`PackedLinear` (float32, and bfloat16 where oneDNN can: AVX-512 BW/VL/DQ or AVX-NE-CONVERT at run time):
``F.linear`` hands oneDNN (bfloat16) or MKL (float32) a plain weight on every call; oneDNN then reorders it
inside each GEMM. Prepacking once (``torch.ops.mkldnn._reorder_linear_weight``, what PyTorch's own inductor
freezing pass uses) measured on 2 cores with SmolLM2's shapes: bfloat16 decode GEMMs (32 rows) ~20% faster
and single rows 2x; float32 2.2-2.5x at every batch size. Results are the same GEMM up to float32
summation order.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from kubellm.kernels import cpu_bf16_gemm, cpu_decode_layer, cpu_extension

log = logging.getLogger("kubellm.linear")

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
_BATCH_HINT = 32  # the row count the packed layout is tuned for; any row count works

# oneDNN builds, and keeps (up to 1,024 per process), one JIT primitive per distinct row count: ~0.5 MiB and
# ~15 ms each at SmolLM2's shapes. Continuous batching changes the row count nearly every step, so a server's
# memory grew by ~100 KB per request. Rows are padded up to one of these counts (exact up to 8, then at most a
# quarter more rows) and longer inputs run in chunks of the largest, so each weight shape has at most
# len(ROW_BUCKETS) primitives (~14 MiB).
ROW_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128,
               160, 192, 224, 256)


def row_bucket(rows: int) -> int:
    """The padded row count of a GEMM over ``rows`` rows (1 <= rows <= ROW_BUCKETS[-1])."""
    return next(b for b in ROW_BUCKETS if b >= rows)


class PackedLinear(nn.Module):
    """Drop-in for an ``nn.Linear`` on CPU; holds only the packed weight (and the bias)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _BATCH_HINT)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        chunk = ROW_BUCKETS[-1]
        if rows.shape[0] <= chunk:
            out = self._gemm(rows)
        else:
            out = torch.cat([self._gemm(rows[i:i + chunk]) for i in range(0, rows.shape[0], chunk)])
        return out.view(*x.shape[:-1], self.out_features)

    def _gemm(self, rows: torch.Tensor) -> torch.Tensor:
        count = rows.shape[0]
        padded = row_bucket(count) if count else 0
        if padded != count:
            rows = torch.cat([rows, rows.new_zeros(padded - count, self.in_features)])
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self.packed_weight, self.bias, "none", [], "")
        return out[:count]


class NativeLinear(nn.Module):
    """Drop-in for a bfloat16 ``nn.Linear`` on CPU; holds only the packed weight (and the bias, in float32)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.packed_weight = cpu_bf16_gemm.pack(linear.weight.detach())
            self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = cpu_bf16_gemm.bf16_linear(x.reshape(-1, self.in_features), self.packed_weight, self.out_features,
                                        self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def fused_decode_linear(self) -> tuple:
        """This layer's arguments of the fused decode layer (runtime/layers/fused_decode.py)."""
        return cpu_decode_layer.BF16, self.packed_weight, None, None, 0, False, self.bias


def can_pack(device: str | torch.device, dtype: torch.dtype) -> bool:
    return prepack_unavailable(device, dtype) is None


def prepack_unavailable(device: str | torch.device, dtype: torch.dtype) -> str | None:
    """Why oneDNN cannot prepack ``dtype`` weights on ``device`` here, or None when it can."""
    name = str(dtype).removeprefix("torch.")
    if torch.device(device).type != "cpu" or dtype not in PACKABLE_DTYPES:
        return f"oneDNN prepacks float32 and bfloat16 weights on CPU (got {name} on {str(device)!r})"
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN"
    if dtype == torch.bfloat16 and (cap := cpu_extension.isa_cap()) and cap not in ("x86-64-v4", "x86-64-v4-bf16"):
        return (f"{cpu_extension.ISA_ENV}={cap} caps this CPU below AVX-512, which oneDNN's bf16 prepacked "
                "linear needs (or AVX-NE-CONVERT)")
    return _onednn_prepack_check(dtype)


@functools.cache
def _onednn_prepack_check(dtype: torch.dtype) -> str | None:
    """Pack and run a small layer once: oneDNN's bf16 reorder exists in every build but needs AVX-512 BW/VL/DQ
    or AVX-NE-CONVERT at run time (a RuntimeError on AVX2-only CPUs), which no flag torch exposes tells."""
    g = torch.Generator().manual_seed(0)  # not the global one: a probe must not shift seeded runs
    linear = nn.Linear(32, 16, device="meta")
    linear.weight = nn.Parameter(torch.randn(16, 32, generator=g).to(dtype), requires_grad=False)
    linear.bias = nn.Parameter(torch.randn(16, generator=g).to(dtype), requires_grad=False)
    x = torch.randn(3, 32, generator=g).to(dtype)
    try:
        with torch.no_grad():
            got, expected = PackedLinear(linear)(x).float(), linear(x).float()
    except (AttributeError, RuntimeError) as e:
        return f"oneDNN cannot prepack {str(dtype).removeprefix('torch.')} weights on this CPU: {e}"
    if not torch.allclose(got, expected, rtol=2e-2, atol=5e-2):
        return f"oneDNN's prepacked {str(dtype).removeprefix('torch.')} linear disagrees with F.linear here"
    return None


def pack_linears(model: nn.Module, kind: str = "onednn") -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`NativeLinear` (``kind`` "native": bfloat16 weights
    only) or a :class:`PackedLinear` ("onednn"); returns how many were replaced.

    With "native", an embedding tied to a replaced layer (one parameter, as SmolLM2's and Qwen3-0.6B's LM heads)
    that looks rows up through ``lookup`` (VocabParallelEmbedding) then reads them from the packed weight and
    drops its own: one copy of the table. (oneDNN's layout is opaque, so there the embedding keeps its weight.)"""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not targets:
        return 0
    weight = targets[0][1].weight
    if kind == "native":
        if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
            return 0
        layer_cls = NativeLinear
    elif kind == "onednn":
        if not can_pack(weight.device, weight.dtype):
            return 0
        layer_cls = PackedLinear
    else:
        raise ValueError(f"pack kind {kind!r}: native or onednn")
    tied = {id(m.weight): m for m in model.modules() if isinstance(m, nn.Embedding) and hasattr(m, "lookup")}
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        packed = layer_cls(linear)
        setattr(parent, attr, packed)
        if kind == "native" and (embedding := tied.get(id(linear.weight))) is not None:
            embedding.lookup = functools.partial(cpu_bf16_gemm.embedding, packed.packed_weight, k=packed.in_features)
            del embedding.weight
    return len(targets)
