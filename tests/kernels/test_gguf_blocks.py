"""GGUF blocks read into (values, scales, zeros) equal gguf.quants' own dequantization, and the kernels that
take each form compute with them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kubellm.kernels import cpu_grouped_int8_gemm, cpu_int4_gemm
from kubellm.runtime.quantization import gguf as gguf_blocks

# Where each type's block starts with fp16 fields (offset of each), so random bytes get finite, sane scales.
_F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random block bytes with random (some zero, some negative) fp16 scale fields: every bit pattern of the
    quantized values and sub-scales is a valid block."""
    per, nbytes = gguf_blocks.BLOCKS[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // per, nbytes), dtype=np.uint8)
    for off in _F16_FIELDS[type_name]:
        d = (rng.standard_normal((n, k // per)) * 0.01).astype(np.float16)
        d[rng.random(d.shape) < 0.1] = 0  # degenerate blocks: one value each (affine types) or all zero
        raw[..., off:off + 2] = d[..., None].view(np.uint8)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("type_name", list(gguf_blocks.BLOCKS))
@pytest.mark.parametrize(("n", "k"), [(3, 256), (17, 512)])
def test_forms_equal_gguf_dequantize(type_name, n, k):
    raw = _random_blocks(type_name, n, k, seed=n + k)
    form = gguf_blocks.unpack(type_name, torch.from_numpy(raw), k)
    expected = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[type_name]).reshape(n, k))
    assert form.values.shape == (n, k) and form.scales.shape == (n, k // form.group_size)
    assert form.values.dtype == (torch.uint8 if form.kernel == "int4" else torch.int8)
    if form.kernel == "int4":
        assert int(form.values.max()) <= 15
    torch.testing.assert_close(gguf_blocks.dequantize(form), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_forms_of_quantized_weights(type_name):
    """Through gguf's own quantizer (the types it can write): real weights, not random bytes."""
    w = np.random.default_rng(1).standard_normal((32, 128)).astype(np.float32) * 0.05
    raw = gguf_quantize(w, GGMLQuantizationType[type_name])
    form = gguf_blocks.unpack(type_name, torch.from_numpy(raw), 128)
    expected = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[type_name]))
    torch.testing.assert_close(gguf_blocks.dequantize(form), expected, rtol=1e-5, atol=1e-6)


def test_wrong_shapes_and_types_are_refused():
    with pytest.raises(ValueError, match="Q2_K has no packed form"):
        gguf_blocks.unpack("Q2_K", torch.zeros(2, 84, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match=r"expected \[N, 68\] uint8"):
        gguf_blocks.unpack("Q8_0", torch.zeros(2, 70, dtype=torch.uint8), 64)


@pytest.mark.parametrize("type_name", list(gguf_blocks.BLOCKS))
@pytest.mark.parametrize("m", [1, 5])
def test_the_kernel_of_each_form_matches_gguf(type_name, m, native_grouped_int8, native_int4):
    n, k = 48, 512
    raw = _random_blocks(type_name, n, k, seed=m)
    form = gguf_blocks.unpack(type_name, torch.from_numpy(raw), k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    scales = form.scales.t().contiguous()
    zeros = None if form.zeros is None else form.zeros.t().contiguous()
    if form.kernel == "int4":
        y = cpu_int4_gemm.int4_gemm(x, cpu_int4_gemm.pack(form.values), scales, zeros, form.group_size)
    else:
        y = cpu_grouped_int8_gemm.grouped_int8_gemm(x, cpu_grouped_int8_gemm.pack(form.values), scales, zeros,
                                                    form.group_size)
    w = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[type_name]).reshape(n, k))
    ref = x.float() @ w.T
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


@pytest.mark.parametrize("type_name", [t for t in gguf_blocks.BLOCKS if gguf_blocks.unpack(
    t, torch.from_numpy(_random_blocks(t, 1, 256)), 256).kernel == "int4"])
def test_int8_activations_on_each_4bit_form(type_name, native_int4_int8):
    """Q4_0 (z = 8), Q4_1 and Q4_K (float zeros, -min / d) through the int8-activation path: its reference."""
    n, k = 48, 512
    form = gguf_blocks.unpack(type_name, torch.from_numpy(_random_blocks(type_name, n, k, seed=3)), k)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    scales, zeros = form.scales.t().contiguous(), form.zeros.t().contiguous()
    y = cpu_int4_gemm.int4_gemm(x, cpu_int4_gemm.pack(form.values), scales, zeros, form.group_size,
                                int8_activations=True)
    ref = cpu_int4_gemm.reference_w4a8_gemm(x, form.values, scales.float(), zeros.float(), form.group_size)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=1e-3 * float(ref.abs().max()))
