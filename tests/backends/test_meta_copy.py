"""backends.meta.host_to_device: one packed copy of the step's host tensors, each view 16-byte aligned."""

from __future__ import annotations

import torch

from backends.meta import BatchMeta, host_to_device


def test_host_to_device_views_are_aligned_and_shaped():
    ts = [torch.arange(3), torch.arange(1), torch.arange(10).view(2, 5), torch.arange(0), torch.arange(7)]
    views = host_to_device("meta", *ts)  # the packing path (any non-CPU device); meta holds no data
    assert [v.shape for v in views] == [t.shape for t in ts]
    assert all(v.device.type == "meta" and v.dtype == torch.long for v in views)
    assert all(v.storage_offset() * v.element_size() % 16 == 0 for v in views)


def test_host_to_device_cpu_is_identity():
    ts = [torch.arange(3), torch.arange(4)]
    assert all(a is b for a, b in zip(host_to_device("cpu", *ts), ts))


def test_batch_meta_build_values():
    """Positions, request index and cache slots from the host lists (no .item() on the way)."""
    m = BatchMeta.build([0, 5], [3, 4], [1, 2], [[0, 1], [2, 3, 5]], 4, "cpu")
    assert m.positions.tolist() == [0, 1, 2, 5, 6, 7, 8]
    assert m.req_index.tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert m.out_loc.tolist() == [0, 1, 2, 13, 14, 15, 20]
    assert m.cu_seqlens_t.tolist() == [0, 3, 7] and m.prefix_lens_t.tolist() == [0, 5]
