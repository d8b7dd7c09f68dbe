"""Test data for the LAMBADA evaluation, made here because no data set can be downloaded:

* a synthetic corpus of cloze passages in LAMBADA's jsonl format (``{"text": ...}`` per line) whose
  last word is recoverable from the context: it names an object mentioned earlier, and each place
  holds one of two objects only, so that a tiny model trained briefly learns part of it (the place
  narrows the choice to two) before it learns to copy;
* a byte-level BPE tokenizer in GPT-2's file format (``vocab.json`` + ``merges.txt``), trained on
  that corpus by the classic BPE procedure, loadable by Megatron's GPT2BPETokenizer;
* ``encode``: GPT-2's BPE encoding of a text with those files (the reference the unit tests compare
  Megatron's tokenizer with).

Also a command: ``python tests/lambada_corpus.py DIR`` writes train.jsonl, lambada.jsonl, vocab.json
and merges.txt into DIR.
"""
from __future__ import annotations

import collections
import json
import os
import random
import sys

import regex

# GPT-2's pre-tokenisation pattern (the one in Megatron-LM's gpt2_tokenization.py and OpenAI's encoder.py)
GPT2_PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
EOT = "<|endoftext|>"

NAMES = ["anna", "boris", "clara", "david", "elena", "felix", "grace", "henry", "irene", "jonas",
         "karin", "louis", "maria", "nora", "oscar", "paula"]
PLACES = ["market", "harbour", "library", "garden", "station", "kitchen", "museum", "forest"]
OBJECTS = ["lantern", "basket", "violin", "compass", "blanket", "kettle", "ladder", "mirror",
           "hammer", "pillow", "bottle", "candle", "saddle", "wallet", "helmet", "shovel"]
TEMPLATES = [
    "{n} went to the {p} with a {o} . after a long day at the {p} , {n} could not find the {o}",
    "at the {p} {n} bought a {o} and a {o2} . the next morning {n} gave away the {o}",
    "{n} and {m} carried a heavy {o} to the {p} . when they arrived , {m} dropped the {o}",
    "in the {p} there was an old {o} . {n} looked at it for a while and then painted the {o}",
]


def make_passages(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        n1, n2 = rng.sample(NAMES, 2)
        i = rng.randrange(len(PLACES))
        o1 = OBJECTS[2 * i + rng.randrange(2)]
        o2 = rng.choice([o for o in OBJECTS if o != o1])
        out.append(rng.choice(TEMPLATES).format(n=n1, m=n2, p=PLACES[i], o=o1, o2=o2))
    return out


def write_jsonl(path: str, texts: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _words(text: str) -> list[str]:
    b2u = bytes_to_unicode()
    return ["".join(b2u[b] for b in w.encode("utf-8")) for w in GPT2_PATTERN.findall(text)]


def train_bpe(texts: list[str], num_merges: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE: start from the 256 byte symbols, merge the most frequent adjacent pair
    (ties: the lexicographically smallest) num_merges times. Returns (vocab, merges) in GPT-2's
    format: vocab = the 256 byte symbols, then each merge's result, then <|endoftext|>."""
    counts = collections.Counter(w for t in texts for w in _words(t))
    words = {tuple(w): c for w, c in counts.items()}
    merges = []
    for _ in range(num_merges):
        pairs = collections.Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += c
        if not pairs:
            raise ValueError(f"corpus too small: only {len(merges)} merges possible")
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged = {}
        for w, c in words.items():
            out = _merge_pair(w, best)
            merged[out] = merged.get(out, 0) + c
        words = merged
    vocab = {s: i for i, s in enumerate(bytes_to_unicode().values())}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    vocab[EOT] = len(vocab)
    return vocab, merges


def _merge_pair(symbols, pair) -> tuple:
    """symbols with every adjacent occurrence of `pair` joined into one symbol, left to right."""
    out, i = [], 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)


def write_tokenizer(directory: str, vocab: dict[str, int], merges: list[tuple[str, str]]) -> tuple[str, str]:
    vocab_file, merge_file = os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(merge_file, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        f.writelines(f"{a} {b}\n" for a, b in merges)
    return vocab_file, merge_file


def encode(text: str, vocab: dict[str, int], merges: list[tuple[str, str]]) -> list[int]:
    """GPT-2 BPE encoding: per pre-tokenised word, repeatedly merge the pair of lowest merge rank."""
    ranks = {m: i for i, m in enumerate(merges)}
    ids = []
    for w in _words(text):
        parts = list(w)
        while len(parts) > 1:
            pair = min(zip(parts, parts[1:]), key=lambda p: ranks.get(p, float("inf")))
            if pair not in ranks:
                break
            parts = _merge_pair(parts, pair)
        ids.extend(vocab[p] for p in parts)
    return ids


def decode(ids: list[int], vocab: dict[str, int]) -> str:
    inv = {i: s for s, i in vocab.items()}
    u2b = {u: b for b, u in bytes_to_unicode().items()}
    return bytes(u2b[c] for i in ids for c in inv[i]).decode("utf-8")


# 256 bytes + 200 merges + <|endoftext|> = 457 tokens: Megatron pads the vocabulary to 512 both at
# TP=1 (multiple of 128) and TP=2 (multiple of 256), so checkpoints load at either.
NUM_MERGES = 200


def build(directory: str, train_passages: int = 2000, test_passages: int = 64) -> dict[str, str]:
    """Writes the training corpus, the cloze test file and the tokenizer into directory."""
    os.makedirs(directory, exist_ok=True)
    train, test = make_passages(train_passages, seed=1), make_passages(test_passages, seed=2)
    paths = {"train": os.path.join(directory, "train.jsonl"),
             "lambada": os.path.join(directory, "lambada.jsonl")}
    write_jsonl(paths["train"], train)
    write_jsonl(paths["lambada"], test)
    vocab, merges = train_bpe(train, NUM_MERGES)
    paths["vocab"], paths["merges"] = write_tokenizer(directory, vocab, merges)
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/lambada_corpus.py DIR")
    print(json.dumps(build(sys.argv[1]), indent=1))
