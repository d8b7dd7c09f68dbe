"""LAMBADA evaluation, the parts that need no Megatron-LM checkout: jsonl reading, cloze targets,
batching, scoring, the vocab-parallel greedy prediction, the progress bar, and the test's byte-level
BPE tokenizer files (tests/lambada_corpus.py). The end-to-end runs are in
tests/megatron_lm/test_evaluate_lambada.py."""
import io
import json
import math
import os
import tempfile

import pytest
import torch

import lambada_corpus as corpus
from megatron_adapt.apps import lambada
from megatron_adapt.apps.evaluate_lambada import greedy_hits


def _jsonl(tmp_path, lines):
    p = tmp_path / "l.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(p)


def test_read_jsonl(tmp_path):
    path = _jsonl(tmp_path, ['{"text": "a b c"}', "", '{"text": "d e", "id": 3}'])
    assert lambada.read_jsonl(path) == ["a b c", "d e"]


@pytest.mark.parametrize("line, message", [
    ('{"text": "a b"', "l.jsonl:2: not valid JSON"),
    ('["a b"]', 'l.jsonl:2: expected an object with a "text" field'),
    ('{"txt": "a b"}', 'l.jsonl:2: expected an object with a "text" field'),
    ('{"text": "  "}', 'l.jsonl:2: "text" must be a non-empty string'),
    ('{"text": 3}', 'l.jsonl:2: "text" must be a non-empty string'),
])
def test_read_jsonl_rejects_bad_lines(tmp_path, line, message):
    with pytest.raises(lambada.LambadaDataError, match=message):
        lambada.read_jsonl(_jsonl(tmp_path, ['{"text": "ok fine"}', line]))


def test_read_jsonl_empty_file(tmp_path):
    with pytest.raises(lambada.LambadaDataError, match="no passages"):
        lambada.read_jsonl(_jsonl(tmp_path, [""]))


def test_split_cloze_is_megatrons_strict_split():
    assert lambada.split_cloze("he saw the dog .  then the dog") == ("he saw the dog .  then the", "dog")
    # the last word's last occurrence is what is cut, trailing whitespace ignored
    assert lambada.split_cloze("x y  x \n") == ("x y", "x")
    with pytest.raises(lambada.LambadaDataError, match="context and a last word"):
        lambada.split_cloze("lonely")


def _char_tokenize(text):
    return [ord(c) for c in text]


def test_tokenize_examples_target_has_leading_space_and_truncates_left():
    ex = lambada.tokenize_examples(["ab cd"], _char_tokenize, seq_length=16)[0]
    assert ex.context == [ord("a"), ord("b")] and ex.target == [ord(" "), ord("c"), ord("d")]
    assert not ex.truncated
    ex = lambada.tokenize_examples(["abcdefgh ij"], _char_tokenize, seq_length=5)[0]
    assert ex.target == _char_tokenize(" ij") and ex.context == _char_tokenize("fgh") and ex.truncated
    assert len(ex.context) + len(ex.target) == 5 + 1
    with pytest.raises(lambada.LambadaDataError, match="too long for --seq-length 2"):
        lambada.tokenize_examples(["a bcd"], _char_tokenize, seq_length=2)


def test_make_batch_aligns_mask_with_target_labels():
    ex = lambada.Example(context=[1, 2, 3], target=[7, 8])
    b = lambada.make_batch([ex], seq_length=6, micro_batch=2, pad_id=0)
    assert b.rows == 1
    assert b.tokens == [[1, 2, 3, 7, 8, 0], [0] * 6]
    assert b.labels == [[2, 3, 7, 8, 0, 0], [0] * 6]
    assert b.loss_mask == [[0, 0, 1, 1, 0, 0], [0] * 6]
    # the masked labels are exactly the target
    assert [l for l, m in zip(b.labels[0], b.loss_mask[0]) if m] == ex.target
    with pytest.raises(ValueError):
        lambada.make_batch([ex] * 3, seq_length=6, micro_batch=2, pad_id=0)


def test_shard_batches_covers_every_example_once_with_equal_counts():
    exs = [lambada.Example([i + 1], [100 + i]) for i in range(7)]
    shards = [lambada.shard_batches(exs, 4, 2, 0, r, 3) for r in range(3)]
    assert len({len(s) for s in shards}) == 1   # collectives stay in step
    seen = sorted(l for s in shards for b in s for row, m in zip(b.labels, b.loss_mask)
                  for l, k in zip(row, m) if k)
    assert seen == [100 + i for i in range(7)]
    assert sum(b.rows for s in shards for b in s) == 7
    with pytest.raises(ValueError):
        lambada.shard_batches(exs, 4, 2, 0, 3, 3)


def test_score_rows():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 0], [1, 0, 0, 0]])
    hits = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 1], [1, 1, 1, 1]])   # wrong outside the mask is fine
    nll = torch.tensor([[9., 0.5, 0.25, 9.], [9., 9., 2., 9.], [1., 9., 9., 9.]])
    assert lambada.score_rows(hits, nll, mask, rows=2) == (1, 2.75, 3)   # row 2 is padding
    assert lambada.score_rows(hits, nll, mask, rows=3) == (2, 3.75, 4)
    with pytest.raises(ValueError, match="no target positions"):
        lambada.score_rows(hits, nll, torch.zeros_like(mask), rows=1)


def test_scores_definitions():
    s = lambada.Scores(correct=3, examples=4, nll_sum=math.log(2) * 10, target_tokens=10)
    assert s.accuracy == 0.75 and s.perplexity == pytest.approx(2.0)
    d = s.as_dict()
    assert d["accuracy"] == 0.75 and d["perplexity"] == pytest.approx(2.0) and d["correct"] == 3


def test_progress_fallback_bar(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_tqdm(name, *a, **k):
        if name == "tqdm":
            raise ImportError("no tqdm")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    out = io.StringIO()
    assert list(lambada.progress(range(3), 3, "L", stream=out)) == [0, 1, 2]
    assert out.getvalue().endswith("3/3\n") and "0/3" in out.getvalue()
    quiet = io.StringIO()
    assert list(lambada.progress(range(2), 2, "L", enabled=False, stream=quiet)) == [0, 1]
    assert quiet.getvalue() == ""


def _greedy_worker(rank, world, init_file, logits, labels, out):
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                         world_size=world)
    shard = logits.chunk(world, dim=-1)[rank].contiguous()
    hits = greedy_hits(shard, labels, None, rank)
    torch.save(hits, f"{out}.{rank}")
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_greedy_hits_is_argmax_of_the_whole_vocabulary(world):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 8, generator=g)
    logits[0, 0] = 1.0                      # a tie across the two shards: argmax takes index 0
    logits[1, 1, 2] = logits[1, 1, 6] = 9.0  # and index 2, the first one
    labels = logits.argmax(-1)
    labels[0, 1] = (labels[0, 1] + 1) % 8   # one miss
    expected = logits.argmax(-1) == labels
    with tempfile.TemporaryDirectory() as d:
        torch.multiprocessing.spawn(_greedy_worker, args=(world, os.path.join(d, "init"), logits, labels,
                                                          os.path.join(d, "hits")), nprocs=world)
        for r in range(world):
            assert torch.equal(torch.load(os.path.join(d, f"hits.{r}")), expected)


# ---- the test's tokenizer files --------------------------------------------------------------

def test_bpe_files_are_gpt2_format_and_round_trip(tmp_path):
    texts = corpus.make_passages(200, seed=1)
    vocab, merges = corpus.train_bpe(texts, 60)
    vf, mf = corpus.write_tokenizer(str(tmp_path), vocab, merges)
    lines = open(mf, encoding="utf-8").read().split("\n")
    assert lines[0] == "#version: 0.2" and lines[-1] == "" and len(lines) == 60 + 2
    loaded = json.load(open(vf, encoding="utf-8"))
    assert loaded == vocab and len(vocab) == 256 + 60 + 1
    assert sorted(vocab.values()) == list(range(len(vocab))) and vocab[corpus.EOT] == len(vocab) - 1
    for line in lines[1:-1]:
        a, b = line.split(" ")
        assert a in vocab and b in vocab and a + b in vocab
    # the byte alphabet covers any text, so encoding round-trips, unseen characters included
    for text in texts[:20] + [" Zebra: 3 ½ ünïcode\ttabs  ", "é"]:
        assert corpus.decode(corpus.encode(text, vocab, merges), vocab) == text
    # merges do their job: frequent words of the corpus become few tokens
    assert len(corpus.encode(" the", vocab, merges)) == 1
    assert len(corpus.encode(texts[0], vocab, merges)) < 0.7 * len(texts[0].encode())


def test_bpe_merges_are_deterministic_and_most_frequent_first():
    vocab, merges = corpus.train_bpe(["aa aa aa ab"], 2)
    assert merges[0] == ("a", "a")               # 3 occurrences beat ("a", "b") and ("Ġ", "a")...
    assert corpus.train_bpe(["aa aa aa ab"], 2) == (vocab, merges)
    with pytest.raises(ValueError, match="corpus too small"):
        corpus.train_bpe(["ab"], 5)


def test_corpus_is_lambada_jsonl(tmp_path):
    paths = corpus.build(str(tmp_path), train_passages=50, test_passages=10)
    texts = lambada.read_jsonl(paths["lambada"])
    assert len(texts) == 10 and len(lambada.read_jsonl(paths["train"])) == 50
    for t in texts:   # the last word is an object mentioned earlier in the passage
        context, word = lambada.split_cloze(t)
        assert word in corpus.OBJECTS and word in context.split()
    vocab = json.load(open(paths["vocab"], encoding="utf-8"))
    # Megatron pads 457 to 512 at TP=1 (multiple of 128) and at TP=2 (of 256): checkpoints reshard
    assert len(vocab) == 457
