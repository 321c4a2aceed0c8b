"""The DSA test problems: paged decode and prefill batches (BatchMeta over shuffled pages), random
pool selections, sparse-MLA and indexer inputs, and a float64 sparse-attention oracle, shared by
tests/backends/test_triton_sparse_mla.py, test_triton_indexer.py and test_triton_dsa_model.py.
"""

from __future__ import annotations

import torch

from backends.meta import BatchMeta


PAGE = 16  # tokens per KV page


def h200_ops(prefill: bool = True):
    """CudaH200Ops with the prefill kernels on (the default) or off."""
    from backends.cuda_h200 import CudaH200Ops

    ops = CudaH200Ops()
    ops.prefill_kernels = prefill
    return ops


def generator(seed):
    return torch.Generator().manual_seed(seed)


def decode_meta(lens, device, seed, spare_pages=3):
    """Decode batch: request r has lens[r]-1 cached tokens and one new token; pages shuffled."""
    return prefill_meta([(n - 1, 1) for n in lens], device, seed, spare_pages)


def prefill_meta(reqs, device, seed, spare_pages=2):
    """Batch of (prefix_len, seq_len) requests over shuffled pages, `spare_pages` left unused."""
    g = generator(seed)
    need = [-(-(p + n) // PAGE) for p, n in reqs]
    num_pages = sum(need) + spare_pages
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables, c = [], 0
    for k in need:
        tables.append(perm[c:c + k])
        c += k
    meta = BatchMeta.build([p for p, _ in reqs], [n for _, n in reqs], list(range(len(reqs))), tables, PAGE,
                           device)
    return meta, num_pages


def torch_decode(q_abs, flat, token_idx, scale):
    out = torch.empty(q_abs.shape, dtype=torch.float64)
    for b in range(q_abs.shape[0]):
        idx = token_idx[b].long().cpu()
        rows = flat.double().cpu()[idx[idx >= 0]]
        s = q_abs[b].double().cpu() @ rows.T * scale
        out[b] = torch.softmax(s, dim=-1) @ rows
    return out


def random_sel(n_pools, width, g, odd=False):
    """Random pool choices per request: distinct complete pools, -1 padding, and with `odd` a
    repeat (counts once) and the incomplete pool n (the reference ignores it)."""
    sel = torch.full((len(n_pools), width), -1, dtype=torch.long)
    for i, n in enumerate(n_pools):
        take = min(n, width - 2 if odd else width)
        sel[i, :take] = torch.randperm(n, generator=g)[:take]
        if odd:
            sel[i, take] = n
            if take:
                sel[i, take + 1] = sel[i, 0]
    return sel[:, torch.randperm(width, generator=g)]


def prefill_sel(meta, kpool, width, g, visible_only=False):
    """Random per-token pool choices: distinct pools of the request, -1, a repeat; unless
    visible_only, also pools not yet complete at the token (both sides ignore them)."""
    pos = meta.positions.cpu()
    req = meta.req_index.cpu()
    totals = meta.total_lens
    sel = torch.full((pos.shape[0], width), -1, dtype=torch.long)
    for i in range(pos.shape[0]):
        n = (int(pos[i]) + 1) // kpool if visible_only else totals[int(req[i])] // kpool + 1
        take = min(n, width - 1)
        sel[i, :take] = torch.randperm(n, generator=g)[:take]
        if take:
            sel[i, take] = sel[i, 0]
    return sel[:, torch.randperm(width, generator=g)].to(meta.positions.device)


def mla_inputs(lens, r, dtype, device, seed, h=4, dn=16, dv=16):
    g = generator(seed)
    meta, num_pages = decode_meta(lens, device, seed)
    cache = torch.randn(num_pages, PAGE, r, generator=g).to(dtype).to(device)
    q = torch.randn(len(lens), h, dn, generator=g).to(dtype).to(device)
    w_kc = (torch.randn(h, dn, r, generator=g) * dn ** -0.5).to(dtype).to(device)
    w_vc = (torch.randn(h, dv, r, generator=g) * r ** -0.5).to(dtype).to(device)
    return meta, cache, q, w_kc, w_vc


def prefill_mla_inputs(reqs, r, dtype, device, seed, h=4, dn=16, dv=16):
    g = generator(seed)
    meta, num_pages = prefill_meta(reqs, device, seed)
    cache = torch.randn(num_pages, PAGE, r, generator=g).to(dtype).to(device)
    q = torch.randn(meta.num_tokens, h, dn, generator=g).to(dtype).to(device)
    w_kc = (torch.randn(h, dn, r, generator=g) * dn ** -0.5).to(dtype).to(device)
    w_vc = (torch.randn(h, dv, r, generator=g) * r ** -0.5).to(dtype).to(device)
    return meta, cache, q, w_kc, w_vc


def indexer_inputs(lens, dtype, device, seed, hi=16, di=32, kpool=4):
    g = generator(seed)
    meta, num_pages = decode_meta(lens, device, seed)
    pooled = torch.randn(num_pages, PAGE // kpool, di, generator=g).to(dtype).to(device)
    q = torch.randn(len(lens), hi, di, generator=g).to(dtype).to(device)
    w = torch.randn(len(lens), hi, generator=g).to(dtype).to(device)  # the weights projection's output
    return meta, pooled, q, w


# (prefix_len, seq_len) per request: prefill from 0 and after a cached prefix, a decode token
# (mixed batch), an empty request, a request with <= topk pools; chunks cross pools and pages.
PREFILL_CASES = {
    "mixed": [(0, 21), (13, 9), (30, 1), (7, 0), (45, 12), (2, 9)],
    "single": [(0, 70)],
    "prefix": [(21, 30), (0, 5)],
}
