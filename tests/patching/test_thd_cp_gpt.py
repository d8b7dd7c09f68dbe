"""Packed (thd) sequences under context parallelism through Megatron's GPTModel (TE spec served by
megatron-adapt, cpu backend, 2 gloo processes, fp32): each rank takes its part of the packed batch
through megatron.core.utils.get_thd_batch_on_this_cp_rank (core 0.16; TE's
thd_get_partitioned_indices served without TE: each document's padded slot in 2·CP chunks,
documents crossing chunk boundaries; on core 0.17+, which has no such function, the same split
through backends/context_parallel.thd_partitioned_indices), runs the model with --cp-comm-type p2p or a2a, RoPE fusion on (megatron-adapt's
fused thd RoPE) and off (Megatron's own), and must give the per-token losses of the same packed
batch at CP=1 (within 2e-3; they land near 1e-6) and, summed over the CP group, the same gradients
(1e-4 relative). Also: a local sequence of odd length is refused naming the flag and backend, the
whole packed row fed to each CP rank unsplit is refused naming the split, and
so is what core_v0.19's --dataloader-inter-document-masking under CP cannot get (settings only)."""
import os

import pytest

from adapt_testutil import spawn_ranks

LENGTHS, SLOTS = [5, 1, 9, 7], [8, 4, 12, 8]   # slots: multiples of 2·CP = 4


def _worker(rank, port, q):
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MEGATRON_ADAPT_AUTO="0")
    import torch

    import megatron_adapt
    megatron_adapt.apply("cpu", quiet=True)
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core import utils as core_utils
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_adapt import report

    dist.init_process_group("gloo", rank=rank, world_size=2)
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32)
    cu_p = torch.tensor([0] + torch.tensor(SLOTS).cumsum(0).tolist(), dtype=torch.int32)
    total = sum(SLOTS)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 128, (1, total), generator=g)
    labels = torch.randint(0, 128, (1, total), generator=g)
    real = torch.zeros(1, total)
    for start, n in zip(cu_p[:-1].tolist(), LENGTHS):
        real[0, start:start + n] = 1

    def model(cp, comm, fusion):
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                   ffn_hidden_size=128, use_cpu_initialization=True, hidden_dropout=0.0,
                                   attention_dropout=0.0, normalization="RMSNorm", gated_linear_unit=True,
                                   add_bias_linear=False, apply_rope_fusion=fusion, context_parallel_size=cp,
                                   cp_comm_type=comm)
        return GPTModel(config, get_gpt_layer_with_transformer_engine_spec(), vocab_size=128,
                        max_sequence_length=32, position_embedding_type="rope")

    def params():
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_p,
                               cu_seqlens_kv_padded=cu_p, max_seqlen_q=max(SLOTS), max_seqlen_kv=max(SLOTS))

    def run_all(res):
        for fusion in (True, False):
            parallel_state.initialize_model_parallel(1, 1)
            ref = model(1, None, fusion)
            state = ref.state_dict()
            loss = ref(tokens, torch.arange(total)[None], None, labels=labels, packed_seq_params=params())
            (loss * real).sum().backward()
            ref_loss = loss.detach()
            ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
            parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(1, 1, context_parallel_size=2)
            for comm in ("p2p", "a2a"):
                m = model(2, comm, fusion)
                m.load_state_dict(state)
                batch = {"tokens": tokens.clone(), "labels": labels.clone(), "real": real.clone(),
                         "index": torch.arange(total)[None]}
                split = getattr(core_utils, "get_thd_batch_on_this_cp_rank", None)
                if split is not None:      # core 0.15-0.16: Megatron's split, TE's indices served
                    batch, packed = split(batch, cu, cu_p, torch.tensor([max(SLOTS)]))
                else:                      # core 0.17+: the same split through the op-level indices
                    from megatron_adapt.backends import context_parallel as cpmod
                    index = cpmod.thd_partitioned_indices(cu_p, total, 2, parallel_state.get_context_parallel_rank())
                    batch = {k: t.index_select(1, index) for k, t in batch.items()}
                    packed = params()
                loss = m(batch["tokens"], batch["index"], None, labels=batch["labels"], packed_seq_params=packed)
                (loss * batch["real"]).sum().backward()
                grad_rel = 0.0
                for n, p in m.named_parameters():
                    gsum = p.grad.clone()
                    dist.all_reduce(gsum, group=parallel_state.get_context_parallel_group())
                    grad_rel = max(grad_rel, ((gsum - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-12)).item())
                want = ref_loss[0, batch["index"][0]]
                res[f"{comm}/fusion={fusion}"] = {
                    "loss_diff": (loss.detach()[0] - want).mul(batch["real"][0]).abs().max().item(),
                    "grad_rel": grad_rel, "local_tokens": int(batch["tokens"].size(1))}
            if fusion is True:    # the whole packed row on each CP rank (not split): refused, saying so
                try:
                    m(tokens, torch.arange(total)[None], None, labels=labels, packed_seq_params=params())
                    res["unsplit"] = "ran"
                except Exception as exc:  # noqa: BLE001 (the test reads the message)
                    res["unsplit"] = f"{type(exc).__name__}: {exc}"
            if fusion is False:   # an odd local length: refused naming the flag and the backend
                core = m.decoder.layers[0].self_attention.core_attention
                x = torch.randn(3, 1, 2, 16)          # 3 local tokens: [s, b, heads, d]
                try:
                    core(x, x[:, :, :1], x[:, :, :1], None)
                    res["odd"] = "ran"
                except Exception as exc:  # noqa: BLE001 (the test reads the message)
                    res["odd"] = f"{type(exc).__name__}: {exc}"
            parallel_state.destroy_model_parallel()
        res["impls"] = sorted(report.op_counts().get("attention_cp", {}))

    res = {}
    try:
        run_all(res)
    except Exception as exc:  # noqa: BLE001 (reported to the test, never a hang)
        import traceback
        res["error"] = traceback.format_exc()
    q.put((rank, res))
    dist.destroy_process_group()


_results = {}


def results():
    if not _results:
        _results.update(spawn_ranks(_worker))
    return _results


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
@pytest.mark.parametrize("fusion", [True, False])
def test_thd_cp2_equals_thd_cp1(comm, fusion):
    for rank in (0, 1):
        assert "error" not in results()[rank], results()[rank]["error"]
        res = results()[rank][f"{comm}/fusion={fusion}"]
        assert res["local_tokens"] == sum(SLOTS) // 2
        assert res["loss_diff"] <= 2e-3, (rank, res)
        assert res["grad_rel"] <= 1e-4, (rank, res)


def test_odd_local_sequence_is_refused():
    assert results()[0]["odd"].startswith("ValueError: sequence length 6 is not a multiple of 2 x --context-parallel-size (4): "
                                          "megatron-adapt's context-parallel attention on the cpu backend"), results()[0]["odd"]


def test_an_unsplit_packed_row_is_refused_naming_the_split():
    # Megatron's MTP test_packed_sequences[2-2] feeds every CP rank the whole row; TE's kernels read
    # only their part of it and leave the rest of the output unwritten
    msg = results()[0]["unsplit"]
    assert msg.startswith(f"ValueError: packed (thd) RoPE under context parallelism 2: cu_seqlens covers the whole "
                          f"packed row ({sum(SLOTS)} tokens), so this rank should hold {sum(SLOTS) // 2} of them, "
                          f"but the tensor holds {sum(SLOTS)}"), msg
    assert "get_thd_batch_on_this_cp_rank" in msg, msg


def test_report_names_the_cp_op():
    assert results()[0]["impls"] == ["cpu.torch.a2a", "cpu.torch.p2p"]


@pytest.mark.parametrize("backend", ["cpu", "cuda", "npu"])
def test_inter_document_masking_refusals_name_flags_and_backend(backend):
    """--dataloader-inter-document-masking under CP (split per sequence): what is not served is
    refused at construction, naming the flags and the backend: a megatron-core other than 0.19 (whose
    split rule this follows), MLA, RoPE without fusion. Without Megatron-LM's parsed arguments
    (megatron-core users) batches count as split per document."""
    import types

    from megatron_adapt.patches import context_parallel as area
    from megatron_adapt.versions import megatron_core_version

    assert area.per_sequence_thd_split() is False
    b = types.SimpleNamespace(name=backend)
    version = megatron_core_version()
    name = f"--dataloader-inter-document-masking with --context-parallel-size 2 on the {backend} backend"
    mla = types.SimpleNamespace(context_parallel_size=2, multi_latent_attention=True, apply_rope_fusion=True)
    with pytest.raises(NotImplementedError) as refused:
        area._check_sequence_split(mla, b)
    if (version.major, version.minor) != (0, 19):
        assert str(refused.value).startswith(f"{name}: megatron-adapt serves core_v0.19's split"), refused.value
        assert f"megatron-core {version} is not checked" in str(refused.value)
        return
    assert str(refused.value).startswith(f"{name} and --multi-latent-attention: "), refused.value
    served = types.SimpleNamespace(context_parallel_size=2, multi_latent_attention=False, apply_rope_fusion=True)
    assert area._check_sequence_split(served, b) is None
