"""The training forward is the serving model's: a written checkpoint gives the same logits
through glmrt's serving path (reference ops, paged caches) as through TrainingOps."""

import pytest
import torch

from backends.reference import ReferenceOps
from glmrt.model.loader import load_checkpoint
from glmrt.model.session import DirectSession
from glmrt.train.corpus import held_out_problems, math_chat
from glmrt.train.data import encode_chat, train_tokenizer
from glmrt.train.ops import DenseBatch, TrainingCache, TrainingOps
from glmrt.train.output import save_checkpoint
from glmrt.train.trainer import build_model, forward_losses
from glmrt.checkpoint.presets import preset_config


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    torch.set_num_threads(1)
    tok = train_tokenizer(1024)
    model = build_model(preset_config("tiny-trained"), TrainingOps(), torch.device("cpu"), seed=3)
    out = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(model, tok, out)
    return out, tok


def test_training_forward_matches_serving_forward(trained_dir):
    out, tok = trained_dir
    served, _ = load_checkpoint(out, ReferenceOps(), dtype=torch.float32, with_vision=False, with_mtp=False)
    ops = TrainingOps()
    trained = build_model(served.config, ops, torch.device("cpu"), seed=0)
    with torch.no_grad():  # the written (bf16-rounded) weights in both
        sd = dict(served.named_parameters())
        for name, p in trained.named_parameters():
            if name in sd:
                p.copy_(sd[name])
    p, q = held_out_problems(0, 1)[0]
    ids, _ = encode_chat(tok, math_chat(p, q))
    assert len(ids) > 4 * 32, "the chat must be long enough for the indexer to select"
    sess = DirectSession(served, max_requests=1, max_tokens=len(ids) + 16)
    rid = sess.new_request()
    want = sess.step({rid: ids})[rid]
    t = torch.tensor(ids)
    with torch.no_grad():
        hidden = trained.model(trained.model.embed(t), DenseBatch(1, len(ids), torch.ones(len(ids), dtype=torch.bool)),
                               TrainingCache())
        got = trained.compute_logits(hidden)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    assert ops.records.indexer, "the indexer ran and recorded its KL terms"
