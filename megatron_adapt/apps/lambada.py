"""LAMBADA cloze evaluation: the parts that need neither Megatron nor a device.

Reading LAMBADA's jsonl, cutting each passage into context + last word (strict, as Megatron-LM's
old ``tasks/zeroshot_gpt`` did with ``--strict-lambada``), packing examples into fixed-size
micro-batches, adding up the scores, and a progress bar. ``megatron_adapt.apps.evaluate_lambada`` runs
the model over these batches through Megatron.

Definitions (docs/evaluation.md):

* an example is correct when every token of its last word, tokenised with its leading space, is the
  model's greedy (argmax) prediction given the gold context and the gold earlier tokens of the word;
* accuracy = correct examples / examples;
* perplexity = exp(sum of the target tokens' negative log-likelihoods / number of target tokens),
  the target tokens being those of the last words only, over all examples.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, List, Sequence


class LambadaDataError(ValueError):
    """The cloze file or one of its passages cannot be evaluated."""


def read_jsonl(path: str) -> List[str]:
    """The ``text`` of every line of a LAMBADA-style jsonl file (``{"text": ...}`` per line).

    Blank lines are skipped; anything else that is not an object with a non-empty string ``text``
    raises, naming the file and line."""
    texts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise LambadaDataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or "text" not in obj:
                raise LambadaDataError(f'{path}:{lineno}: expected an object with a "text" field')
            text = obj["text"]
            if not isinstance(text, str) or not text.strip():
                raise LambadaDataError(f'{path}:{lineno}: "text" must be a non-empty string')
            texts.append(text)
    if not texts:
        raise LambadaDataError(f"{path}: no passages")
    return texts


def split_cloze(text: str) -> tuple[str, str]:
    """(context, last word) of a passage, as Megatron's strict LAMBADA: the last whitespace-separated
    word, and everything before its last occurrence, stripped. The word is tokenised as ' ' + word."""
    words = text.split()
    if len(words) < 2:
        raise LambadaDataError(f"passage needs a context and a last word: {text!r}")
    last = words[-1]
    return text[: text.rfind(last)].strip(), last


@dataclass
class Example:
    context: List[int]
    target: List[int]
    truncated: bool = False   # context cut on the left to fit the sequence length


def tokenize_examples(texts: Sequence[str], tokenize: Callable[[str], List[int]],
                      seq_length: int) -> List[Example]:
    """Context and target token ids of each passage. An example uses seq_length + 1 tokens (inputs
    are all but the last, labels all but the first); a longer context loses its oldest tokens, and a
    target that alone does not fit raises."""
    examples = []
    for i, text in enumerate(texts):
        context, word = split_cloze(text)
        ctx, tgt = list(tokenize(context)), list(tokenize(" " + word))
        if not ctx or not tgt:
            raise LambadaDataError(f"passage {i}: empty context or target after tokenisation: {text!r}")
        room = seq_length + 1 - len(tgt)
        if room < 1:
            raise LambadaDataError(f"passage {i}: its last word is {len(tgt)} tokens, too long for "
                                   f"--seq-length {seq_length}")
        examples.append(Example(ctx[-room:], tgt, truncated=len(ctx) > room))
    return examples


@dataclass
class Batch:
    tokens: List[List[int]]      # [micro_batch, seq_length] model inputs
    labels: List[List[int]]      # [micro_batch, seq_length] next tokens
    loss_mask: List[List[int]]   # 1 on the positions whose label is a target token
    rows: int                    # rows that are real examples (the rest is padding, mask 0)


def make_batch(examples: Sequence[Example], seq_length: int, micro_batch: int, pad_id: int) -> Batch:
    """One micro-batch of fixed shape [micro_batch, seq_length] (pipeline parallelism needs fixed
    shapes), right-padded with pad_id; rows beyond len(examples) are all padding."""
    if len(examples) > micro_batch:
        raise ValueError(f"{len(examples)} examples for a micro-batch of {micro_batch}")
    tokens, labels, mask = [], [], []
    for ex in examples:
        full = ex.context + ex.target
        n_pad = seq_length + 1 - len(full)
        seq = full + [pad_id] * n_pad
        m = [0] * (len(ex.context) - 1) + [1] * len(ex.target) + [0] * n_pad
        tokens.append(seq[:-1])
        labels.append(seq[1:])
        mask.append(m)
    for _ in range(micro_batch - len(examples)):
        tokens.append([pad_id] * seq_length)
        labels.append([pad_id] * seq_length)
        mask.append([0] * seq_length)
    return Batch(tokens, labels, mask, len(examples))


def shard_batches(examples: Sequence[Example], seq_length: int, micro_batch: int, pad_id: int,
                  dp_rank: int = 0, dp_size: int = 1) -> List[Batch]:
    """This data-parallel rank's micro-batches: examples dp_rank, dp_rank + dp_size, ...; every rank
    gets the same number of batches (collectives stay in step), padded with empty rows."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} outside 0..{dp_size - 1}")
    mine = list(examples[dp_rank::dp_size])
    n_batches = math.ceil(math.ceil(len(examples) / dp_size) / micro_batch)
    return [make_batch(mine[i * micro_batch:(i + 1) * micro_batch], seq_length, micro_batch, pad_id)
            for i in range(n_batches)]


@dataclass
class Scores:
    correct: int = 0
    examples: int = 0
    nll_sum: float = 0.0
    target_tokens: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def accuracy(self) -> float:
        return self.correct / self.examples if self.examples else float("nan")

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.target_tokens) if self.target_tokens else float("nan")

    def as_dict(self) -> dict:
        return {"accuracy": self.accuracy, "perplexity": self.perplexity, "correct": self.correct,
                "examples": self.examples, "nll_sum": self.nll_sum,
                "target_tokens": self.target_tokens, **self.extra}


def score_rows(hits, nll, loss_mask, rows: int) -> tuple[int, float, int]:
    """(correct examples, NLL sum, target tokens) of the first `rows` rows of a micro-batch.

    hits: [b, s] 1 where the greedy prediction equals the label; nll: [b, s] per-position negative
    log-likelihood; loss_mask: [b, s] 1 on target positions (torch tensors). A row is correct when
    every target position is a hit. The NLL is summed in float64."""
    import torch

    mask = loss_mask[:rows].bool()
    if rows and not bool(mask.any(-1).all()):
        raise ValueError("a real row of the batch has no target positions")
    hit = hits[:rows].bool() | ~mask
    n_correct = int(hit.all(-1).sum())
    nll_sum = float((nll[:rows].double() * mask).sum())
    return n_correct, nll_sum, int(mask.sum())


def progress(items: Iterable, total: int, desc: str, enabled: bool = True,
             stream=None) -> Iterator:
    """tqdm when it is installed, else a one-line bar on stderr; nothing when not enabled."""
    if not enabled:
        yield from items
        return
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        yield from tqdm(items, total=total, desc=desc, file=stream or sys.stderr)
        return
    stream = stream or sys.stderr
    width = 30

    def draw(done):
        filled = width * done // max(total, 1)
        stream.write(f"\r{desc}: [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        stream.flush()

    draw(0)
    done = 0
    for item in items:
        yield item
        done += 1
        draw(done)
    stream.write("\n")
    stream.flush()
