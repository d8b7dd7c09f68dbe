"""Context parallelism (--context-parallel-size > 1) without Transformer Engine.

Megatron serves context parallelism only in TEDotProductAttention (its own DotProductAttention
asserts "Context parallelism is only supported by TEDotProductAttention!"). megatron-adapt serves
it at that seam: the TE spec's core attention (layer_specs' AdaptDotProductAttention) takes the CP
group and --cp-comm-type as TE's does and calls the backend's `attention_cp` op
(backends/context_parallel.py: p2p ring, allgather, a2a, a2a+p2p). Megatron's local spec keeps its
own assertion.

What each rank holds is Megatron's: SBHD sequences in 2·CP chunks, this rank's chunks cp_rank and
2·CP-1-cp_rank (get_batch_on_this_cp_rank); packed THD sequences split the same way per sequence
(core 0.16's get_thd_batch_on_this_cp_rank and core 0.19's
_get_batch_on_this_cp_rank_per_document_balancing, through TE's thd_get_partitioned_indices,
served here without TE).
The op is told each local token's position and document, so both layouts go through one path.

Attention dropout runs under Megatron's model-parallel RNG tracker, as in DotProductAttention.

Refused at construction, naming the flag and the backend: a cp-comm-type outside p2p / allgather
/ a2a / a2a+p2p, a2a with heads that do not divide by the all-to-all group, core_v0.19's
--dataloader-inter-document-masking (split per sequence, not per document) with CP.
At the first forward: a local sequence of odd length (the sequence length is not a multiple of
2·CP), attention bias, softmax offsets, masks other than causal / none, hybrid CP's sbhd
PackedSeqParams.
"""
import contextlib
import copy

from megatron_adapt.spec import PatchSpec

AREA = "context_parallel"


def _backend():
    from megatron_adapt.core import active_backend
    return active_backend()


def served(config) -> bool:
    """Whether this core attention is megatron-adapt's context-parallel one."""
    from megatron_adapt.core import active_config
    return config.context_parallel_size > 1 and active_config().enabled(AREA)


def construction_config(config):
    """The config DotProductAttention.__init__ is given: CP 1, so its TE-only assertion passes; the
    module keeps the real config."""
    cfg = copy.copy(config)
    cfg.context_parallel_size = 1
    return cfg


def setup(module, config, cp_comm_type, pg_collection):
    """Record the CP groups and comm type on the core attention; refuse what cannot run."""
    from megatron.core import parallel_state

    from megatron_adapt.backends import context_parallel as cp

    backend = _backend()
    comm = cp_comm_type or "p2p"
    cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if cp_group is None:
        cp_group = parallel_state.get_context_parallel_group()
    if comm == "a2a+p2p":
        groups = getattr(pg_collection, "hcp", None) if pg_collection is not None else None
        groups = groups or parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
        if not groups or len(groups) != 2:
            raise ValueError(f"--cp-comm-type a2a+p2p on the {backend.name} backend needs two hierarchical "
                             "context-parallel groups (--hierarchical-context-parallel-sizes A P), got "
                             f"{None if not groups else len(groups)}")
    else:
        groups = cp_group
    _refuse_sequence_balanced_thd(config, backend)
    sizes = [g.size() for g in groups] if isinstance(groups, (list, tuple)) else [groups.size()]
    why = cp.check(comm, module.num_attention_heads_per_partition, module.num_query_groups_per_partition, sizes)
    if why:
        raise ValueError(f"--cp-comm-type {comm} with --context-parallel-size {config.context_parallel_size}: "
                         f"the {backend.name} backend cannot serve it: {why}")
    module.adapt_cp = {"groups": groups, "comm": comm, "size": cp_group.size(), "rank": cp_group.rank(),
                       "op": backend.op("attention_cp"), "backend": backend.name}


def _refuse_sequence_balanced_thd(config, backend):
    """core_v0.19's pretrain_gpt.py splits --dataloader-inter-document-masking batches (without
    --sft) over CP ranks per sequence, not per document: packed documents are then cut anywhere,
    which this attention's THD layout (TE's per-document split) does not describe."""
    try:
        from megatron.training.global_vars import get_args
        args = get_args()
    except Exception:  # noqa: BLE001 (no megatron.training, or no parsed arguments: not pretrain_gpt)
        return
    if getattr(args, "dataloader_inter_document_masking", False) and not getattr(args, "sft", False):
        raise NotImplementedError(
            f"--dataloader-inter-document-masking with --context-parallel-size {config.context_parallel_size}: "
            f"megatron-adapt's context-parallel attention on the {backend.name} backend serves packed sequences "
            "split per document (TE's thd_get_partitioned_indices); Megatron splits these batches per "
            "sequence. Use --context-parallel-size 1 with it")


def _meta(module, s_local, b, packed, device):
    from megatron_adapt.backends import context_parallel as cp

    st = module.adapt_cp
    if packed is None:
        if s_local % 2:
            raise ValueError(
                f"sequence length {s_local * st['size']} is not a multiple of 2 x --context-parallel-size "
                f"({2 * st['size']}): megatron-adapt's context-parallel attention on the {st['backend']} "
                "backend splits each sequence in 2·CP chunks, as Megatron does")
        return cp.sbhd_meta(b, s_local, st["size"], st["rank"], device)
    cached = getattr(packed, "_adapt_cp_meta", None)
    if cached is None or cached[0] != (st["size"], st["rank"]):
        pos, doc = cp.thd_meta(packed.cu_seqlens_q, packed.cu_seqlens_q_padded, s_local * st["size"],
                               st["size"], st["rank"], device)
        packed._adapt_cp_meta = cached = ((st["size"], st["rank"]), pos, doc)
    return cached[1], cached[2]


def forward(module, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
            packed_seq_params=None):
    """Core attention over the CP group: [s, b, h, d] (or thd [t, h, d]) in, [s, b, h * dv]
    (thd: [t, h * dv]) out."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.enums import AttnMaskType

    st = module.adapt_cp
    name = f"--context-parallel-size {st['size']} on the {st['backend']} backend"
    if attention_bias is not None or getattr(module, "softmax_offset", None) is not None:
        raise NotImplementedError(f"{name}: attention bias / softmax offsets (--softmax-type) are not served")
    mask_type = attn_mask_type if attn_mask_type is not None else module.attn_mask_type
    if mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right):
        causal = True
    elif mask_type == AttnMaskType.no_mask:
        causal = False
    else:
        raise NotImplementedError(f"{name}: attention mask type {mask_type.name} is not served (causal or none)")
    if mask_type == AttnMaskType.padding_causal and packed_seq_params is None and attention_mask is not None:
        raise NotImplementedError(f"{name}: padding masks are not served; pack sequences (thd) instead")
    if packed_seq_params is not None and packed_seq_params.qkv_format != "thd":
        raise NotImplementedError(f"{name}: PackedSeqParams(qkv_format={packed_seq_params.qkv_format!r}) "
                                  "(--hybrid-context-parallel) is not served")
    scale = module.softmax_scale * (module.scale_mask_softmax.scale or 1.0)
    window = module.scale_mask_softmax.window_size
    if packed_seq_params is not None:      # [t, h, d] -> [1, h, t, d]
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    else:                                  # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    pos, doc = _meta(module, q.size(2), q.size(0), packed_seq_params, q.device)
    dropout_p = module.attention_dropout.p if module.training else 0.0
    rng = (tensor_parallel.get_cuda_rng_tracker().fork()
           if dropout_p > 0 and not module.config.sequence_parallel else contextlib.nullcontext())
    with rng:
        out = st["op"](q, k, v, pos, doc, causal, scale, window, st["groups"], st["comm"], dropout_p)
    if packed_seq_params is not None:
        return out[0].transpose(0, 1).reshape(out.size(2), -1)
    return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), -1)


# ----------------------------------------------------------------------------- THD batches under CP
def _flat(cu):
    """(1, n) offsets -> (n,); 1-D ones (and None) as they are."""
    return cu.view(-1) if cu is not None and cu.dim() > 1 else cu


def build_thd_batch(backend, original):
    """megatron.core.utils.get_thd_batch_on_this_cp_rank (core 0.16-0.17), whose CP split calls
    TE's tex.thd_get_partitioned_indices: the same, with megatron-adapt's indices.

    Two things differ, both for core 0.16's `pretrain_gpt.py --sft`: (1) on tensor-parallel rank 0
    its get_batch_on_this_tp_rank keeps the collate's batch dimension, so cu_seqlens comes as
    [1, n + 1] (micro-batch-size must be 1 for packing; the other TP ranks receive it flat):
    flattened here, as every consumer (attention, RoPE, TE's kernels) reads 1-D offsets. (2) It
    passes no cu_seqlens_padded (Megatron's own split would hand TE None): SFTDataset pads each
    conversation to a multiple of 2·CP, so under CP cu_seqlens are the slots split, as core 0.19's
    per-document split does when cu_seqlens_padded is None."""

    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_adapt.backends import context_parallel as cp

    def get_thd_batch_on_this_cp_rank(batch, cu_seqlens, cu_seqlens_padded, max_seqlen, cp_size=None,
                                      cp_rank=None):
        cu_seqlens, cu_seqlens_padded = _flat(cu_seqlens), _flat(cu_seqlens_padded)
        packed_seq_params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
            cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded,
            max_seqlen_q=int(max_seqlen[0].item()), max_seqlen_kv=int(max_seqlen[0].item()))
        cp_size = parallel_state.get_context_parallel_world_size() if cp_size is None else cp_size
        cp_rank = parallel_state.get_context_parallel_rank() if cp_rank is None else cp_rank
        if cp_size > 1:
            slots = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
            index = cp.thd_partitioned_indices(slots, batch["tokens"].size(1), cp_size, cp_rank)
            for key, data in batch.items():
                if key in {"attention_mask", "cu_seqlens", "cu_seqlens_padded", "max_seqlen"}:
                    continue
                batch[key] = data.index_select(1, index)
        return batch, packed_seq_params
    return get_thd_batch_on_this_cp_rank


def build_per_document_split(backend, original):
    """core_v0.19's megatron.core.utils._get_batch_on_this_cp_rank_per_document_balancing (the CP
    split of --sft's packed batches), whose indices come from TE's tex.thd_get_partitioned_indices:
    the same, with megatron-adapt's indices. The group's size and rank are read from the group."""
    from megatron_adapt.backends import context_parallel as cp

    def _get_batch_on_this_cp_rank_per_document_balancing(batch, cp_group):
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        if cp_size > 1:
            cu = batch["cu_seqlens_padded"] if batch["cu_seqlens_padded"] is not None else batch["cu_seqlens"]
            total = batch["tokens"].size(1) if batch["tokens"] is not None else batch["labels"].size(1)
            index = cp.thd_partitioned_indices(cu[0], total, cp_size, cp_rank)
            for key in ("tokens", "labels", "loss_mask", "position_ids"):
                if batch.get(key) is not None:
                    batch[key] = batch[key].index_select(1, index)
        return batch
    return _get_batch_on_this_cp_rank_per_document_balancing


SPECS = [
    # 0.15 has no THD split under CP; 0.18's is get_sft_batch_on_this_cp_rank (not served yet)
    PatchSpec("megatron.core.utils:get_thd_batch_on_this_cp_rank", area=AREA, build=build_thd_batch,
              versions=">=0.16.0,<0.18.0"),
    PatchSpec("megatron.core.utils:_get_batch_on_this_cp_rank_per_document_balancing", area=AREA,
              build=build_per_document_split, versions=">=0.19.0,<0.20.0"),
]
