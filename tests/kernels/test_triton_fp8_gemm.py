"""kernels/triton_fp8_gemm.py (the CUDA GEMM of FP8 checkpoints) through Triton's interpreter on tiny shapes:
the in-kernel e4m3 decode bit for bit against ``torch.float8_e4m3fn`` over all 256 codes, and the GEMM against
``x @ dequantize_fp8(...).T`` (runtime/quantization/fp8.py) for per-tensor, per-channel and block scales, with
bias, partial tiles and a partial last scale block; a transposed block-scale grid fails the same comparison.

Tolerances: float32 activations 1e-4 absolute + 1e-5 relative (accumulation order); bf16 and fp16 outputs
1e-2 + 2^-7 relative (their own rounding; the reference stays float32 on the same rounded inputs).
"""

from __future__ import annotations

import pytest
import torch

from kubellm.kernels import triton_check
from kubellm.kernels import triton_fp8_gemm as tf
from kubellm.runtime.quantization.fp8 import dequantize_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 2**-7},
       torch.float16: {"atol": 1e-2, "rtol": 2**-7}}
FINITE = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254 codes


def test_the_kernels_e4m3_decode_equals_torch_on_all_256_codes():
    """Normals, subnormals (exponent 0: mantissa x 2^-9), +-0 (sign kept), +-448 and NaN at 0x7F/0xFF."""
    codes = torch.arange(256, dtype=torch.uint8)
    out = tf.decode_e4m3(codes.to(DEVICE)).cpu()
    ref = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(out.isnan(), ref.isnan()) and ref.isnan().sum() == 2
    finite = ~ref.isnan()
    assert torch.equal(out[finite].view(torch.int32), ref[finite].view(torch.int32))  # bit for bit, -0 included
    assert out[0x7E] == 448 and out[0x01] == 2**-9 and out[0x80].item() == 0 and out[0x80].signbit()


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Every finite e4m3 code, shuffled: subnormals, +-448 and zeros all in the product."""
    gen = torch.Generator().manual_seed(seed)
    codes = FINITE[torch.randint(0, FINITE.numel(), (n, k), generator=gen)]
    return codes.view(torch.float8_e4m3fn)


def _scale(kind: str, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, tuple[int, int] | None]:
    if kind == "tensor":
        return torch.tensor([0.003]), None
    if kind == "channel":
        return torch.rand(n, 1, generator=gen) / 100, None
    block = (128, 128) if kind == "block128" else (16, 32)
    return torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) / 100, block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["tensor", "channel", "block128", "block16x32"])
def test_kernel_equals_the_dequantized_weight_for_each_scale_layout(kind, dtype):
    """N 136 / 40 and K 160 / 200: not multiples of the 128x128 or 16x32 scale blocks (partial last blocks) nor
    of the tiles; M 3 and 17 (a partial second row tile)."""
    for i, (m, n, k) in enumerate([(3, 136, 160), (17, 40, 200)]):
        gen = torch.Generator().manual_seed(i)
        weight = _weight(n, k, seed=i)
        scale, block = _scale(kind, n, k, gen)
        x = torch.randn(m, k, generator=gen).to(dtype)
        bias = torch.randn(n, generator=gen) if i else None
        on = [None if t is None else t.to(DEVICE) for t in (x, weight, scale, bias)]
        out = tf.fp8_gemm(*on, block, block_n=32).cpu()
        expected = x.float() @ dequantize_fp8(weight, scale, block).T
        expected = expected if bias is None else expected + bias
        torch.testing.assert_close(out.float(), expected, **TOL[dtype])
        torch.testing.assert_close(out.float(), tf.reference_fp8_gemm(x, weight, scale, bias, block).float(),
                                   **TOL[dtype])


@pytest.mark.parametrize("kind", ["tensor", "channel", "block16x32"])
def test_the_gemv_form_equals_the_dequantized_weight_at_one_three_and_seventeen_rows(kind):
    """Tiling dot=False (broadcast multiply and sum over K, row tiles of 1-8): the same product as tl.dot's."""
    n, k = 40, 200
    gen = torch.Generator().manual_seed(21)
    weight = _weight(n, k, seed=22)
    scale, block = _scale(kind, n, k, gen)
    for m in (1, 3, 17):
        x, bias = torch.randn(m, k, generator=gen).to(torch.bfloat16), torch.randn(n, generator=gen)
        on = [t.to(DEVICE) for t in (x, weight, scale, bias)]
        out = tf.fp8_gemm(*on, block, block_n=16, dot=False).cpu()
        expected = x.float() @ dequantize_fp8(weight, scale, block).T + bias
        torch.testing.assert_close(out.float(), expected, **TOL[torch.bfloat16])


def test_per_channel_scales_as_a_vector_and_uint8_bytes_and_strided_rows_give_the_same_product():
    gen = torch.Generator().manual_seed(3)
    weight, scale = _weight(24, 64, seed=3), torch.rand(24, generator=gen)
    wide = torch.randn(2, 96, generator=gen)
    x = wide[:, 8:72]  # rows strided by 96
    expected = x @ dequantize_fp8(weight, scale).T
    for w, s in ((weight, scale), (weight.view(torch.uint8), scale.view(24, 1))):
        torch.testing.assert_close(tf.fp8_gemm(x.to(DEVICE), w.to(DEVICE), s.to(DEVICE)).cpu(), expected,
                                   **TOL[torch.float32])


def test_a_transposed_block_scale_grid_fails_the_comparison():
    gen = torch.Generator().manual_seed(4)
    weight, scale = _weight(64, 64, seed=4), torch.rand(2, 2, generator=gen) + 0.5
    x = torch.randn(3, 64, generator=gen)
    expected = x @ dequantize_fp8(weight, scale, (32, 32)).T
    torch.testing.assert_close(tf.fp8_gemm(x, weight, scale, None, (32, 32)), expected, **TOL[torch.float32])
    with pytest.raises(AssertionError):
        torch.testing.assert_close(tf.fp8_gemm(x, weight, scale.t(), None, (32, 32)), expected, **TOL[torch.float32])


def test_bad_scales_and_weights_are_refused_with_the_reason():
    weight = _weight(24, 64, seed=0)
    x = torch.zeros(1, 64)
    with pytest.raises(ValueError, match=r"one element, \[24\] or \[24, 1\].*got \[12\]"):
        tf.fp8_gemm(x, weight, torch.ones(12))
    with pytest.raises(ValueError, match=r"block scales for a \[24, 64\] weight in 16x32 blocks must be \[2, 2\]"):
        tf.fp8_gemm(x, weight, torch.ones(2, 3), None, (16, 32))
    with pytest.raises(ValueError, match="weight must be float8_e4m3fn"):
        tf.fp8_gemm(x, weight.float(), torch.ones(1))
    with pytest.raises(ValueError, match="x has 32 columns, the weight 64"):
        tf.fp8_gemm(torch.zeros(1, 32), weight, torch.ones(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_start_up_check_passes_the_sound_kernel_and_names_a_broken_one(dtype, monkeypatch):
    assert triton_check.check_fp8_gemm(DEVICE, dtype) is None
    sound = tf.fp8_gemm
    monkeypatch.setattr(tf, "fp8_gemm", lambda *a, **k: sound(*a, **k) * 1.05)
    assert "FP8 GEMM (per tensor) differs from its reference" in triton_check.check_fp8_gemm(DEVICE, dtype)
