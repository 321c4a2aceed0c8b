"""Per-step batch metadata that every op reads (the runner builds it once per forward).

A forward batch is one flat run of tokens from many requests, with no padding:

    tokens   | r0: prefix_len[0] cached, seq_len[0] new | r1: ... | r2: ... |
    flat idx   cu_seqlens[0]=0 ........ cu_seqlens[1] ...... cu_seqlens[2] ...

Request `r` owns state slot `slot_ids[r]` and the KV pages `page_table[r, :]` (page `j`
holds positions `[j*page_size, (j+1)*page_size)`). Token `i` of the flat batch sits at
absolute position `positions[i]` of request `req_index[i]` and writes its latent to flat
location `out_loc[i] = page * page_size + offset` of the paged pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class BatchMeta:
    prefix_lens: list[int]          # tokens already cached per request (CPU)
    seq_lens: list[int]             # new tokens per request in this forward (CPU)
    positions: torch.Tensor         # [N] long, absolute position of each token
    req_index: torch.Tensor         # [N] long, request of each token
    slot_ids: torch.Tensor          # [B] long, state-pool slot per request
    page_table: torch.Tensor        # [B, max_pages] long, KV pages per request (-1 = none)
    out_loc: torch.Tensor           # [N] long, flat latent slot of each new token
    page_size: int
    # The same lengths on the device, for kernels that must not read Python lists (CUDA graphs):
    prefix_lens_t: torch.Tensor | None = None  # [B] long
    cu_seqlens_t: torch.Tensor | None = None   # [B+1] long, flat start of each request
    # cu_seqlens as a host tensor (BatchMeta.build's): one object per forward, which fla's
    # chunk_kda caches its chunk indices on (the same tensors in every KDA layer: one copy, not three)
    cu_seqlens_cpu: torch.Tensor | None = None
    # What ops derive from the lists once per forward and share across layers (e.g. a mixed
    # batch's row split for KDA), keyed by the op: built on the first layer, reused by the rest.
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def cu_seqlens(self) -> list[int]:
        out = [0]
        for n in self.seq_lens:
            out.append(out[-1] + n)
        return out

    @property
    def total_lens(self) -> list[int]:
        return [p + s for p, s in zip(self.prefix_lens, self.seq_lens)]

    @classmethod
    def build(cls, prefix_lens: list[int], seq_lens: list[int], slot_ids: list[int],
              page_tables: list[list[int]], page_size: int, device: torch.device | str) -> "BatchMeta":
        """Build the tensors from per-request lists (CPU work, done once per step)."""
        if not (len(prefix_lens) == len(seq_lens) == len(slot_ids) == len(page_tables)):
            raise ValueError("prefix_lens, seq_lens, slot_ids and page_tables must have one entry per request")
        for r, (p, s, pages) in enumerate(zip(prefix_lens, seq_lens, page_tables)):
            if s < 0 or p < 0:
                raise ValueError("negative length")
            need = -(-(p + s) // page_size)
            if len(pages) < need:
                raise ValueError(f"request {r}: {len(pages)} pages cannot hold {p + s} tokens "
                                 f"(page_size {page_size})")
        max_pages = max((len(x) for x in page_tables), default=0)
        table = torch.full((len(page_tables), max(max_pages, 1)), -1, dtype=torch.long)
        for r, pages in enumerate(page_tables):
            if pages:
                table[r, :len(pages)] = torch.tensor(pages, dtype=torch.long)
        # per-token tensors with tensor ops on the host (a Python loop per token cost ~10 ms
        # for a 16K-token prefill, with the GPU idle)
        seq = torch.tensor(seq_lens, dtype=torch.long)
        pre = torch.tensor(prefix_lens, dtype=torch.long)
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.long)
        torch.cumsum(seq, 0, out=cu[1:])
        total = sum(seq_lens)  # known on the host: no .item() (repeat_interleave's own costs two)
        req_index = torch.repeat_interleave(torch.arange(len(seq_lens)), seq, output_size=total)
        positions = torch.arange(total) - cu[req_index] + pre[req_index]
        out_loc = table[req_index, positions // page_size] * page_size + positions % page_size
        slots = torch.tensor(slot_ids, dtype=torch.long)
        parts = host_to_device(device, positions, req_index, slots, table, out_loc, pre, cu)
        return cls(list(prefix_lens), list(seq_lens), *parts[:5], page_size, *parts[5:], cu_seqlens_cpu=cu)


def host_to_device(device: torch.device | str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Host tensors of one dtype on `device` in one copy from pinned memory, not one blocking copy
    each: a copy from pageable memory waits for the GPU to drain its queue first, so the host could
    not queue this forward behind the previous one. Returns views of one flat device buffer (the
    tensors themselves on the CPU). Each view starts 16-byte aligned: Triton specialises pointer
    arguments on 16-byte alignment, and a misaligned page table or out_loc (an odd offset, e.g.
    after one request's slot id) would compile and run a kernel variant without it."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return list(tensors)
    per = max(1, 16 // tensors[0].element_size())
    offs, at = [], 0
    for t in tensors:
        offs.append(at)
        at += -(-t.numel() // per) * per
    host = torch.empty(at, dtype=tensors[0].dtype, pin_memory=dev.type == "cuda")
    for t, o in zip(tensors, offs):
        host[o:o + t.numel()] = t.reshape(-1)
    flat = host.to(dev, non_blocking=dev.type == "cuda")
    return [flat[o:o + t.numel()].view(t.shape) for t, o in zip(tensors, offs)]
