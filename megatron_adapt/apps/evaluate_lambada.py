"""LAMBADA cloze evaluation of a checkpoint written by stock Megatron-LM pretrain_gpt.py.

    megatron-adapt-run torchrun --nproc-per-node N -m megatron_adapt.apps.evaluate_lambada \\
        --load CKPT --use-checkpoint-args --lambada-data lambada.jsonl \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --micro-batch-size 8 [--tensor-model-parallel-size T --pipeline-model-parallel-size P ...]

(or tests_gpt/evaluate_lambada.sh). Built on Megatron-LM's own entry points, from the checkout
on PYTHONPATH (MEGATRON_LM_PATH): initialize_megatron with pretrain_gpt.py's embedding ranks,
get_model with pretrain_gpt.py's model_provider + gpt_builder, load_checkpoint (any TP/PP: the
torch_dist format reshards), get_tokenizer, and the pipeline schedule's forward_backward_func in
forward-only mode. Under megatron-adapt every op (attention, norms, the vocab-parallel cross
entropy, ...) is the selected backend's; nothing here depends on the backend.

Reports strict last-word accuracy and perplexity over the last words' tokens (definitions in
megatron_adapt/apps/lambada.py and docs/evaluation.md). Context parallelism is not supported.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys

import torch

from megatron_adapt.apps import lambada


def add_lambada_args(parser):
    group = parser.add_argument_group(title="LAMBADA evaluation (megatron_adapt.apps.evaluate_lambada)")
    group.add_argument("--lambada-data", required=True,
                       help='LAMBADA jsonl: one {"text": passage} object per line')
    group.add_argument("--lambada-results-json", default=None,
                       help="also write the scores as JSON to this file (rank 0)")
    return parser


def _import_pretrain_gpt():
    try:
        import pretrain_gpt
    except ImportError as e:
        raise SystemExit(
            f"evaluate_lambada: cannot import Megatron-LM's pretrain_gpt.py ({e}). Set MEGATRON_LM_PATH "
            "to a Megatron-LM checkout and launch through megatron-adapt-run (it puts the checkout on "
            "PYTHONPATH), or put the checkout on PYTHONPATH yourself.") from None
    return pretrain_gpt


def greedy_hits(logits, labels, tp_group, tp_rank: int):
    """1 where the argmax over the whole (vocab-parallel) vocabulary equals the label.

    logits: [b, s, V / TP], this rank's vocabulary shard. The global argmax is the smallest global
    index holding the global maximum, which is torch.argmax's choice on the unsplit logits, so the
    prediction does not depend on the TP size."""
    local_max, local_arg = logits.max(dim=-1)
    global_max = local_max.clone()
    torch.distributed.all_reduce(global_max, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    none = torch.iinfo(torch.int64).max
    cand = torch.where(local_max == global_max, local_arg.long() + tp_rank * logits.size(-1),
                       torch.full_like(local_arg, none, dtype=torch.long))
    torch.distributed.all_reduce(cand, op=torch.distributed.ReduceOp.MIN, group=tp_group)
    return cand == labels


def _check_load(argv) -> None:
    """Fail clearly before Megatron starts when --load is missing or holds no checkpoint (Megatron
    would otherwise fall back to the command line's model arguments and fail on those)."""
    from megatron.training.checkpointing import get_checkpoint_tracker_filename

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--load")
    load = pre.parse_known_args(argv)[0].load
    if not load:
        raise SystemExit("evaluate_lambada: --load CHECKPOINT_DIR is required")
    tracker = get_checkpoint_tracker_filename(load)
    if not os.path.isfile(tracker):
        raise SystemExit(f"evaluate_lambada: --load {load} is not a Megatron checkpoint directory "
                         f"(no {os.path.basename(tracker)}; give the directory pretrain_gpt.py --save wrote)")


def _backend_name() -> str:
    from megatron_adapt.core import active_backend

    backend = active_backend()
    return backend.name if backend is not None else "none (megatron-adapt not applied)"


def main():
    pretrain_gpt = _import_pretrain_gpt()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.training import get_args, get_model, get_tokenizer, print_rank_0
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.initialize import initialize_megatron

    _check_load(sys.argv[1:])
    parsing = dict(extra_args_provider=add_lambada_args,
                   args_defaults={"no_load_rng": True, "no_load_optim": True})
    if "extra_args_provider" in inspect.signature(initialize_megatron).parameters:
        initialize_megatron(**parsing, get_embedding_ranks=pretrain_gpt.get_embedding_ranks)
    else:   # core_v0.18 and later parse the arguments before initialize_megatron, as pretrain_gpt.py does
        from megatron.training.arguments import parse_and_validate_args
        parse_and_validate_args(**parsing)
        initialize_megatron(get_embedding_ranks=pretrain_gpt.get_embedding_ranks)
    args = get_args()
    if args.context_parallel_size != 1:
        raise SystemExit("evaluate_lambada: context parallelism is not supported")
    args.exit_on_missing_checkpoint = True   # never evaluate a randomly initialised model

    texts = lambada.read_jsonl(args.lambada_data)
    tokenizer = get_tokenizer()
    pad_id = tokenizer.eod
    examples = lambada.tokenize_examples(texts, tokenizer.tokenize, args.seq_length)

    model = get_model(lambda **kw: pretrain_gpt.model_provider(pretrain_gpt.gpt_builder, **kw),
                      ModelType.encoder_or_decoder, wrap_with_ddp=False)
    iteration, _ = load_checkpoint(model, None, None, strict=True)
    for m in model:
        m.eval()
    device = next(model[0].parameters()).device

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    tp_group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    batches = lambada.shard_batches(examples, args.seq_length, args.micro_batch_size, pad_id,
                                    dp_rank, dp_size)
    forward_backward = get_forward_backward_func()
    totals = torch.zeros(4, dtype=torch.float64)   # correct, examples, tokens, NLL sum (host)
    positions = torch.arange(args.seq_length, device=device).unsqueeze(0).expand(
        args.micro_batch_size, -1)

    def forward_step(data_iterator, model_chunk):
        batch = next(data_iterator)
        tokens = torch.tensor(batch.tokens, dtype=torch.long, device=device)
        labels = torch.tensor(batch.labels, dtype=torch.long, device=device)
        mask = torch.tensor(batch.loss_mask, dtype=torch.long)   # scoring runs on the host
        output = model_chunk(tokens, positions, None)

        def loss_func(logits):
            logits = logits.float()
            hits = greedy_hits(logits, labels, tp_group, tp_rank)
            nll = tensor_parallel.vocab_parallel_cross_entropy(logits.contiguous(), labels)
            correct, nll_sum, n_tok = lambada.score_rows(hits.cpu(), nll.detach().cpu(), mask,
                                                         batch.rows)
            totals.add_(torch.tensor([correct, batch.rows, n_tok, nll_sum], dtype=torch.float64))
            return nll.sum() * 0, {}

        return output, loss_func

    first = torch.distributed.get_rank() == 0
    print_rank_0(f"> LAMBADA: {len(examples)} passages from {args.lambada_data}, checkpoint "
                 f"{args.load} iteration {iteration}, TP={args.tensor_model_parallel_size} "
                 f"PP={args.pipeline_model_parallel_size} DP={dp_size}, {len(batches)} micro-batches "
                 f"of {args.micro_batch_size} per data-parallel rank")
    with torch.no_grad():
        for batch in lambada.progress(batches, len(batches), "LAMBADA", enabled=first):
            forward_backward(forward_step_func=forward_step,
                             data_iterator=[iter([batch]) for _ in model], model=model,
                             num_microbatches=1, seq_length=args.seq_length,
                             micro_batch_size=args.micro_batch_size, forward_only=True)

    # The last pipeline stage holds the scores (the same on every TP rank); sum over the stages and
    # over the data-parallel ranks.
    reduced = totals.to(device)
    torch.distributed.all_reduce(reduced, group=ps.get_pipeline_model_parallel_group())
    torch.distributed.all_reduce(reduced, group=ps.get_data_parallel_group())
    correct, n_examples, n_tok, nll_sum = reduced.tolist()
    if int(n_examples) != len(examples):
        raise RuntimeError(f"scored {int(n_examples)} passages, expected {len(examples)}")
    scores = lambada.Scores(int(correct), int(n_examples), nll_sum, int(n_tok), extra={
        "truncated_contexts": sum(e.truncated for e in examples), "iteration": iteration,
        "tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
        "dp": dp_size, "backend": _backend_name(),
        "load": args.load, "data": args.lambada_data})
    if first:
        print(f"LAMBADA strict last-word accuracy: {scores.accuracy:.4f} ({scores.correct}/"
              f"{scores.examples}) | perplexity: {scores.perplexity:.6f} (over {scores.target_tokens} "
              f"last-word tokens) | contexts truncated: {scores.extra['truncated_contexts']}",
              flush=True)
        if args.lambada_results_json:
            with open(args.lambada_results_json, "w") as f:
                json.dump(scores.as_dict(), f, indent=1)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
