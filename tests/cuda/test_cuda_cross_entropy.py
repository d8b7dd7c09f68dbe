"""Fused vocab-parallel cross entropy vs an fp64 reference: TP=1 on the device, TP=2 over gloo."""
import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from _cuda_helpers import DEVICE, GPU, assert_close, ran_impl, reset
from megatron_adapt.backends.cuda import cross_entropy as ce

# (tokens, vocab): odd vocab, Llama-2 (32000) and Llama-3 (128256) vocabularies.
SHAPES = [(2048, 32000), (1024, 128256), (333, 50257)] if GPU else \
    [(12, 37), (4, 32000), (2, 128256)]


def reference(logits, target, smoothing, vocab=None):
    """fp64 loss and d(loss . g)/dlogits, Megatron's label smoothing with global K."""
    x = logits.double()
    vocab = vocab or x.size(-1)
    logp = torch.log_softmax(x, -1)
    nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    s = smoothing * vocab / (vocab - 1) if smoothing else 0.0
    loss = (1 - s) * nll - s * logp.mean(-1)
    onehot = torch.nn.functional.one_hot(target, x.size(-1)).double()
    grad = torch.softmax(x, -1) - (1 - s) * onehot - s / vocab
    return loss, grad


@pytest.mark.parametrize("tokens,vocab", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy(tokens, vocab, dtype, smoothing):
    torch.manual_seed(vocab + tokens)
    logits = (torch.randn(tokens, vocab, device=DEVICE) * 4).to(dtype)
    target = torch.randint(0, vocab, (tokens,), device=DEVICE)
    g = torch.rand(tokens, device=DEVICE)
    ref_loss, ref_grad = reference(logits, target, smoothing)
    leaf = logits.clone().requires_grad_()
    inp = leaf * 1  # non-leaf: the backward writes into this buffer
    reset()
    loss = ce.vocab_parallel_cross_entropy(inp, target, smoothing)
    assert loss.dtype == torch.float32 and ran_impl("vocab_parallel_cross_entropy") == {ce.IMPL}
    loss.backward(g)
    assert_close(loss, ref_loss, torch.float32, "loss", scale=5.0)
    assert_close(leaf.grad, ref_grad * g.double().unsqueeze(-1), dtype, "grad", scale=2.0)


def test_leaf_logits_are_not_overwritten_and_3d_shapes():
    logits = torch.randn(3, 2, 50, device=DEVICE, requires_grad=True)
    keep = logits.detach().clone()
    target = torch.randint(0, 50, (3, 2), device=DEVICE)
    loss = ce.vocab_parallel_cross_entropy(logits, target)
    assert loss.shape == (3, 2)
    loss.sum().backward()
    assert torch.equal(logits.detach(), keep)
    ref_loss, ref_grad = reference(keep, target, 0.0)
    assert_close(loss, ref_loss, torch.float32)
    assert_close(logits.grad, ref_grad, torch.float32)


@pytest.mark.parametrize("split", [1, 3])
def test_the_loss_can_be_scaled_in_place_as_megatrons_schedules_do(split, monkeypatch):
    """Megatron's loss path: compute_language_model_loss returns `loss.transpose(0, 1).contiguous()`
    (a view when the micro-batch is 1), and forward_step scales it in place
    (`output_tensor *= cp_group_size`). Autograd refuses that on a view a custom Function made,
    so the op's output must be a tensor of its own (it was `loss.view(target.shape)`; found by
    Megatron's test_pipeline_layout.py::test_forward_vpp at 2 ranks)."""
    monkeypatch.setattr(ce, "SPLIT", split)
    seq, vocab = (6, 9000) if not GPU else (64, 50257)
    torch.manual_seed(split)
    logits = torch.randn(seq, 1, vocab, device=DEVICE) * 4
    target = torch.randint(0, vocab, (seq, 1), device=DEVICE)
    ref_loss, ref_grad = reference(logits, target, 0.0)
    inp = logits.clone().requires_grad_()
    loss = ce.vocab_parallel_cross_entropy(inp * 1, target)
    assert loss._base is None
    out = loss.transpose(0, 1).contiguous()   # [s, 1] -> [1, s]: already contiguous, a view
    out *= 2.0
    out.sum().backward()
    assert_close(out, 2 * ref_loss.transpose(0, 1), torch.float32, "loss", scale=5.0)
    assert_close(inp.grad, 2 * ref_grad, torch.float32, "grad", scale=2.0)


def test_second_backward_through_consumed_buffer_raises():
    x = torch.randn(4, 10, device=DEVICE, requires_grad=True) * 1
    loss = ce.vocab_parallel_cross_entropy(x, torch.zeros(4, dtype=torch.long, device=DEVICE))
    loss.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.sum().backward()


TP_SHAPES = [(6, 2 * 33)] + ([(1024, 32000)] if torch.cuda.device_count() >= 2 else [])


@pytest.mark.parametrize("tokens,vocab", TP_SHAPES)
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_tp2(smoothing, tokens, vocab):
    """TP=2: each rank holds half the vocabulary; loss and gradient slices match the full-vocab
    reference, with label smoothing over the global vocabulary. NCCL on 2 GPUs (then also at
    vocabulary 32000), else gloo."""
    import _cuda_tp_worker

    torch.manual_seed(7)
    world = 2
    logits = torch.randn(2, tokens // 2, vocab) * 3
    if tokens == 6:  # targets in both halves, so both ranks contribute the predicted logit
        target = torch.tensor([[0, 40, 65], [32, 33, 1]])
    else:
        target = torch.randint(0, vocab, (2, tokens // 2))
    g = torch.rand(2, tokens // 2)
    ref_loss, ref_grad = reference(logits, target, smoothing)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp()
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_cuda_tp_worker.run,
                         args=(r, world, init_file, logits, target, smoothing, g, results))
             for r in range(world)]
    for p in procs:
        p.start()
    got = [results.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    part = vocab // world
    backends = {b for *_, b in got}
    assert backends == {"nccl" if torch.cuda.device_count() >= world else "gloo"}, backends
    for rank, loss, grad, impls, _ in got:
        loss, grad = torch.from_numpy(loss), torch.from_numpy(grad)
        assert impls == [ce.IMPL]
        assert_close(loss, ref_loss, torch.float32, f"rank {rank} loss", scale=5.0)
        assert_close(grad, (ref_grad * g.double().unsqueeze(-1))[..., rank * part:(rank + 1) * part],
                     torch.float32, f"rank {rank} grad", scale=5.0)


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_split_vocab_pieces(split, smoothing, monkeypatch):
    """The same loss and gradient whether a row is one program or split over several (the
    split-vocab partials and their combine), with a ragged last piece."""
    monkeypatch.setattr(ce, "SPLIT", split)
    tokens, vocab = (5, 9000) if not GPU else (64, 50257)
    torch.manual_seed(split)
    logits = torch.randn(tokens, vocab, device=DEVICE) * 4
    target = torch.randint(0, vocab, (tokens,), device=DEVICE)
    ref_loss, ref_grad = reference(logits, target, smoothing)
    inp = logits.clone().requires_grad_()
    loss = ce.vocab_parallel_cross_entropy(inp * 1, target, smoothing)
    loss.sum().backward()
    assert_close(loss, ref_loss, torch.float32, "loss", scale=5.0)
    assert_close(inp.grad, ref_grad, torch.float32, "grad", scale=2.0)
