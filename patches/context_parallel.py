"""Context parallelism (--context-parallel-size > 1) without Transformer Engine.

Megatron serves context parallelism only in TEDotProductAttention (its own DotProductAttention
asserts "Context parallelism is only supported by TEDotProductAttention!"). megatron-adapt serves
it at that seam: the TE spec's core attention (layer_specs' AdaptDotProductAttention) takes the CP
group and --cp-comm-type as TE's does and calls the backend's `attention_cp` op
(backends/context_parallel.py: p2p ring, allgather, a2a, a2a+p2p). Megatron's local spec keeps its
own assertion.

What each rank holds is Megatron's: SBHD sequences in 2·CP chunks, this rank's chunks cp_rank and
2·CP-1-cp_rank (get_batch_on_this_cp_rank); packed THD sequences split the same way per document
(core 0.16's get_thd_batch_on_this_cp_rank and core 0.19's
_get_batch_on_this_cp_rank_per_document_balancing, through TE's thd_get_partitioned_indices,
served here without TE), or, for core 0.19's --dataloader-inter-document-masking (without --sft),
per sequence: the whole packed row in 2·CP chunks, documents cut anywhere
(per_sequence_thd_split; patches/rope places the packed RoPE positions the same way).
The op is told each local token's position and document, so every layout goes through one path.

Attention dropout runs under Megatron's model-parallel RNG tracker, as in DotProductAttention.

Refused at construction, naming the flag and the backend: a cp-comm-type outside p2p / allgather
/ a2a / a2a+p2p, a2a with heads that do not divide by the all-to-all group (both also at start,
from the arguments: start_checks); --dataloader-inter-document-masking with CP on a megatron-core
other than 0.19, with --multi-latent-attention, or with unfused packed RoPE.
At the first forward: a local sequence of odd length (the sequence length is not a multiple of
2·CP), attention bias, softmax offsets, masks other than causal / none, hybrid CP's sbhd
PackedSeqParams.
"""
import copy

from megatron_adapt import start_checks
from megatron_adapt.patches.package_versions import serve_te_version
from megatron_adapt.spec import PatchSpec, SkipPatch
from megatron_adapt.start_checks import where

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
    per_sequence = per_sequence_thd_split()
    if per_sequence:
        _check_sequence_split(config, backend)
    sizes = [g.size() for g in groups] if isinstance(groups, (list, tuple)) else [groups.size()]
    why = cp.check(comm, module.num_attention_heads_per_partition, module.num_query_groups_per_partition, sizes)
    if why:
        raise ValueError(f"--cp-comm-type {comm} with --context-parallel-size {config.context_parallel_size}: "
                         f"the {backend.name} backend cannot serve it: {why}")
    module.adapt_cp = {"groups": groups, "comm": comm, "size": cp_group.size(), "rank": cp_group.rank(),
                       "op": backend.op("attention_cp"), "backend": backend.name,
                       "thd_split": "sequence" if per_sequence else "document"}


def _megatron_args():
    """Megatron-LM's parsed arguments, or None (no megatron.training, or a megatron-core user who
    never parsed them)."""
    try:
        from megatron.training.global_vars import get_args
        return get_args()
    except Exception:  # noqa: BLE001 (ImportError, or get_args' assertion that nothing was parsed)
        return None


def per_sequence_thd_split() -> bool:
    """Whether packed (thd) batches reach the CP ranks split per sequence (the whole packed row in
    2·CP chunks, documents cut anywhere) rather than per document (TE's thd_get_partitioned_indices).
    core_v0.19's pretrain_gpt.py and pretrain_hybrid.py call get_batch_on_this_cp_rank with
    use_per_sequence_balancing = --dataloader-inter-document-masking and not --sft: that rule, read
    from Megatron-LM's parsed arguments. Without them (megatron-core users) batches are split per
    document."""
    args = _megatron_args()
    return bool(args is not None and getattr(args, "dataloader_inter_document_masking", False)
                and not getattr(args, "sft", False))


def _check_sequence_split(config, backend):
    """--dataloader-inter-document-masking under CP: the attention is told each token's document and
    position from the per-sequence split; what else reads packed positions assuming a per-document
    split is refused, naming the flags and the backend."""
    from megatron_adapt.versions import megatron_core_version

    name = (f"--dataloader-inter-document-masking with --context-parallel-size {config.context_parallel_size} "
            f"on the {backend.name} backend")
    version = megatron_core_version()
    if version is None or (version.major, version.minor) != (0, 19):
        raise NotImplementedError(
            f"{name}: megatron-adapt serves core_v0.19's split of these batches (per sequence, "
            f"get_batch_on_this_cp_rank(use_per_sequence_balancing=True)); megatron-core {version} is not "
            "checked. Use --context-parallel-size 1 with it")
    if getattr(config, "multi_latent_attention", False):
        raise NotImplementedError(
            f"{name} and --multi-latent-attention: MLA's fused RoPE (Megatron's Triton kernels on cuda) "
            "places packed tokens as split per document. Use --context-parallel-size 1 with it")
    rope = getattr(_megatron_args(), "position_embedding_type", None)
    if rope in ("rope", "yarn", "mrope") and not config.apply_rope_fusion:
        raise NotImplementedError(
            f"{name} and --position-embedding-type {rope} without RoPE fusion: Megatron's unfused packed "
            "RoPE (_apply_rotary_pos_emb_thd) places tokens as split per document; megatron-adapt's fused "
            "one (--position-embedding-type rope, --rope-fusion: the default) serves this split")


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
    key = (st["size"], st["rank"], st["thd_split"])
    cached = getattr(packed, "_adapt_cp_meta", None)
    if cached is None or cached[0] != key:
        meta = cp.thd_sequence_meta if st["thd_split"] == "sequence" else cp.thd_meta
        pos, doc = meta(packed.cu_seqlens_q, packed.cu_seqlens_q_padded, s_local * st["size"],
                        st["size"], st["rank"], device)
        packed._adapt_cp_meta = cached = (key, pos, doc)
    return cached[1], cached[2]


def forward(module, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
            packed_seq_params=None):
    """Core attention over the CP group: [s, b, h, d] (or thd [t, h, d]) in, [s, b, h * dv]
    (thd: [t, h * dv]) out."""
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
    from megatron_adapt.patches.attention import dropout_rng

    rng = dropout_rng(module, dropout_p)
    with rng:
        out = st["op"](q, k, v, pos, doc, causal, scale, window, st["groups"], st["comm"], dropout_p)
    if packed_seq_params is not None:
        return out[0].transpose(0, 1).reshape(out.size(2), -1)
    return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), -1)


# ----------------------------------------------------------------------------- refused at start
def comm_type_refusal(backend, s: dict) -> str | None:
    """A --cp-comm-type the backend's attention_cp cannot serve, decided from the settings alone
    (Megatron's argument names): a type outside the four, or a2a / a2a+p2p with query or key/value
    heads per tensor-parallel rank that the all-to-all group (the CP group; for a2a+p2p the first
    of --hierarchical-context-parallel-sizes) does not divide. MLA and the experimental attention
    variants build their heads otherwise: their heads are checked at construction."""
    from megatron_adapt.backends import context_parallel as cp

    size = s.get("context_parallel_size") or 1
    if size <= 1:
        return None
    comms = s.get("cp_comm_type") or ["p2p"]
    comms = [comms] if isinstance(comms, str) else [c or "p2p" for c in comms]
    tp = s.get("tensor_model_parallel_size") or 1
    heads = s.get("num_attention_heads")
    groups = s.get("num_query_groups") if s.get("group_query_attention") else heads
    hierarchical = s.get("hierarchical_context_parallel_sizes")
    heads_known = (heads and groups and not s.get("multi_latent_attention")
                   and not s.get("experimental_attention_variant"))
    for comm in dict.fromkeys(comms):
        n = hierarchical[0] if comm == "a2a+p2p" and hierarchical else size
        if comm not in cp.COMM_TYPES:
            why = cp.check(comm, 1, 1, [n])
        elif not heads_known or (comm == "a2a+p2p" and not hierarchical):   # (Megatron asserts on the latter)
            continue
        else:
            why = cp.check(comm, heads // tp, groups // tp, [n])
        if why:
            return (f"--cp-comm-type {comm} with --context-parallel-size {size}: {where(backend)} cannot serve "
                    f"it: {why}")
    return None


def _comm_settings(config) -> dict:
    return {"context_parallel_size": config.context_parallel_size,
            "cp_comm_type": getattr(config, "cp_comm_type", None),
            "tensor_model_parallel_size": config.tensor_model_parallel_size,
            "num_attention_heads": config.num_attention_heads, "num_query_groups": config.num_query_groups,
            "group_query_attention": True,
            "hierarchical_context_parallel_sizes": getattr(config, "hierarchical_context_parallel_sizes", None),
            "multi_latent_attention": getattr(config, "multi_latent_attention", False),
            "experimental_attention_variant": getattr(config, "experimental_attention_variant", None)}


start_checks.register(AREA, "cp_comm_type", from_args=comm_type_refusal,
                      from_config=lambda backend, config: comm_type_refusal(backend, _comm_settings(config)))


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
    """core_v0.19's megatron.core.utils._get_batch_on_this_cp_rank_per_document_balancing (core 0.18:
    get_sft_batch_on_this_cp_rank), the CP split of --sft's packed batches, whose indices come from
    TE's tex.thd_get_partitioned_indices: the same, with megatron-adapt's indices. The group's size
    and rank are read from the group."""
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


# ------------------------------------------------- MIMO's partition adapter (core 0.17 on), THD under CP
class ThdIndices:
    """The one Transformer Engine extension call MIMO's PartitionAdapter makes (`tex.` in
    models/mimo/partition/utils.py), on megatron-adapt's indices."""

    @staticmethod
    def thd_get_partitioned_indices(cu_seqlens_padded, total, cp_size, cp_rank):
        from megatron_adapt.backends import context_parallel as cp
        return cp.thd_partitioned_indices(cu_seqlens_padded, total, cp_size, cp_rank)


MIMO_PARTITION = "megatron.core.models.mimo.partition.utils"
MIMO_USE = "MIMO's partition adapter (THD split under CP)"
# the adapter asks for TE 1.10 (thd_get_partitioned_indices) before a THD split under CP, and for
# nothing else; ThdIndices serves that call
serve_te_version(AREA, MIMO_PARTITION, "1.10.0")

SPECS = [
    PatchSpec(f"{MIMO_PARTITION}:tex", area=AREA, create=True,
              build=start_checks.served_without_te("tex", ThdIndices, MIMO_USE),
              check_signature=False, optional=True, versions=">=0.17.0,<0.20.0"),
    PatchSpec(f"{MIMO_PARTITION}:_HAVE_TEX", area=AREA,
              build=start_checks.served_without_te("_HAVE_TEX", True, MIMO_USE),
              check_signature=False, optional=True, versions=">=0.17.0,<0.20.0"),
    # 0.15 has no THD split under CP; 0.18 names 0.19's split get_sft_batch_on_this_cp_rank (same
    # arguments, the same body around tex.thd_get_partitioned_indices)
    PatchSpec("megatron.core.utils:get_thd_batch_on_this_cp_rank", area=AREA, build=build_thd_batch,
              versions=">=0.16.0,<0.18.0"),
    PatchSpec("megatron.core.utils:get_sft_batch_on_this_cp_rank", area=AREA, build=build_per_document_split,
              versions=">=0.18.0,<0.19.0"),
    PatchSpec("megatron.core.utils:_get_batch_on_this_cp_rank_per_document_balancing", area=AREA,
              build=build_per_document_split, versions=">=0.19.0,<0.20.0"),
]
