"""`glmrt train` on the CPU: the loss falls, a seed gives bitwise the same weights, and the
output directory is a servable checkpoint with its loss curve."""

import json

import pytest
import torch

from cli.main import main
from glmrt.train.data import train_tokenizer
from glmrt.train.trainer import TrainConfig, train


@pytest.fixture(scope="module")
def tok():
    torch.set_num_threads(1)
    return train_tokenizer(1024)


def _cfg(**kw):
    base = dict(steps=50, batch_size=4, max_len=224, lr=3e-3, warmup_steps=5, dense_steps=10, eval_problems=0)
    base.update(kw)
    return TrainConfig(**base)


def test_loss_falls_and_routing_and_indexer_train(tok):
    model, res = train(_cfg(), tok, progress=False)
    first = sum(h.lm for h in res.history[:5]) / 5
    last = sum(h.lm for h in res.history[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    assert res.history[-1].mtp < res.history[0].mtp
    assert all(h.indexer > 0 for h in res.history)
    from glmrt.checkpoint.presets import preset_config
    from glmrt.train.ops import TrainingOps
    from glmrt.train.trainer import build_model
    fresh = dict(build_model(preset_config("tiny-trained"), TrainingOps(), torch.device("cpu"), 0).named_parameters())
    biases = {n: p for n, p in model.named_parameters() if n.endswith("e_score_correction_bias")}
    assert len(biases) == 5  # four MoE layers and the MTP layer's
    for n, p in biases.items():  # the balancing update moved every router's bias, by at most its step
        step = (p - fresh[n]).abs()
        assert step.max() > 0 and step.max() <= 50 * 1e-3 + 1e-6, n
    assert set(res.expert_load) == {n.rsplit(".", 1)[0] for n in biases}
    assert all(len(v) == 8 for v in res.expert_load.values())


def test_same_seed_gives_bitwise_the_same_weights(tok):
    a, ra = train(_cfg(steps=6, dense_steps=2), tok, progress=False)
    b, rb = train(_cfg(steps=6, dense_steps=2), tok, progress=False)
    assert [h.loss for h in ra.history] == [h.loss for h in rb.history]
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na
    c, rc = train(_cfg(steps=2, dense_steps=2, seed=1), tok, progress=False)
    assert [h.loss for h in rc.history] != [h.loss for h in ra.history[:2]]


def test_cli_writes_a_loadable_checkpoint(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["train", "--out", str(out), "--device", "cpu", "--steps", "2", "--batch-size", "2", "--max-len", "224",
                 "--eval-problems", "4", "--threads", "1", "--no-progress"]) == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "loss.png", "train_summary.json", "held_out.jsonl"):
        assert (out / name).exists(), name
    assert (out / "model.safetensors").stat().st_size < 3_000_000
    assert len((out / "held_out.jsonl").read_text().splitlines()) == 4
    summary = json.loads((out / "train_summary.json").read_text())
    assert len(summary["history"]) == 2 and summary["evals"][0][0] == 2
    from backends.reference import ReferenceOps
    from glmrt.model.loader import load_checkpoint
    model, report = load_checkpoint(out, ReferenceOps(), dtype=torch.bfloat16, with_vision=False)
    assert model.mtp is not None and not report.skipped
    assert "trained tiny-trained for 2 steps" in capsys.readouterr().out


@pytest.mark.parametrize("argv,msg", [(["--steps", "0"], "--steps"), (["--device", "tpu"], "--device"),
                                      (["--lr", "-1"], "--lr"), (["--batch-size", "0"], "--batch-size")])
def test_bad_flags_are_refused_before_training(tmp_path, capsys, argv, msg):
    assert main(["train", "--out", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_the_mtp_chain_trains_on_the_tokens_each_draft_step_predicts(tok):
    from glmrt.train.corpus import chat_stream
    from glmrt.train.data import IGNORE, encode_chat, make_batch
    from glmrt.train.trainer import _shift
    chats = chat_stream(0, 0, 2)
    batch = make_batch(tok, chats, 10_000)
    second = _shift(batch.mtp_labels, 1, IGNORE)  # draft step 1 at position t predicts token t+3
    for r, chat in enumerate(chats):
        ids, out = encode_chat(tok, chat)
        for t in range(len(ids) - 3):
            assert second[r, t] == (ids[t + 3] if out[t + 3] else IGNORE)
    _, res = train(_cfg(steps=3, mtp_depth=3), tok, progress=False)
    assert all(torch.isfinite(torch.tensor([h.loss, h.mtp])).all() for h in res.history)


def test_training_the_draft_layer_alone_leaves_the_model_as_it_was(tmp_path, capsys):
    from cli.main import main
    from safetensors.torch import load_file
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    common = ["--device", "cpu", "--batch-size", "2", "--max-len", "224", "--eval-problems", "0", "--no-progress"]
    assert main(["train", "--out", str(base), "--steps", "2", *common]) == 0
    assert main(["train", "--out", str(tuned), "--steps", "3", "--init-from", str(base), "--train-only", "mtp",
                 "--mtp-depth", "2", *common]) == 0
    a, b = load_file(str(base / "model.safetensors")), load_file(str(tuned / "model.safetensors"))
    assert a.keys() == b.keys()
    mtp = [k for k in a if ".layers.6." in k]  # the MTP layer is layer num_hidden_layers (6) on disk
    assert mtp and any(not torch.equal(a[k], b[k]) for k in mtp)
    # the grouped projections (one product when fused) train too, each member its own weight
    grouped = [k for k in mtp if k.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight", "indexer.wk.weight",
                                             "indexer.weights_proj.weight"))]
    assert len(grouped) == 4 and all(not torch.equal(a[k], b[k]) for k in grouped), grouped
    assert all(torch.equal(a[k], b[k]) for k in a if k not in mtp)
    assert main(["train", "--out", str(tmp_path / "x"), "--train-only", "mtp", *common]) == 2
    assert "--init-from" in capsys.readouterr().err
