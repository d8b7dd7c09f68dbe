"""Offline inputs for Megatron-LM's `--sft`: a tiny Hugging Face tokenizer directory and a jsonl of
conversations in the format `SFTDataset` reads, both made here (no network, no download).

The tokenizer is a word-level `tokenizers` model wrapped in transformers' PreTrainedTokenizerFast
and saved with save_pretrained, so that Megatron's SFTTokenizer loads it with
`AutoTokenizer.from_pretrained(--tokenizer-model)`. It has the special tokens of Megatron's default
`--sft-tokenizer-prompt-format nemotron-h-aligned`: `<SPECIAL_10>` (system), `<SPECIAL_11>`
(user / assistant turns), `<SPECIAL_233>` (padding), plus `</s>` as end of document and `<unk>`.

Each jsonl line is `{"messages": [...]}`: 1-3 conversations packed into one list, each starting
with a system message (SFTDataset splits them there), 1-2 user/assistant turns. The language is
learnable: the user names two consecutive number words, the assistant continues the count. Every
line stays well under 128 tokens (the tests' --seq-length), so Megatron never truncates a pack
(core_v0.16.1's truncation branch calls `list.extend(int)` and fails).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

SPECIALS = ["<unk>", "</s>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_233>"]
ROLES = ["System", "User", "Assistant"]
NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
           "fifteen sixteen seventeen eighteen nineteen twenty").split()
SYSTEM = ["you count", "you are a counter", "count on please", "be brief"]
ASK = ["after", "continue", "what comes after", "next after"]


def words() -> list[str]:
    seen = dict.fromkeys(w for text in (*SYSTEM, *ASK) for w in text.split())
    return [*ROLES, *NUMBERS, *[w for w in seen if w not in NUMBERS]]


def write_tokenizer(path: Path) -> Path:
    """A word-level HF tokenizer directory (tokenizer.json, tokenizer_config.json)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *words()])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>",
                                   pad_token="<SPECIAL_233>", additional_special_tokens=["<SPECIAL_10>", "<SPECIAL_11>"])
    fast.save_pretrained(str(path))
    return path


def conversation(rng: random.Random) -> list[dict]:
    msgs = [{"role": "system", "content": rng.choice(SYSTEM)}]
    for _ in range(rng.randint(1, 2)):
        start = rng.randrange(len(NUMBERS) - 6)
        n = rng.randint(1, 4)
        msgs.append({"role": "user", "content": f"{rng.choice(ASK)} {NUMBERS[start]} {NUMBERS[start + 1]}"})
        msgs.append({"role": "assistant", "content": " ".join(NUMBERS[start + 2:start + 2 + n])})
    return msgs


def write_conversations(path: Path, lines: int = 300, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(lines):
            messages = [m for _ in range(rng.randint(1, 3)) for m in conversation(rng)]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path
