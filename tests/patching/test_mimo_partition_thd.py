"""MIMO's PartitionAdapter (core 0.17 on) splits packed (THD) sequences under context parallelism
with Transformer Engine's tex.thd_get_partitioned_indices, behind an assert for TE >= 1.10. Without
TE megatron-adapt serves that call with its own THD indices (patches/context_parallel.py): the
adapter's real `shard`, two CP ranks, each rank's tokens the chunks TE's layout gives it."""
import textwrap

import pytest

SHARD = textwrap.dedent("""
    import inspect
    import torch
    from unittest.mock import MagicMock, patch
    import megatron_adapt
    megatron_adapt.apply("cpu", quiet=True)
    from megatron.core.models.mimo.partition import utils
    from megatron.core.packed_seq_params import PackedSeqParams
    cfg = utils.PartitionConfig(use_cp=True, seq_parallel=False, tp_comm_overlap=False, max_seq_len=16,
                                kv_format="thd", cp_group=MagicMock())
    # core 0.17-0.18: shard(embeddings [B, S, H], labels, loss_mask, attention_mask, packed_seq_params);
    # core 0.19: shard(embeddings [S, B, H], labels, loss_mask, packed_seq_params)
    batch_first = "attention_mask" in inspect.signature(utils.PartitionAdapter.shard).parameters
    seq = torch.arange(16).float()
    embeddings = (seq.view(1, 16, 1).expand(2, 16, 3) if batch_first else seq.view(16, 1, 1).expand(16, 2, 3)).contiguous()
    labels = seq.view(1, 16).expand(2, 16).long().contiguous()
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q_padded=torch.tensor([0, 8, 16], dtype=torch.int32))
    extra = {"attention_mask": None} if batch_first else {}
    for rank in (0, 1):
        with patch.object(utils, "get_pg_size", return_value=2), patch.object(utils, "get_pg_rank", return_value=rank):
            out = utils.PartitionAdapter(cfg).shard(embeddings=embeddings, labels=labels, loss_mask=None,
                                                    packed_seq_params=params, **extra)
        emb, lab = out[0], out[1]
        positions = emb[0, :, 0] if batch_first else emb[:, 0, 0]
        print("RANK", rank, positions.long().tolist(), lab[0].tolist())
""")

def test_thd_split_under_cp_without_te(python):
    pytest.importorskip("megatron.core.models.mimo.partition.utils")
    proc = python(SHARD)
    # each 8-token sequence in 4 chunks of 2: rank 0 takes chunks 0 and 3, rank 1 chunks 1 and 2
    assert "RANK 0 [0, 1, 6, 7, 8, 9, 14, 15] [0, 1, 6, 7, 8, 9, 14, 15]" in proc.stdout, proc.stdout + proc.stderr
    assert "RANK 1 [2, 3, 4, 5, 10, 11, 12, 13] [2, 3, 4, 5, 10, 11, 12, 13]" in proc.stdout, proc.stdout
