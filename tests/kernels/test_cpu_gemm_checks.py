"""The native GEMMs' entry checks (kernels/csrc/gemm_checks.h): every GEMM refuses the same fault with the same
words, RuntimeError each time, before any kernel runs. Each GEMM is called through its op with one bad argument
and otherwise valid ones (K = 64, N = 32), in whichever build this host loaded."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

from kubellm.kernels import cpu_bf16_gemm as kb
from kubellm.kernels import cpu_fp8_gemm as f8
from kubellm.kernels import cpu_grouped_int8_gemm as g8
from kubellm.kernels import cpu_int4_gemm as k4
from kubellm.kernels import cpu_int8_gemm as k8

K, N, GROUP = 64, 32, 32
_g = torch.Generator().manual_seed(0)
X = torch.randn(3, K, generator=_g).to(torch.bfloat16)
BIAS = torch.randn(N, generator=_g)
SCALES = torch.rand(K // GROUP, N, generator=_g) + 0.5


def _packed(name: str) -> torch.Tensor:
    """A valid packed [N, K] weight for the GEMM `name`."""
    return {
        "int8": lambda: k8.pack(torch.randint(-128, 128, (N, K), generator=_g, dtype=torch.int8)),
        "int4": lambda: k4.pack(torch.randint(0, 16, (N, K), generator=_g, dtype=torch.uint8)),
        "fp8": lambda: f8.pack(torch.randn(N, K, generator=_g).to(torch.float8_e4m3fn)),
        "grouped_int8": lambda: g8.pack(torch.randint(-128, 128, (N, K), generator=_g, dtype=torch.int8)),
        "bf16": lambda: kb.pack(torch.randn(N, K, generator=_g)),
    }[name]()


def _int8(x=X, bias=BIAS, packed=None, group=None):
    packed = _packed("int8") if packed is None else packed
    return torch.ops.kubellm_cpu.int8_gemm(x, packed, torch.rand(N, generator=_g), bias)


def _int4(x=X, bias=BIAS, packed=None, group=GROUP):
    packed = _packed("int4") if packed is None else packed
    return torch.ops.kubellm_cpu.int4_gemm(x, packed, SCALES, torch.full_like(SCALES, 8.0), group, bias, True)


def _fp8(x=X, bias=BIAS, packed=None, group=GROUP):
    packed = _packed("fp8") if packed is None else packed
    return torch.ops.kubellm_cpu.fp8_gemm(x, packed, SCALES, group, bias)


def _grouped(x=X, bias=BIAS, packed=None, group=GROUP):
    packed = _packed("grouped_int8") if packed is None else packed
    return torch.ops.kubellm_cpu.grouped_int8_gemm(x, packed, SCALES, None, group, bias)


def _bf16(x=X, bias=BIAS, packed=None, group=None):
    packed = _packed("bf16") if packed is None else packed
    return torch.ops.kubellm_cpu.bf16_linear(x, packed, N, bias)


# name -> (call, the fixture that skips where this build lacks the GEMM)
GEMMS: dict[str, tuple[Callable[..., torch.Tensor], str]] = {
    "int8": (_int8, "native_int8"),
    "int4": (_int4, "native_int4_int8"),
    "fp8": (_fp8, "native_fp8"),
    "grouped_int8": (_grouped, "native_grouped_int8"),
    "bf16": (_bf16, "native_bf16_gemm"),
}
# These read x as bf16 pairs in place; bf16_linear pads a copy of x instead, so it takes any width and stride.
PAIRED = ["int8", "int4", "fp8", "grouped_int8"]


def _gemm(name: str, request: pytest.FixtureRequest) -> Callable[..., torch.Tensor]:
    call, fixture = GEMMS[name]
    request.getfixturevalue(fixture)
    return call


@pytest.mark.parametrize("name", list(GEMMS))
def test_valid_arguments_pass_the_checks(name, request):
    assert _gemm(name, request)().shape == (3, N)


@pytest.mark.parametrize("name", list(GEMMS))
def test_a_bias_that_is_not_n_float32_is_refused(name, request):
    call = _gemm(name, request)
    for bad in (BIAS.half(), BIAS[:-1], BIAS.view(N, 1)):
        with pytest.raises(RuntimeError, match=re.escape("bias must be [N] float32")):
            call(bias=bad)


@pytest.mark.parametrize("name", list(GEMMS))
def test_a_packed_weight_of_another_dtype_or_rank_is_refused(name, request):
    call = _gemm(name, request)
    good = _packed(name)
    bad = good.to(torch.float32 if good.dtype != torch.float32 else torch.bfloat16)
    with pytest.raises(RuntimeError, match="^packed must be a contiguous"):
        call(packed=bad)
    with pytest.raises(RuntimeError, match="^packed must be a contiguous"):
        call(packed=good.unsqueeze(0))


@pytest.mark.parametrize("name", PAIRED)
def test_x_of_another_width_is_refused_by_its_columns(name, request):
    with pytest.raises(RuntimeError, match=f"^x has {K - 8} columns, the weight {K}"):
        _gemm(name, request)(x=X[:, : K - 8].contiguous())


@pytest.mark.parametrize("name", PAIRED)
def test_x_rows_with_an_odd_stride_are_refused(name, request):
    odd = torch.zeros(3, K + 1, dtype=torch.bfloat16)[:, :K]
    with pytest.raises(RuntimeError, match=re.escape("x's row stride must be even (bf16 pairs)")):
        _gemm(name, request)(x=odd)


@pytest.mark.parametrize("name", PAIRED)
def test_x_of_float16_is_refused_by_dtype(name, request):
    with pytest.raises(RuntimeError, match=r"^x must be \[M, K\] bfloat16"):
        _gemm(name, request)(x=X.half())


@pytest.mark.parametrize(("name", "group", "message"), [
    ("int4", 6, "group_size (6) must be a multiple of 4 and divide K (64)"),
    ("int4", 48, "group_size (48) must be a multiple of 4 and divide K (64)"),
    ("grouped_int8", 3, "group_size (3) must be a multiple of 2 and divide K (64)"),
    ("fp8", 6, "group_size (6) must be a multiple of 4"),
])  # fmt: skip
def test_group_sizes_the_packed_steps_cannot_hold_are_refused(name, group, message, request):
    with pytest.raises(RuntimeError, match="^" + re.escape(message)):
        _gemm(name, request)(group=group)


def test_fp8_takes_a_ragged_last_group(request):
    """FP8 block scales cover K in groups that need not divide it (ceil(K/group) rows of scales)."""
    request.getfixturevalue("native_fp8")
    packed = f8.pack(torch.randn(N, K, generator=_g).to(torch.float8_e4m3fn))
    scales = torch.rand(2, N, generator=_g) + 0.5  # groups of 48: 48 + 16
    assert torch.ops.kubellm_cpu.fp8_gemm(X, packed, scales, 48, None).shape == (3, N)
