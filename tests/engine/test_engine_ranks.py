"""One engine on two ranks (two processes, gloo) against one rank, on the CPU: rank 0 schedules and
publishes each step's ForwardInputs, rank 1 runs them. The same tokens and logprobs for greedy and
seeded requests, n = 2 (forks), a prefix cache hit (restores and saves), an image (its features
broadcast from rank 0) and the overlap schedule (tokens shared on the device)."""

from __future__ import annotations

import json
import multiprocessing

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

PS = 8


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(5)
    system = rng.integers(10, vocab - 60, 20).tolist()
    return [system + rng.integers(10, vocab - 60, 3 + 4 * i).tolist() for i in range(3)]


def _image_request(cfg):
    from PIL import Image

    from glmrt.engine.mm import MMInput
    from glmrt.vision import ImageProcessorConfig, process_image
    pixels = np.random.default_rng(3).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    item = process_image(Image.fromarray(pixels, "RGB"), ImageProcessorConfig.from_vision_config(cfg.vision))
    ids = [11, 12, cfg.image_start_token_id] + [cfg.image_token_id] * item.num_tokens + [cfg.image_end_token_id, 13]
    return ids, MMInput("image", torch.from_numpy(item.pixel_values), tuple(item.grid_thw), item.num_tokens)


def _serve(engine, overlap: bool) -> list:
    """Every case of the module on `engine` -> [(output ids, logprobs)] per choice."""
    from glmrt.sampling_params import SamplingParams
    engine.overlap = overlap
    engine.runner.eager_async = overlap
    vocab = engine.model_config.text.vocab_size
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = []
    for _ in range(2):  # the second pass hits the prefix cache (restores, saves)
        for group in engine.generate(_prompts(vocab), greedy):
            out += [(c.output_ids, c.logprobs) for c in group]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=5, ignore_eos=True, logprobs=True)
    for group in engine.generate(_prompts(vocab)[:2], seeded):
        out += [(c.output_ids, c.logprobs) for c in group]
    ids, mm = _image_request(engine.model_config)
    rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=True),
                             mm_items=[mm])[0]
    while engine.has_work():
        engine.step()
    req = engine.requests.pop(rid)
    out.append((req.output_ids, req.logprobs))
    return out


def _rank_main(rank: int, rendezvous: str, ckpt: str, result: str) -> None:
    torch.set_num_threads(1)
    from glmrt.engine.config import EngineConfig
    from glmrt.engine.engine import Engine
    from glmrt.engine.model_rank import ModelRank
    from glmrt.engine.ranks import join_group, leave_group
    parallel, link = join_group(rank, 2, 1, rendezvous, "cpu")
    cfg = EngineConfig(model=ckpt, page_size=PS)
    if rank:
        ModelRank(cfg, log=lambda *a: None, parallel=parallel, link=link).follow()
    else:
        engine = Engine(cfg, log=lambda *a: None, parallel=parallel, link=link)
        cases = {"sync": _serve(engine, False), "overlap": _serve(engine, True)}
        engine.runner.stop_followers()
        with open(result, "w") as f:
            json.dump(cases, f)
    leave_group()


def run_two_ranks(target, d, ckpt: str, *extra) -> dict:
    """`target(rank, rendezvous, ckpt, result, *extra)` in two spawned processes (ranks 0 and 1,
    gloo); both must exit 0 -> the JSON rank 0 wrote to `result`."""
    result = str(d / "result.json")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, str(d / "rendezvous"), ckpt, result, *extra)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    with open(result) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def two_ranks(ckpt, tmp_path_factory):
    return run_two_ranks(_rank_main, tmp_path_factory.mktemp("ranks"), ckpt)


@pytest.mark.timeout(300)
def test_two_ranks_serve_what_one_rank_serves(ckpt, two_ranks):
    from glmrt.engine.config import EngineConfig
    from glmrt.engine.engine import Engine
    for mode in ("sync", "overlap"):
        one = _serve(Engine(EngineConfig(model=ckpt, page_size=PS), log=lambda *a: None), mode == "overlap")
        two = two_ranks[mode]
        assert [ids for ids, _ in two] == [ids for ids, _ in one], mode
        for (_, lp2), (_, lp1) in zip(two, one):
            if lp1:
                assert max(abs(a - b) for a, b in zip(lp2, lp1)) <= 1e-5 * max(abs(x) for x in lp1), mode


def test_one_rank_makes_no_collective_call(ckpt, model, monkeypatch):
    import torch.distributed as dist

    from glmrt.engine.config import EngineConfig
    from glmrt.engine.engine import Engine

    def refuse(*a, **kw):
        raise AssertionError("a one-rank engine called a collective")

    for name in ("broadcast", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
        monkeypatch.setattr(dist, name, refuse)
    engine = Engine(EngineConfig(model=ckpt, page_size=PS), model=model, log=lambda *a: None)
    assert engine.runner.link is None
    assert len(_serve(engine, overlap=True)) == 3 * 2 + 2 * 2 + 1
