"""runtime/layers/quantized_embedding.py: an embedding lookup from a packed table (QuantizedLinear.rows) reads
exactly the rows of the table's dequantized weight, on each path's storage layout."""

from __future__ import annotations

import pytest
import torch

from kubellm.runtime.layers.quantized_embedding import QuantizedEmbedding
from kubellm.runtime.layers.quantized_linear import QuantizedLinear
from kubellm.runtime.layers.quantized_weight import QuantizedWeight


def _table(bits: int, path: str, n: int = 40, k: int = 64, group: int = 32) -> QuantizedLinear:
    gen = torch.Generator().manual_seed(bits)
    if bits == 4:
        values, zeros = torch.randint(0, 16, (n, k), generator=gen), torch.rand(n, k // group, generator=gen) * 15
    else:  # GGUF Q8_0: signed values, no zero points
        values, zeros = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8), None
    scales = torch.rand(n, k // group, generator=gen) / 50
    return QuantizedLinear(QuantizedWeight(values, scales, zeros, group), bits, path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("path", ["dequantize", "native"])
def test_a_lookup_reads_the_rows_of_the_dequantized_table(path, bits, dtype, request):
    """Native layouts interleave 16 channels per block (40 rows: a padded last block for 8-bit); ids of any
    shape, repeated, first and last."""
    if path == "native":
        request.getfixturevalue("native_int4" if bits == 4 else "native_grouped_int8")
    n = 48 if bits == 4 and path == "native" else 40  # the int4 kernel packs whole blocks of 16 channels
    table = _table(bits, path, n=n)
    assert table.path == path
    ids = torch.tensor([[0, 5, n - 1], [17, 17, 2]])
    out = QuantizedEmbedding(table, dtype)(ids)
    assert out.shape == (2, 3, 64) and out.dtype == dtype
    assert torch.equal(out, table.dequantized(torch.float32)[ids].to(dtype))
    assert not torch.equal(out[0, 0], out[0, 1])  # distinct rows: a mixed-up layout would show


def test_a_table_in_act_order_is_refused_for_lookups():
    gen = torch.Generator().manual_seed(0)
    g_idx = (torch.randperm(64, generator=gen) // 32).to(torch.int32)
    table = QuantizedLinear(QuantizedWeight(torch.randint(0, 16, (16, 64), generator=gen), torch.rand(16, 2),
                                            None, 32, g_idx), 4, "dequantize")
    with pytest.raises(ValueError, match="row lookup needs contiguous groups in input order"):
        table.rows(torch.tensor([1]), torch.float32)
