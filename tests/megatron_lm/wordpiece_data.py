"""Offline inputs for stock pretrain_bert.py / pretrain_t5.py: a WordPiece vocab file and an indexed
dataset of multi-sentence documents, both made here (no download, no nltk sentence splitter).

The language is learnable: each sentence counts up from a random number word ("seven eight nine
ten ..."), so a masked word follows from its neighbours, and the sentences of a document continue
each other (BERT's next-sentence head has something to learn too). Token ids are the vocab file's
line numbers, as Megatron's BertWordPiece tokenizer reads them; each sentence is one item of the
indexed dataset and each document ends with `end_document`, the layout `tools/preprocess_data.py
--split-sentences` writes and Megatron's masked WordPiece datasets read.
"""
from __future__ import annotations

import random
from pathlib import Path

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
           "fifteen sixteen seventeen eighteen nineteen twenty").split()


def write_vocab(path: Path) -> Path:
    path.write_text("\n".join([*SPECIALS, *NUMBERS]) + "\n")
    return path


def write_dataset(prefix: Path, documents: int = 400, seed: int = 0) -> Path:
    """prefix.bin / prefix.idx: `documents` documents of 2-5 sentences of 4-9 words."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    ids = {w: i for i, w in enumerate([*SPECIALS, *NUMBERS])}
    rng = random.Random(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.int32)
    for _ in range(documents):
        at = rng.randrange(len(NUMBERS))
        for _ in range(rng.randint(2, 5)):
            n = rng.randint(4, 9)
            words = [NUMBERS[(at + k) % len(NUMBERS)] for k in range(n)]
            at = (at + n) % len(NUMBERS)
            builder.add_item(torch.tensor([ids[w] for w in words], dtype=torch.int32))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


def write_hf_tokenizer(path: Path, vocab: Path, extra_ids: int = 10) -> Path:
    """The same vocab as a Hugging Face BertTokenizerFast directory, for core_v0.19's scripts, whose
    BertWordPiece tokenizer loads `bert-large-uncased` from the hub: `--tokenizer-type
    HuggingFaceTokenizer --tokenizer-model <path>`. [BOS] / [EOS] and T5's `<extra_id_N>` sentinels
    are added after the vocab (ids past the dataset's)."""
    from transformers import BertTokenizerFast

    tok = BertTokenizerFast(vocab_file=str(vocab), do_lower_case=True, bos_token="[BOS]", eos_token="[EOS]",
                            additional_special_tokens=[f"<extra_id_{i}>" for i in range(extra_ids)])
    tok.save_pretrained(str(path))
    return path
