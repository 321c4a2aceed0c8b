"""CUDA IPC handles for tensors between processes on one host, without pickle.

`export_cuda(t)` turns a CUDA tensor into a msgpack-able dict (sizes, dtype and the raw IPC
handle bytes torch's own sharing machinery produces); `import_cuda(d)` maps the same memory
in another process. Both processes must see the GPU under the same index (the same
CUDA_VISIBLE_DEVICES), and the importer should copy what it needs and drop the mapping;
torch's IPC reference counting keeps the producer's block alive until then.
"""

from __future__ import annotations

from typing import Any


def export_cuda(t) -> dict[str, Any]:
    storage = t._typed_storage()
    device, handle, size_bytes, offset_bytes, ref_h, ref_off, event_h, event_sync = storage._share_cuda_()
    return {"size": list(t.size()), "stride": list(t.stride()), "offset": int(t.storage_offset()),
            "dtype": str(t.dtype).removeprefix("torch."), "device": int(device), "handle": bytes(handle),
            "size_bytes": int(size_bytes), "offset_bytes": int(offset_bytes), "ref_h": bytes(ref_h),
            "ref_off": int(ref_off), "event_h": bytes(event_h) if event_h else b"", "event_sync": bool(event_sync)}


def import_cuda(d: dict[str, Any]):
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(torch.Tensor, torch.Size(d["size"]), tuple(d["stride"]), d["offset"],
                               torch.storage.TypedStorage, getattr(torch, d["dtype"]), d["device"], d["handle"],
                               d["size_bytes"], d["offset_bytes"], False, d["ref_h"], d["ref_off"],
                               d["event_h"] or None, d["event_sync"])
