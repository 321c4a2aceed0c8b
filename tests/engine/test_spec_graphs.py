"""The speculative CUDA graphs' bodies (glmrt.engine.spec_graphs), run eagerly on the CPU with the
cuda-h200 kernels in Triton's interpreter (what the graphs capture on the GPU): on the shipped
trained model, whose draft layer agrees with the model often but not always (every kept count
occurs), greedy tokens equal a run without speculation, with pad rows in the batch bucket.

Needs Triton and fla-core (the KDA kernels); the GPU test suite runs the captured graphs
(tests/engine/test_spec_graphs.py::test_captured_graphs_on_cuda).
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
pytest.importorskip("fla")

torch.set_num_threads(1)

from glmrt.engine.config import EngineConfig  # noqa: E402
from glmrt.engine.engine import Engine  # noqa: E402
from glmrt.engine.spec_graphs import SpecGraphs  # noqa: E402
from glmrt.sampling_params import SamplingParams  # noqa: E402

TRAINED = os.path.join(os.path.dirname(__file__), "..", "..", "glmrt", "checkpoint", "tiny_trained")
K = 3


def chats(n: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    from glmrt.serving.chat_template import render_chat
    from glmrt.train.corpus import held_out_chats

    tok = Tokenizer.from_file(os.path.join(TRAINED, "tokenizer.json"))
    return [tok.encode(render_chat(c.messages[:-1], c.tools, thinking=True), add_special_tokens=False).ids
            for c in held_out_chats(0, n)]


def engine(device: str, k: int) -> Engine:
    kw = dict(speculative_algorithm="EAGLE", speculative_num_steps=k) if k else {}
    return Engine(EngineConfig(model=TRAINED, backend="cuda-h200" if device == "cuda" else "reference",
                               device=device, dtype="float32", page_size=16, skip_server_warmup=True,
                               cuda_graph_warmup_tokens=0, **kw), log=lambda *a: None)


@pytest.fixture(scope="module")
def h200_model():
    from backends.cuda_h200 import CudaH200Ops
    from glmrt.model.loader import load_checkpoint
    m, _ = load_checkpoint(TRAINED, CudaH200Ops(), dtype=torch.float32, with_mtp=True)
    return m


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's test; on a GPU test_captured_graphs_on_cuda "
                    "runs the captured graphs")
def test_graph_bodies_give_the_tokens_of_decoding_without_speculation(h200_model):
    prompts = chats(3)  # a bucket of 4: one pad row
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = Engine(EngineConfig(model=TRAINED, page_size=16, skip_server_warmup=True), model=h200_model,
                   log=lambda *a: None)
    want = [c[0].output_ids for c in plain.generate(prompts, params)]
    del plain
    e = Engine(EngineConfig(model=TRAINED, page_size=16, skip_server_warmup=True, speculative_algorithm="EAGLE",
                            speculative_num_steps=K), model=h200_model, log=lambda *a: None)
    pad_slot, pad_page = e.slots.allocate(), e.pages.allocate(1)[0]
    e.spec.graphs = SpecGraphs(e.model, e.cache, K, max_bs=4, max_pages=-(-e.context_length // 16),
                               pad_slot=pad_slot, pad_page=pad_page, capture=False)
    got = [c[0].output_ids for c in e.generate(prompts, params)]
    assert got == want
    st = e.spec.stats
    assert e.spec.graphs.replays > 0 and st.cycles > 0
    assert 0 < st.accepted < st.drafted  # some drafts kept, some rolled back
    e.slots.free(pad_slot)
    e.pages.release([pad_page])
    e.check_invariants()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_on_cuda():
    """On the GPU: the engine captures the graphs itself; greedy tokens equal the eager speculative
    engine's and those of decoding without speculation (fp32)."""
    prompts = chats(5)
    params = SamplingParams(temperature=0, max_tokens=48)
    runs = {}
    for name, k, graphs in (("plain", 0, True), ("eager", K, False), ("graphs", K, True)):
        kw = dict(speculative_algorithm="EAGLE", speculative_num_steps=k) if k else {}
        e = Engine(EngineConfig(model=TRAINED, backend="cuda-h200", device="cuda", dtype="float32", page_size=16,
                                skip_server_warmup=True, disable_cuda_graph=not graphs, **kw), log=lambda *a: None)
        runs[name] = [c[0].output_ids for c in e.generate(prompts, params)]
        if name == "graphs":
            assert e.runner.spec_graphs is not None and e.runner.spec_graphs.replays > 0
            e.check_invariants()
        del e
        gc.collect()  # the next engine sizes its pools from the free memory
        torch.cuda.empty_cache()
    assert runs["graphs"] == runs["eager"] == runs["plain"]
