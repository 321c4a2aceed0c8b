"""The reference KDA delta rule on one request's rows, in fp32: token by token (`kda_recurrent`)
and in chunks, exactly re-arranged (`kda_chunked`). ReferenceOps.kda and the training ops call
them; docs/MODEL.md §4 has the recurrence."""

from __future__ import annotations

import torch


def kda_recurrent(q, k, v, g, beta, s):
    """One or more delta-rule steps, token by token. q,k [T,H,dk]; v [T,H,dv]; s [H,dk,dv] fp32."""
    outs = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[..., None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", s, k[t])) * beta[t][:, None]
        s = s + k[t][..., None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(outs), s


def kda_chunked(q, k, v, g, beta, s, chunk_size: int = 64):
    """The delta rule over chunks, exactly re-arranged (no approximation).

    Within a chunk with cumulative log-decay G_t, the per-token updates
    delta_t = beta_t (v_t - S~_t^T k_t) form a unit lower-triangular system
    (I + diag(beta) A) delta = beta (v - (e^G * k) S0), A[t,s] = sum_c k_t k_s e^{G_t - G_s} (s < t),
    solved directly; outputs and the carried state follow in closed form. Every exponent is
    G_t - G_s with s <= t (<= 0), so nothing overflows.
    """
    total = q.shape[0]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for c0 in range(0, total, chunk_size):
        c1 = min(c0 + chunk_size, total)
        n = c1 - c0
        qc, kc, vc, gc = (x[c0:c1].transpose(0, 1) for x in (q, k, v, g))  # [H, C, *]
        bc = beta[c0:c1].transpose(0, 1)  # [H, C]
        big_g = gc.cumsum(1)
        incl = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        diff = (big_g[:, :, None, :] - big_g[:, None, :, :]).masked_fill(~incl[None, :, :, None], float("-inf"))
        decay = diff.exp()  # [H, C(t), C(s), dk]
        a_kk = torch.einsum("htc,hsc,htsc->hts", kc, kc, decay)
        a_qk = torch.einsum("htc,hsc,htsc->hts", qc, kc, decay)
        eye = torch.eye(n, device=q.device)
        strict = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1)
        lower = eye + bc[:, :, None] * a_kk * strict
        rhs = bc[..., None] * (vc - (kc * big_g.exp()) @ s)
        delta = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
        out[c0:c1] = ((qc * big_g.exp()) @ s + a_qk @ delta).transpose(0, 1)
        last = big_g[:, -1:, :]
        s = last.transpose(1, 2).exp() * s + (kc * (last - big_g).exp()).transpose(1, 2) @ delta
    return out, s
