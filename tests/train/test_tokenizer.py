"""The corpus tokenizer: deterministic, digits one token each, the GLM-5.3 special tokens at their ids."""

import pytest
import torch

from glmrt.checkpoint.tokenizer import SPECIAL_TOKENS, special_token_ids
from glmrt.train.corpus import chat_stream
from glmrt.train.data import IGNORE, BatchStream, encode_chat, make_batch, train_tokenizer


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(1024)


def test_training_is_deterministic(tok):
    assert train_tokenizer(1024).to_str() == tok.to_str()


def test_special_tokens_keep_their_ids_and_stay_whole(tok):
    ids = special_token_ids(1024)
    assert tok.get_vocab_size() == 1024
    for name in SPECIAL_TOKENS:
        assert tok.token_to_id(name) == ids[name]
        assert tok.encode(name, add_special_tokens=False).ids == [ids[name]]


def test_digits_are_single_tokens(tok):
    enc = tok.encode("Ana has 9070 coins", add_special_tokens=False)
    assert [t for t in enc.tokens if any(ch.isdigit() for ch in t)] == ["9", "0", "7", "0"]


def test_chats_round_trip_and_segments_encode_as_the_whole_text(tok):
    for chat in chat_stream(0, 0, 200):
        ids, target = encode_chat(tok, chat)
        assert ids == tok.encode(chat.text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == chat.text
        assert any(target) and not target[0]


def test_batch_labels_are_the_output_tokens_shifted(tok):
    chats = chat_stream(0, 0, 3)
    batch = make_batch(tok, chats, 2000)
    ids, target = encode_chat(tok, chats[0])
    row = batch.labels[0].tolist()
    for t in range(len(ids) - 1):
        assert row[t] == (ids[t + 1] if target[t + 1] else IGNORE)
    mtp = batch.mtp_labels[0].tolist()
    for t in range(len(ids) - 2):
        assert mtp[t] == (ids[t + 2] if target[t + 2] else IGNORE)
    with pytest.raises(ValueError, match="exceeds the training length"):
        make_batch(tok, chats, 16)


def test_batch_stream_is_deterministic_length_sorted_and_bounded(tok):
    a, b = BatchStream(tok, 0, 8, 300), BatchStream(tok, 0, 8, 300)
    widths = []
    for step in range(8):
        x, y = a.batch(step), b.batch(step)
        assert torch.equal(x.input_ids, y.input_ids)
        assert x.input_ids.shape[1] <= 300
        widths.append(x.input_ids.shape[1])
    assert len(set(widths)) > 4  # batches of similar lengths, not all padded to the longest
    assert BatchStream(tok, 1, 8, 300).batch(0).input_ids.tolist() != a.batch(0).input_ids.tolist()


def test_batch_stream_workers_give_the_same_batches(tok):
    inline, ahead = BatchStream(tok, 0, 4, 300, window=2), BatchStream(tok, 0, 4, 300, window=2, workers=1)
    try:
        for step in range(7):  # four windows, built ahead by the worker
            assert torch.equal(inline.batch(step).input_ids, ahead.batch(step).input_ids)
            assert torch.equal(inline.batch(step).labels, ahead.batch(step).labels)
    finally:
        ahead.close()
    assert ahead._pool is None
