"""Unit tests of reference ops that the HF parity tests cannot pin down on their own:
KDA chunked vs recurrent forms, deterministic indexer ties, the token mask, the MTP layer."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)

from backends.meta import BatchMeta  # noqa: E402
from backends.reference import ReferenceOps  # noqa: E402
from backends.reference_kda import kda_chunked, kda_recurrent  # noqa: E402


def _kda_inputs(t=150, h=3, dk=8, dv=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, dk, generator=g)
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=g), dim=-1)
    v = torch.randn(t, h, dv, generator=g)
    gate = -5 * torch.sigmoid(torch.randn(t, h, dk, generator=g))
    beta = torch.sigmoid(torch.randn(t, h, generator=g))
    s0 = torch.randn(h, dk, dv, generator=g)
    return q, k, v, gate, beta, s0


def test_kda_chunked_equals_recurrent():
    args = _kda_inputs()
    o_ref, s_ref = kda_recurrent(*args)
    for chunk in (1, 7, 64, 200):
        o, s = kda_chunked(*args, chunk_size=chunk)
        assert torch.allclose(o, o_ref, rtol=1e-4, atol=1e-4), chunk
        assert torch.allclose(s, s_ref, rtol=1e-4, atol=1e-4), chunk


def test_kda_chunked_survives_strong_decay():
    """Cumulative log-decay of -5 per step over a 64-token chunk is -320: no inf/nan anywhere."""
    q, k, v, _, beta, s0 = _kda_inputs(t=128)
    gate = torch.full_like(q, -5.0)
    o, s = kda_chunked(q, k, v, gate, beta, s0)
    o_ref, s_ref = kda_recurrent(q, k, v, gate, beta, s0)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert torch.allclose(o, o_ref, atol=1e-5)


def _meta(prefix, seq, page_size=8):
    pages = [list(range(i * 8, i * 8 + 8)) for i in range(len(seq))]
    return BatchMeta.build(prefix, seq, list(range(len(seq))), pages, page_size, "cpu")


def test_indexer_ties_go_to_the_lower_pool():
    ops = ReferenceOps()
    kpool, topk_pools = 2, 2
    meta = _meta([0], [12])  # 6 complete pools for the last query
    pooled = torch.zeros(64, 4, 4)
    pooled.view(-1, 4)[:6] = torch.tensor([1.0, 0, 0, 0])  # identical keys: every score ties
    q = torch.ones(12, 2, 4)
    w = torch.ones(12, 2)
    sel = ops.indexer_select(q, w, pooled, meta, kpool, topk_pools)
    assert sel[-1].tolist() == [0, 1]
    again = ops.indexer_select(q, w, pooled, meta, kpool, topk_pools)
    assert torch.equal(sel, again)


def test_indexer_only_picks_complete_visible_pools():
    ops = ReferenceOps()
    kpool, topk_pools = 4, 2
    meta = _meta([0], [18])
    pooled = torch.zeros(64, 2, 3)
    flat = pooled.view(-1, 3)
    flat[:4] = torch.tensor([[0.1, 0, 0], [5.0, 0, 0], [0.2, 0, 0], [9.0, 0, 0]])
    q = torch.tensor([1.0, 0, 0]).expand(18, 1, 3).clone()
    w = torch.ones(18, 1)
    sel = ops.indexer_select(q, w, pooled, meta, kpool, topk_pools)
    assert sel[2].tolist() == [-1, -1]        # position 2: no complete pool yet
    assert sorted(sel[7].tolist()) == [0, 1]       # two eligible pools -> both
    assert sorted(sel[11].tolist()) == [1, 2]       # pools 0-2 eligible: best two by score
    assert sorted(sel[15].tolist()) == [1, 3]       # pool 3 completes at 15 and wins
    mask = ops._token_mask(sel[15:16], meta.positions[15:16], 18, kpool, True)
    assert mask[0].nonzero().flatten().tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    mask = ops._token_mask(sel[13:14], meta.positions[13:14], 18, kpool, True)
    assert mask[0].nonzero().flatten().tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]


def test_mtp_layer_is_cache_consistent(tmp_path):
    """The draft layer over a sequence in one pass equals the same tokens fed step by step."""
    from glmrt.checkpoint.presets import preset_config
    from glmrt.model.loader import load_dummy
    from glmrt.model.session import DirectSession

    model = load_dummy(preset_config("tiny"), ReferenceOps(), dtype=torch.float32, seed=1)
    assert model.mtp is not None
    ids = torch.randint(1, 900, (40,), generator=torch.Generator().manual_seed(0))

    def draft(chunks):
        s = DirectSession(model)
        r = s.new_request()
        outs = []
        pos = 0
        for n in chunks:
            piece = ids[pos:pos + n]
            meta = BatchMeta.build([pos], [n], [s.slots[r]], [s.pages[r]], s.page_size, "cpu")
            _, hidden = model(piece, meta, s.cache)
            nxt = ids[pos + 1:pos + n + 1]
            nxt = torch.cat([nxt, nxt.new_zeros(n - nxt.numel())])
            h = model.mtp(model.model.embed(nxt), hidden, meta, s.cache)
            outs.append(model.compute_logits(h))
            pos += n
        return torch.cat(outs)

    whole = draft([40])
    steps = draft([17] + [1] * 23)
    assert whole.shape == (40, model.config.text.vocab_size)
    assert torch.isfinite(whole).all()
    assert torch.allclose(whole, steps, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_dtype, group_tokens", [(None, None), ("fp8_e4m3", None), (None, 300)])
def test_short_runs_give_each_request_prefilled_alone(kv_dtype, group_tokens, monkeypatch):
    """The reference ops take a batch's short runs together (one decode token, or a few as a
    speculative verify feeds them; padded to the longest request): each token's logits equal
    those of its request's last token prefilled alone, with selections (over 16 pools) and
    without, pools completed in the run and not, a prefill run in the same batch, the sparse
    MLA's rows in one group or several; and a next step reads back what the last one cached."""
    from backends import reference_decode
    from glmrt.checkpoint.presets import preset_config
    from glmrt.model.loader import load_dummy
    from glmrt.model.session import DirectSession

    if group_tokens:
        monkeypatch.setattr(reference_decode, "MLA_GROUP_TOKENS", group_tokens)
    model = load_dummy(preset_config("tiny"), ReferenceOps(), dtype=torch.float32, seed=2)
    lens = [5, 12, 37, 64, 130, 203]  # 16-pool selection from 68 tokens (kpool 4); 12 and 64 complete a pool
    runs = [[1, 1, 4], [1, 3, 1], [1, 1, 1], [4, 1, 2], [2, 1, 1], [1, 4, 1]]  # new tokens per step
    ids = torch.randint(1, 900, (len(lens) + 1, 220), generator=torch.Generator().manual_seed(3))

    def alone(r, n):
        s = DirectSession(model, max_requests=1, max_tokens=256, kv_dtype=kv_dtype)
        return s.step({s.new_request(): ids[r, :n]}, all_logits=False)[0][0]

    s = DirectSession(model, max_requests=len(lens) + 1, max_tokens=256, kv_dtype=kv_dtype)
    rids = [s.new_request() for _ in range(len(lens) + 1)]
    for rid, n in zip(rids, lens):
        s.step({rid: ids[rid, :n - 1]})
    done = [n - 1 for n in lens]
    for step in range(3):
        chunks = {rid: ids[rid, done[i]:done[i] + runs[i][step]] for i, rid in enumerate(rids[:-1])}
        chunks[rids[-1]] = ids[rids[-1], 20 * step:20 * step + 20]  # a prefill run beside the short runs
        out = s.step(chunks)
        for i, rid in enumerate(rids[:-1]):
            for j in range(runs[i][step]):
                want = alone(rid, done[i] + j + 1)
                assert torch.allclose(out[rid][j], want, rtol=1e-4, atol=1e-4), (step, i, j)
            done[i] += runs[i][step]
        assert torch.allclose(out[rids[-1]][-1], alone(rids[-1], 20 * step + 20), rtol=1e-4, atol=1e-4)
