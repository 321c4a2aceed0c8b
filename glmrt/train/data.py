"""Tokenizer and batches for training: the corpus's chats as token ids with loss masks.

The tokenizer is a byte-level BPE trained on the corpus itself (digits split into single
tokens), with the GLM-5.3 special tokens at their fixed ids (glmrt/checkpoint/tokenizer.py).
A batch holds B chats right-padded to one length; the loss is taken on the model's own output
tokens only: the next token (main head) and the token after it (the MTP layer).
"""

from __future__ import annotations

import multiprocessing
import random
from collections import deque
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from glmrt.checkpoint.tokenizer import build_tokenizer, special_token_ids
from glmrt.train.corpus import Chat, chat_stream, tokenizer_text

IGNORE = -100


def train_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    return build_tokenizer(vocab_size, tokenizer_text(seed), split_digits=True)


def encode_chat(tok: Tokenizer, chat: Chat) -> tuple[list[int], list[bool]]:
    """Token ids of the chat and, per token, whether it is the model's output. Segments start or
    end at special tokens, so encoding them one by one gives the ids of the whole text."""
    ids: list[int] = []
    target: list[bool] = []
    for enc, (_, is_out) in zip(tok.encode_batch([t for t, _ in chat.segments], add_special_tokens=False),
                                chat.segments):
        ids += enc.ids
        target += [is_out] * len(enc.ids)
    return ids, target


@dataclass
class Batch:
    input_ids: torch.Tensor   # [B, T]
    labels: torch.Tensor      # [B, T] token t+1 where it is an output token, else IGNORE
    mtp_labels: torch.Tensor  # [B, T] token t+2 where it is an output token, else IGNORE
    num_tokens: int           # real (unpadded) tokens

    def to(self, device) -> "Batch":
        return Batch(self.input_ids.to(device), self.labels.to(device), self.mtp_labels.to(device), self.num_tokens)


def make_batch(tok: Tokenizer, chats: list[Chat], max_len: int) -> Batch:
    pad = special_token_ids(tok.get_vocab_size())["<|endoftext|>"]
    rows = [encode_chat(tok, c) for c in chats]
    too_long = [len(ids) for ids, _ in rows if len(ids) > max_len]
    if too_long:
        raise ValueError(f"a chat of {max(too_long)} tokens exceeds the training length {max_len}")
    width = max(len(ids) for ids, _ in rows)
    ids_t = torch.full((len(rows), width), pad, dtype=torch.long)
    out_t = torch.zeros((len(rows), width), dtype=torch.bool)
    for r, (ids, target) in enumerate(rows):
        ids_t[r, : len(ids)] = torch.tensor(ids)
        out_t[r, : len(ids)] = torch.tensor(target)
    labels = torch.full_like(ids_t, IGNORE)
    labels[:, :-1] = torch.where(out_t[:, 1:], ids_t[:, 1:], IGNORE)
    mtp = torch.full_like(ids_t, IGNORE)
    mtp[:, :-2] = torch.where(out_t[:, 2:], ids_t[:, 2:], IGNORE)
    return Batch(ids_t, labels, mtp, sum(len(ids) for ids, _ in rows))


class BatchStream:
    """The training batches of the corpus of `seed`, by step: the same chats for the same step.

    Chats are drawn `window` batches at a time, sorted by length and cut into batches (in an
    order shuffled by the seed), so a batch pads to little more than its own chats' lengths.
    Chats longer than `max_len` tokens are left out.

    With `workers` > 0, windows ahead of the one being trained on are built by that many
    processes (generating and encoding a window of 8 x 256 chats takes about 2 s of one core,
    longer than the device needs to train on it); a window's batches are the same either way.
    Read batches in step order when workers are on (`close` ends them).
    """

    def __init__(self, tok: Tokenizer, seed: int, batch_size: int, max_len: int, window: int = 8,
                 workers: int = 0):
        self.tok, self.seed, self.batch_size, self.max_len, self.window = tok, seed, batch_size, max_len, window
        self._cached: tuple[int, list[Batch]] | None = None
        self._pool = None
        self._ahead: deque[tuple[int, object]] = deque()
        self._workers = workers
        if workers > 0:
            # spawn: the trainer may already hold a CUDA context, which a forked child must not inherit
            ctx = multiprocessing.get_context("spawn")
            self._pool = ctx.Pool(workers, initializer=_worker_init, initargs=(tok.to_str(),))

    def _window(self, w: int) -> list[Batch]:
        if self._cached is None or self._cached[0] != w:
            if self._pool is None:
                batches = _build_window(self.tok, self.seed, self.batch_size, self.max_len, self.window, w)
            else:
                while self._ahead and self._ahead[0][0] < w:
                    self._ahead.popleft()
                if not self._ahead or self._ahead[0][0] != w:
                    self._ahead.clear()
                nxt = self._ahead[-1][0] + 1 if self._ahead else w
                while len(self._ahead) < 2 * self._workers:
                    self._ahead.append((nxt, self._pool.apply_async(
                        _worker_window, (self.seed, self.batch_size, self.max_len, self.window, nxt))))
                    nxt += 1
                batches = self._ahead.popleft()[1].get()
            self._cached = (w, batches)
        return self._cached[1]

    def batch(self, step: int) -> Batch:
        batch = self._window(step // self.window)[step % self.window]
        if batch is None:
            raise ValueError(f"no chat of step {step} fits in {self.max_len} tokens")
        return batch

    def close(self) -> None:
        if self._pool is not None:
            # Let the windows in flight finish first: terminate() with results outstanding races
            # with the pool's own result thread (CPython raises "Cannot have cache with
            # result_hander not alive"); a window takes seconds at most.
            for _, pending in self._ahead:
                pending.wait()
            self._ahead.clear()
            self._pool.close()
            self._pool.join()
            self._pool = None


def _build_window(tok: Tokenizer, seed: int, batch_size: int, max_len: int, window: int, w: int) -> list[Batch | None]:
    n = window * batch_size
    chats = chat_stream(seed, w * n, n)
    lens = [sum(len(e.ids) for e in tok.encode_batch([t for t, _ in c.segments], add_special_tokens=False))
            for c in chats]
    order = sorted((i for i in range(n) if lens[i] <= max_len), key=lambda i: lens[i])
    groups = [[chats[i] for i in order[b * len(order) // window:(b + 1) * len(order) // window]]
              for b in range(window)]
    random.Random(f"{seed}:window:{w}").shuffle(groups)
    return [make_batch(tok, g, max_len) if g else None for g in groups]


_worker_tok: Tokenizer | None = None


def _worker_init(tok_json: str) -> None:
    global _worker_tok
    import torch as _torch
    _torch.set_num_threads(1)
    _worker_tok = Tokenizer.from_str(tok_json)


def _worker_window(seed: int, batch_size: int, max_len: int, window: int, w: int) -> list[Batch | None]:
    return _build_window(_worker_tok, seed, batch_size, max_len, window, w)
