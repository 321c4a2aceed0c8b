"""The GLM-5.3 special-token table and the tokenizer of generated checkpoints.

Owns the fixed 60-id block of special tokens at the top of the vocabulary, the id config a
checkpoint's config.json / generation_config.json must name, and a small byte-level BPE,
trained in memory from a built-in corpus, that a generated (random-weight) checkpoint ships
as tokenizer.json. Real checkpoints bring their own tokenizer; the special ids agree.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from glmrt.serving.chat_template import CHAT_TEMPLATE

NUM_SPECIAL_TOKENS = 60
MIN_VOCAB_SIZE = 512

# Order is the id offset from `vocab_size - NUM_SPECIAL_TOKENS`; it must never change.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
    "<|begin_of_audio|>", "<|end_of_audio|>",
    "<|begin_of_transcription|>", "<|end_of_transcription|>",
    "<|code_prefix|>", "<|code_middle|>", "<|code_suffix|>",
    "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "/nothink", "<|begin_of_box|>", "<|end_of_box|>", "<|image|>", "<|video|>",
    *(f"<|reserved_special_token_{k}|>" for k in range(24)),
)
assert len(SPECIAL_TOKENS) == NUM_SPECIAL_TOKENS
_SPECIAL_SPLIT = re.compile("|".join(re.escape(t) for t in sorted(SPECIAL_TOKENS, key=len, reverse=True)))

# NOTE: fillers pad the regular vocabulary when the corpus yields fewer merges than the
# vocab needs. The space makes them unreachable: after byte-level pre-tokenisation no piece
# contains a raw space, and no trained token can collide with one.
_FILLER = "<|unused {}|>"

# Training text: English prose, code, JSON and chat-like snippets, so the merges look like a
# real tokenizer's (common words, indentation, punctuation runs, UTF-8 multi-byte pieces).
# It must not contain any special token, or a merge could claim its string.
_CORPUS = r'''
The quick brown fox jumps over the lazy dog. A serving runtime reads a request, turns the
prompt into tokens, schedules the work on the accelerator and streams the answer back.
Each token of the answer is sampled from the model's distribution over the vocabulary.
Good tests are small, fast and deterministic; they fail for one reason and say which one.
When the cache is full, the scheduler waits for pages to be freed before it admits more
requests. The prefix cache lets two conversations that start the same way share memory.
Hello! How are you today? I'm fine, thanks for asking. Could you help me with something?
Sure, what do you need? I would like to write a function that sorts a list of numbers.
Of course. Here is a simple version in Python, and then we can talk about its complexity.
What is the capital of France? The capital of France is Paris, a city on the Seine river.
Please summarize the following article in three sentences, keeping the main argument.
Let me think about this step by step. First, we compute the total; then we divide by the
number of items to get the average. Finally, we round the result to two decimal places.
The weather today is sunny with a light breeze, and the temperature will reach 24 degrees.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 4096 65536 3.14159 2.71828 -1 1e-6.
Dates and times: 2024-05-17, 12:30:45, Monday, January, February, March, April, December.

def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class PageManager:
    def __init__(self, num_pages: int) -> None:
        self.free_pages = list(range(num_pages))
        self.ref_counts = [0] * num_pages

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free_pages):
            raise RuntimeError("out of pages")
        pages, self.free_pages = self.free_pages[:count], self.free_pages[count:]
        for page in pages:
            self.ref_counts[page] += 1
        return pages

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    hidden_size: int = 4096
    num_layers: int = 32
    vocab_size: int = 151552
    dtype: str = "bfloat16"


for i in range(10):
    print(f"step {i}: loss={0.5 / (i + 1):.4f}")

#include <stdio.h>
int main(int argc, char **argv) {
    for (int i = 0; i < argc; ++i) {
        printf("%d: %s\n", i, argv[i]);
    }
    return 0;
}

function add(a, b) { return a + b; }
const items = [1, 2, 3].map((x) => x * 2).filter((x) => x > 2);
console.log(JSON.stringify({ items, total: items.length }));

fn main() {
    let v: Vec<u32> = (0..10).collect();
    println!("{:?}", v.iter().sum::<u32>());
}

SELECT name, COUNT(*) AS total FROM users WHERE active = 1 GROUP BY name ORDER BY total DESC;

{"model": "glm", "messages": [{"role": "user", "content": "Hello"}], "stream": true}
{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius", "days": 3}}
{"type": "function", "function": {"name": "search", "parameters": {"type": "object",
 "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}}}

$ pip install -e . && pytest -q tests/
$ git log --oneline | head -n 5
<html><head><title>Example</title></head><body><p>Hello, world!</p></body></html>

# Notes
- Use small modules with one concern each.
- Prefer data over control flow; keep the hot path free of allocations.
* Bullet: the answer is **bold** and `code` stays code.

Le renard brun rapide saute par-dessus le chien paresseux. Où est la gare, s'il vous plaît ?
Der schnelle braune Fuchs springt über den faulen Hund. Grüße aus München!
El rápido zorro marrón salta sobre el perro perezoso. ¿Dónde está la biblioteca?
快速的棕色狐狸跳过了懒狗。今天天气很好，我们去公园散步吧。你好，世界！
素早い茶色の狐がのろまな犬を飛び越える。こんにちは、世界。
빠른 갈색 여우가 게으른 개를 뛰어넘는다. 안녕하세요!
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, мир!
Emoji: 😀 😂 🎉 👍 🚀 ❤️ ✅ — “quotes”, ‘single’, ellipsis… and € £ ¥ ° ± × ÷.
'''


def _check_vocab_size(vocab_size: int) -> int:
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be an int >= {MIN_VOCAB_SIZE} (256 byte symbols plus the "
            f"{NUM_SPECIAL_TOKENS} special tokens need room), got {vocab_size!r}"
        )
    return vocab_size - NUM_SPECIAL_TOKENS


def special_token_ids(vocab_size: int) -> dict[str, int]:
    """Maps each special token to its id for a vocabulary of `vocab_size`."""
    base = _check_vocab_size(vocab_size)
    return {name: base + offset for offset, name in enumerate(SPECIAL_TOKENS)}


def token_id_config(vocab_size: int) -> dict[str, Any]:
    """The token ids a checkpoint's config.json / generation_config.json must name."""
    ids = special_token_ids(vocab_size)
    return {
        "pad_token_id": ids["<|endoftext|>"],
        # Generation stops on any of these (docs/PROTOCOLS.md).
        "eos_token_id": [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]],
        "image_token_id": ids["<|image|>"],
        "video_token_id": ids["<|video|>"],
        "image_start_token_id": ids["<|begin_of_image|>"],
        "image_end_token_id": ids["<|end_of_image|>"],
        "video_start_token_id": ids["<|begin_of_video|>"],
        "video_end_token_id": ids["<|end_of_video|>"],
    }


def _pre_tokenizer(split_digits: bool, use_regex: bool = True):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    if not split_digits:
        return byte_level
    # every digit its own piece, so numbers are read and written digit by digit
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])


def _train_bpe(num_regular: int, lines: Iterable[str] | None, split_digits: bool) -> dict[str, Any]:
    """Trains a byte-level BPE of at most `num_regular` tokens; returns its model JSON."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = _pre_tokenizer(split_digits)
    trainer = trainers.BpeTrainer(
        vocab_size=num_regular,
        min_frequency=2,  # a merge seen once is noise; fillers take its place
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    if lines is None:
        lines = _CORPUS.splitlines(keepends=True)
    else:  # the special tokens are atomic: no merge may claim (part of) one
        lines = [piece for line in lines for piece in _SPECIAL_SPLIT.split(line) if piece]
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return json.loads(tokenizer.to_str())["model"]


def build_tokenizer(vocab_size: int, lines: Iterable[str] | None = None, *, split_digits: bool = False) -> Tokenizer:
    """Builds the byte-level BPE tokenizer for a vocabulary of exactly `vocab_size` ids.

    Regular tokens take ids 0..vocab_size-61 (trained merges, then unused fillers); the 60
    special tokens take the top ids at their fixed offsets. Deterministic, in memory. `lines`:
    the training text (default: the built-in corpus); `split_digits`: one token per digit.
    """
    num_regular = _check_vocab_size(vocab_size)
    model = _train_bpe(num_regular, lines, split_digits)
    vocab: dict[str, int] = model["vocab"]
    if sorted(vocab.values()) != list(range(len(vocab))) or len(vocab) > num_regular:
        raise RuntimeError("BPE trainer returned a vocabulary with holes or too many ids")
    # Editing the model JSON keeps the fillers inside the regular range; added tokens would
    # sit in the matching trie and slow every encode.
    for filler_id in range(len(vocab), num_regular):
        vocab[_FILLER.format(filler_id)] = filler_id
    bpe = models.BPE(vocab=vocab, merges=[tuple(m) for m in model["merges"]])

    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(split_digits)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} ids, expected {vocab_size}")
    for name, expected in special_token_ids(vocab_size).items():
        actual = tokenizer.token_to_id(name)
        if actual != expected:
            raise RuntimeError(f"special token {name!r} got id {actual}, expected {expected}")
    return tokenizer


def write_tokenizer(out_dir: str | Path, vocab_size: int, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json to `out_dir`.

    The files load with transformers' AutoTokenizer. `tokenizer`: the one to write (default:
    `build_tokenizer(vocab_size)`). Returns `token_id_config(vocab_size)`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (tokenizer or build_tokenizer(vocab_size)).save(str(out / "tokenizer.json"))

    def added(content: str) -> dict[str, Any]:
        return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                "single_word": False, "special": True}

    eos = "<|endoftext|>"
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(token_id): added(name) for name, token_id in special_token_ids(vocab_size).items()
        },
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != eos],
        "bos_token": None,
        "eos_token": eos,
        "pad_token": eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {
        "eos_token": eos,
        "pad_token": eos,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != eos],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, ensure_ascii=False) + "\n")
    return token_id_config(vocab_size)
