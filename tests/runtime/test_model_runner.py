"""The model runner's KV-cache pool allocation."""

from __future__ import annotations

import pytest
import torch

from kubellm.runtime.engine import host_malloc
from kubellm.runtime.engine.model_runner import zeroed_pool


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_blocks", [3, 2048])  # a heap block and one past glibc's mmap threshold (48 MiB in fp32)
def test_zeroed_pool_is_zero_aligned_and_owns_its_memory(dtype, num_blocks):
    host_malloc.tune()  # as the engine runs: the mmap threshold at its maximum
    shape = (num_blocks, 16, 3, 64 * 2)
    pools = [zeroed_pool(shape, dtype, "cpu") for _ in range(2)]
    for pool in pools:
        assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
        assert pool.data_ptr() % 64 == 0
        assert torch.count_nonzero(pool) == 0
    pools[0][-1].fill_(1.0)  # writes land in the pool's own memory, not its neighbour's
    assert torch.count_nonzero(pools[1]) == 0 and pools[0][-1].eq(1).all()


def test_to_device_lays_the_lists_in_one_buffer_as_16_byte_aligned_int64_views():
    from kubellm.runtime.engine.model_runner import to_device

    lists = [[5, 6, 7], [], [1], [2**40, -3]]
    out = to_device(lists, "cpu")
    assert [t.tolist() for t in out] == lists
    assert all(t.dtype == torch.int64 and t.is_contiguous() for t in out)
    base = out[0].data_ptr()
    assert {t.data_ptr() - base for t in out if t.numel()} == {0, 32, 48}  # one buffer, starts rounded to 16 bytes
