"""pytest plugin: Megatron-LM's own unit tests under megatron-adapt.

Enabled only by name, from a Megatron-LM checkout's root (the checkout matching the installed
megatron-core), under the launcher:

    megatron-adapt-run torchrun --nproc-per-node 2 -m pytest -p megatron_adapt.apps.pytest_plugin \
        [--megatron-adapt-json out/rank{rank}.json] tests/unit_tests/...

Loaded without `-p` it does nothing (there is no entry point). Enabled, it:

- refuses to run unless megatron-adapt is applied in the process (no silent stock run);
- skips, with the reason and its category, each test in SKIPS (a table: needs Transformer Engine
  by design, needs a CUDA device, needs a download, ...) for the running backend;
- lifts Megatron's own `skipif`s that ask TE's version for a feature megatron-adapt serves
  (SERVED_TE_SKIPIFS), so those tests run; the JSON lists what it lifted;
- skips a test whose `Utils.initialize_model_parallel(...)` asks for a layout the world size cannot
  hold (TP x PP x CP, EP x ETP x PP), naming it: Megatron's tests are written for 8 GPUs;
- serves the two names Megatron's test modules import from Transformer Engine at module level
  (`transformer_engine.pytorch.fp8.check_fp8_support` / `fp8_autocast`) while that module alone
  imports: "FP8 is not available" and a no-op `fp8_autocast(enabled=False)`;
  `fp8_autocast(enabled=True)` raises. The shim is gone from sys.modules once the test module is
  imported, so Megatron itself never sees a `transformer_engine` package;
- never downloads: the conftest's data-set download is replaced by an error it reports and goes on;
- gives process groups a collective timeout (`--megatron-adapt-pg-timeout`, 300 s) where the test
  sets none: a test that fails on one rank only then fails the other rank's collective in minutes,
  not after the default 30;
- gives each test a time limit (`--megatron-adapt-test-timeout`, 600 s; 0: none): past it the test
  fails with the limit in its message (SIGALRM), and if it cannot be interrupted (stuck in native
  code) every thread's stack is dumped and the process exits a minute later;
- writes each test's outcome (passed / failed / skipped + reason / error) as JSON, one file per rank,
  after every test; a test still running is recorded as "running", so a killed run names it.
"""
from __future__ import annotations

import ast
import contextlib
import fnmatch
import functools
import importlib
import importlib.util
import inspect
import gc
import json
import faulthandler
import os
import re
import signal
import subprocess
import sys
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import pytest

CATEGORIES = {
    "te": "needs Transformer Engine by design",
    "ranks": "needs more ranks than this run has",
    "download": "needs a download (no network)",
    "cuda": "needs a CUDA device",
    "rounding": "compares, bit for bit or at a bf16 tolerance, two computations that round differently",
    "internals": "asserts how Megatron's own implementation computes (the backend op computes it otherwise)",
    "precondition": "feeds input that breaks a precondition Megatron documents; megatron-adapt refuses it",
    "memory": "needs more memory than this host has for all its ranks (cpu backend: every rank in host memory)",
    "package": "needs a third-party package (neither TE nor one megatron-adapt serves) that does not install here",
    "torch": "needs a newer PyTorch than this run's",
}


@dataclass(frozen=True)
class Skip:
    pattern: str          # fnmatch pattern on the node id relative to the checkout root
    category: str         # a key of CATEGORIES
    reason: str
    backends: tuple = ("cpu", "cuda", "npu")
    versions: str = ">=0.15.0,<0.20.0"
    needs_world: int = 0  # "ranks" entries: skipped only while the world size is smaller
    needs_host_gb: float = 0  # "memory" entries: skipped only on a host with less memory (GB)
    when: Callable[[], bool] | None = None  # a callable: skipped only while it returns True (e.g. a torch feature check)

    def __post_init__(self):
        if self.category not in CATEGORIES:
            raise ValueError(f"unknown skip category {self.category!r}; one of {sorted(CATEGORIES)}")


@dataclass(frozen=True)
class Slow:
    """A test that takes longer than a sweep's per-test limit on a backend, for its size and not for a
    hang: it gets at least `seconds` (a limit of 0, none, stays none). Measured, with the host, in reason."""
    pattern: str          # fnmatch pattern on the node id relative to the checkout root
    seconds: float
    reason: str
    backends: tuple = ("cpu",)


def time_limit(nodeid: str, limit: float, backend: str) -> float:
    """The per-test limit for this test: the run's, raised for a listed slow test (SLOW)."""
    if not limit:
        return limit
    for s in SLOW:
        if backend in s.backends and fnmatch.fnmatchcase(nodeid, s.pattern):
            return max(limit, s.seconds)
    return limit


def nvlink_multicast_off() -> bool:
    """NVLink multicast (NVLS) turned off for this process's PyTorch / NCCL, as on machines that share
    their GPUs (a multicast program can take a host's GPUs out of service)."""
    return (os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0") not in ("", "0")
            or os.environ.get("NCCL_NVLS_ENABLE") == "0")


def torch_profiler_lacks_linked_correlation_id() -> bool:
    """torch.profiler's FunctionEvent has `linked_correlation_id` in newer releases (2.13 has it,
    2.11 does not); Megatron's mfsdp_v2 profiler helper reads it."""
    from torch.autograd.profiler_util import FunctionEvent

    return "linked_correlation_id" not in inspect.signature(FunctionEvent.__init__).parameters


def host_short_for_the_oom_fallback() -> bool:
    """Megatron's test_oom_is_handled makes a tensor of 60 % of each GPU's free memory so that merging its
    halves runs out of device memory and falls back to the host, which then holds the halves and their
    concatenation: about 1.2 x a GPU's memory per rank (one H200: ~170 GB; a 125 GiB host killed it).
    True where this host has less for the ranks of this run. Asks nvidia-smi, not torch: the skip table is
    read before the test initialises CUDA, which must not happen in the plugin."""
    gb = gpu_memory_gb()
    return gb is not None and host_memory_gb() < 1.2 * gb * _world()


def gpu_memory_gb() -> float | None:
    """The largest GPU's memory in GB (1e9 bytes) as nvidia-smi reports it; None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return max(float(v) for v in out.split()) * 2**20 / 1e9
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


# Megatron's own `skipif`s that ask Transformer Engine's version for a feature megatron-adapt serves
# without TE. The plugin lifts them, so the test runs; keyed by Megatron's reason, valued by what
# serves it. A lifted test that still cannot run gets an entry in SKIPS, with its own category.
SERVED_TE_SKIPIFS = {
    "Expert with TE Linear is only supported in TE 1.7.0 and later.":
        "the TE spec's experts (TEGroupedMLP, SequentialMLP of TE linears) on megatron-adapt's linears",
    "Transformer Engine under v1.7.0 doesn't support MoE training.":
        "SequentialMLP of the TE spec's linears, served by megatron-adapt",
    "TE Grouped MLP is only supported in TE 1.9.0.dev0 and later.":
        "TEGroupedMLP on megatron-adapt's grouped linears",
    "TEGroupedMLP is only supported in TE 1.9.0 and later.":
        "TEGroupedMLP on megatron-adapt's grouped linears, with TE's checkpoint layout",
    "Fused RoPE requires TE >= 1.4.0":
        "`apply_rope_fusion`: the backend's rope op (area `rope`)",
    "grouped_gemm requires TransformerEngine >= 2.1.0":
        "`--moe-grouped-gemm` on the TE spec: TEGroupedMLP on megatron-adapt's grouped linears",
    # core 0.16 / 0.19 use this reason in test_multi_token_prediction.py only: MTP layers from the TE
    # spec, and MTP on the hybrid Mamba model
    "transformer_engine not available":
        "the TE spec's modules on megatron-adapt's classes (MTP layers; the hybrid Mamba spec)",
}


def _lift_served_skipifs(item) -> list[str]:
    """Remove from the item's chain the true `skipif` marks whose reason SERVED_TE_SKIPIFS names;
    return the reasons lifted."""
    lifted = []
    for node in item.listchain():
        kept = []
        for mark in node.own_markers:
            reason = mark.kwargs.get("reason")
            if (mark.name == "skipif" and reason in SERVED_TE_SKIPIFS
                    and mark.args and all(a is True for a in mark.args)):
                lifted.append(reason)
                continue
            kept.append(mark)
        node.own_markers[:] = kept
    return lifted


UT = "tests/unit_tests/"
NOT_GPU = ("cpu", "npu")
CUDA_IS_CPU = "on the cpu backend 'cuda' tensors are CPU tensors"
# DeepSeek sparse attention's tests: transformer/experimental_attention_variant/ (core 0.19) or
# transformer/ (core 0.16); fnmatch's * spans the directory
DSA_TESTS = UT + "transformer/*test_attention_variant_dsa.py::"
# reasons several entries share
TRITON_GPU_ONLY = "Triton launches them on a GPU only (on cpu: \"0 active drivers\")"
FP8_REFUSED = ("megatron-adapt runs fp8 GEMMs on sm89+ GPUs only and refuses fp8 elsewhere at start "
               "(UnsupportedFeatureError, never silent bf16)")
FLASH_ATTN_KV = ("dynamic batching asserts flash-attn >= 2.7.3 (attention.py: \"flash attn verion v2.7.3 and "
                 "above is required for dynamic batching\"): flash_attn_varlen_func / flash_attn_with_kvcache "
                 "on the paged KV cache. flash-attn is a source build against the installed torch and CUDA "
                 "(no wheel on the registries)")
BATCH_INVARIANT_TE = ("batch-invariant mode monkey-patches TE's GEMM and RMSNorm entry points "
                      "(batch_invariant_kernels._te_patch_for_batch_invariant imports transformer_engine.pytorch)")   # why a [cuda] test cannot run there
# From the runs recorded in docs/megatron-unit-tests.md; every entry says why. Layouts asked for
# through Utils.initialize_model_parallel are skipped at run time by _guard_world_size instead.
SKIPS: list[Skip] = [
    Skip(UT + "transformer/test_transformer_block.py::*::test_gpu_forward_full_checkpoint_fp8", "cuda",
         "recomputes the block in fp8 (e4m3); " + FP8_REFUSED, backends=NOT_GPU),
    Skip(UT + "models/test_gpt_model.py::TestGPTModelWithCustomPG::test_gpt_model_with_custom_pg[[]*",
         "ranks", "builds a HyperCommGrid of 8 ranks (shapes 1x8x1 / 2x4x1) whatever the world size",
         needs_world=8),
    Skip(UT + "pipeline_parallel/test_schedules.py::test_forward_backward_no_pipelining_with_custom_pgs",
         "ranks", "builds a HyperCommGrid of shape [2, 1, 1, 4]: 8 ranks", needs_world=8),
    Skip(UT + "transformer/moe/test_upcycling.py::TestGPTModel::test_upcycling_TE[[]tp_ep*-2-*", "rounding",
         "upcycling at granularity 2 gives experts 2i and 2i+1 the two halves of the dense MLP and equal router "
         "rows, so the MoE equals the dense model only while each token's top-2 is such a pair. The router "
         "computes its logits in bf16: with the CPU's random weights one token's best two pairs tie, and "
         "torch.topk on the CPU breaks the 4-way tie to experts of different pairs (that token's logits then "
         "differ by up to 0.38 against the test's atol 0.1). With the router in fp32 (no tie) all 7 cases pass "
         "on cpu, granularity 2 within 0.078 (GELU), 0.020 (SwiGLU), 0.016 (squared ReLU)",
         backends=NOT_GPU),
    *(Skip(UT + f"transformer/test_multi_token_prediction.py::TestMultiTokenPrediction::test_forward_backward[[]{tp_cp}-*",
           "rounding", "compares the TP>1 model's per-token losses with TP1's at rtol = atol = 1e-3 in bf16, 8 experts "
           "top-2 (SequentialMLP: the test turns grouped GEMM off without TE). On cpu token 8's top-2 flips between "
           "the layouts (11.6148 against 11.6628; the others within 0.002): at TP4 x CP2 layer 1's router logits for "
           "experts 2 and 7 are 0.15502 / 0.15486 at TP1 and 0.15458 / 0.15536 at TP4 (the bf16 noise between the "
           "layouts is about 1e-3). With the model in fp32 (a copy of the test: bf16 off) [2-1-False], [4-2-False] and "
           "[4-2-True] pass at 8 ranks; at TP2 moe_router_dtype='fp32' alone is enough. On cuda (2 x H200) several "
           "tokens differ by up to 0.016 at TP2. core_v0.19.0 marks this test flaky_in_dev, which Megatron CI's "
           "marker deselects", versions="<0.17.0") for tp_cp in ("2-1", "4-2")),
    Skip(UT + "transformer/moe/test_grouped_mlp.py::TestParallelGroupedMLP::test_weight_init_value_the_same", "cuda",
         "with use_cpu_initialization=False it expects the grouped and the sequential experts' weights, drawn "
         "under the expert RNG fork in different orders and sizes, to coincide: a property of CUDA's "
         "counter-based Philox generator, not of the CPU's Mersenne Twister (the cpu-initialised variant runs)",
         backends=NOT_GPU, versions="<0.17.0"),
    Skip(UT + "distributed/mfsdp_v2/test_dbuffer.py::test_release_and_reallocate_storage_preserves_buffer_views",
         "cuda", "expects the storage reallocated after release_storage() at the address it had: CUDA's "
         "caching allocator hands back the block it just took; the CPU allocator gives any address "
         "(the views follow the storage on both)", backends=NOT_GPU, versions=">=0.19.0"),
    Skip(UT + "distributed/test_torch_fully_sharded_parallel.py::test_fsdp2_swiglu_sharded_tensor_factory",
         "ranks", "TP2 with a data-parallel size of 2 or more (its offset table is TP2 x DP4): at DP1 the "
         "fused W/V weight builds two shards, where the test expects one", needs_world=4),
    *(Skip(UT + f"dist_checkpointing/test_fully_parallel.py::{t}", "ranks",
           "its expected save / load distribution names ranks 0-7 (TP2 x DP4: 'keyD' saved by rank 4, "
           "'g' by rank 7); with fewer ranks the wrapper distributes over what there is, or not at all",
           needs_world=8)
      for t in ("TestFullyParallelSaveAndLoad::test_save_distribution[[]*",
                "TestFullyParallelSaveAndLoad::test_load_distribution[[]*",
                "TestCrossRanksReads::test_cross_dp_access_does_not_disturb_the_distribution")),
    Skip(UT + "dist_checkpointing/test_optimizer.py::TestDistributedOptimizer::test_optimizer_common_state_dict"
         "[[]tp_pp_ep*-True-kwargs*", "te",   # every case with test_step=True (at 4+ ranks the MoE cases too)
         "\"check 'step' is synced\": it simulates TE FusedAdam leaving 'step' unset in some param groups "
         "(the test's own comment) and checks the per-group step Megatron's DistributedOptimizer keeps for TE / "
         "apex (HAVE_APEX_OR_TE). Without them Megatron takes torch Adam's path, a step per parameter state, "
         "and never reads the per-group step the test sets (stock Megatron with torch's Adam fails it too, on "
         "cpu, 2 processes, core_v0.16.1; under megatron-adapt the same 2 cases fail on core_v0.19.0)"),
    Skip(UT + "tensor_parallel/test_random.py::test_double_fork_cuda_rng_states_tracker[[]True]", "cuda",
         "use_cudagraphable_rng=True asserts torch.cuda.CUDAGraph.register_generator_state and "
         "graph-safe CUDA generator states", backends=NOT_GPU),
    Skip(UT + "test_nccl_allocator.py::TestNCCLAllocator::test_nccl_allocator_init_sets_env_vars", "cuda",
         "nccl_allocator.init() compiles Megatron's NCCL memory-pool extension with CUDA "
         "(torch.utils.cpp_extension: no GPU arch to build for when no GPU is visible) and turns on NCCL's "
         "NVLS", backends=NOT_GPU),
    Skip(UT + "tensor_parallel/test_random.py::test_convert_cuda_rng_state", "cuda",
         "converts between plain and CUDA-graph-safe CUDA generator states "
         "(use_cudagraphable_rng=True)", backends=NOT_GPU),
    Skip(UT + "tensor_parallel/test_random.py::test_convert_cuda_rng_state", "te",
         "its last part forks TECudaRNGStatesTracker, which without TE derives from Megatron's "
         "MagicMock stand-in for transformer_engine (megatron/core/extensions/transformer_engine.py): "
         "not a working RNG tracker (H100: the assertion at test_random.py:129)", backends=("cuda",)),
    Skip(UT + "tensor_parallel/test_cross_entropy.py::test_vocab_parallel_cross_entropy_uses_explicit_tp_group",
         "internals", "counts three torch.distributed.all_reduce calls on the given group (Megatron's "
         "max, predicted-logit and sum-exp reductions); the backend op reduces the last two in one "
         "call and makes none on a 1-rank group. Its output check passes (core_v0.19.0, cpu)"),
    Skip(UT + "test_optimizer.py::test_chained_optimizer", "cuda",
         "moves optimizer state with .to('cuda') and asserts tensor.is_cuda: " + CUDA_IS_CPU, backends=NOT_GPU),
    Skip(UT + "transformer/test_thd_correctness.py::test_thd_format[[]b1_seq16k_mha[]]", "memory",
         "the test's own MockCoreAttention (not megatron-adapt's) materialises fp32 scores of "
         "4 heads x 16383 x 16383 (4.3 GB), their softmax and both gradients: ~13 GB a rank, all ranks "
         "in host memory on cpu (2 ranks on a 23 GB host: killed by the OOM killer, core_v0.19.0). "
         "Its sibling b1_seq3891_gqa makes the same bitwise SBHD/THD checks and runs",
         backends=("cpu",), versions=">=0.19.0,<0.20.0"),
    Skip(UT + "transformer/test_transformer_block_custom_pgs.py::TestTransformerBlockWithProcessGroups::"
         "test_params_and_grads_match_transformer_block[[]2-1-2-1[]]", "memory",
         "each rank builds two 3-layer hidden-4096 blocks (1.2 G parameters, made in fp32, with fp32 "
         "gradient buffers) and runs them over 4 x 4096 tokens with CP 2: peak RSS 26.6 GB a rank, all "
         "ranks in host memory on cpu (core_v0.19.0 on a 251 GB host: passed in 386 s, 2026-11-28; on a "
         "24 GB host the OOM killer ended it). Skipped on hosts under 64 GB",
         backends=("cpu",), needs_host_gb=64),
    Skip(UT + "transformer/test_transformer_block_custom_pgs.py::TestTransformerBlockWithProcessGroups::"
         "test_params_and_grads_match_transformer_block[[]8-8-1-1[]]", "memory",
         "the same two 3-layer hidden-4096 blocks on each of 8 ranks at TP 8: passed in 78 s on a 125 GiB host "
         "(core_v0.16.1, peak 74.4 GB summed over the ranks, 9.4 GB the largest, 2026-12-03); on a 24 GiB host the "
         "OOM killer ended a rank. Skipped on hosts under 90 GB", backends=("cpu",), needs_host_gb=90),
    Skip(UT + "models/test_llava_model.py::TestLLaVAModel::test_forward", "memory",
         "at 8 ranks every rank builds the whole LLaVA test model and runs its forward: passed in 41 s on a 125 GiB "
         "host (core_v0.16.1, peak 89.6 GB summed, 14.0 GB the largest rank, 2026-12-03); on a 24 GiB host the OOM "
         "killer ended a rank. At 2 ranks it runs on 24 GiB. Skipped at 8+ ranks on hosts under 108 GB",
         backends=("cpu",), when=lambda: _world() >= 8 and host_memory_gb() < 108),
    Skip(UT + "transformer/test_multi_token_prediction.py::TestMultiTokenPrediction::test_packed_sequences[[]2-2[]]",
         "precondition", "feeds every CP rank the whole packed row (3 documents, 52 tokens, CP 2) without splitting it "
         "(Megatron's get_thd_batch_on_this_cp_rank / get_batch_on_this_cp_rank), and asserts the output has all 52 "
         "tokens. Megatron's thd RoPE and CP attention take cu_seqlens of the whole row and this rank's 26 tokens; "
         "TE's kernels do not check and leave the rest of their output unwritten, and the test checks shapes only. "
         "megatron-adapt's thd RoPE raises ValueError naming the split (8 ranks on cpu, both tags; 4 ranks needed)"),
    Skip(UT + "data/test_get_batch.py::test_sft_batch[[]*-[248]-*-*[]]", "precondition",
         "CP > 1 with SFT packs documents of random lengths (create_sft_data_iterator) and no "
         "cu_seqlens_padded, so _get_batch_on_this_cp_rank_per_document_balancing splits documents "
         "whose length is not a multiple of 2 x CP, which its docstring forbids (\"Each document "
         "length must be divisible by 2 * cp_size\"); TE's thd_get_partitioned_indices states it as "
         "a device assert only, and the test checks shapes only. The backend's split raises "
         "ValueError naming the document (core_v0.19.0, 2 ranks); CP 1 runs",
         versions=">=0.19.0,<0.20.0"),
    Skip(UT + "models/test_base_embedding.py::TestBaseEmbedding::test_gpu_forward", "cuda",
         "moves the embedding with .cuda() and asserts embeddings.device.type == 'cuda': "
         + CUDA_IS_CPU + " (its test_cpu_forward runs)", backends=NOT_GPU),
    Skip(UT + "models/test_bert_model.py::*::test_transformer_engine_version_1_7_to_1_10_rng_error", "te",
         "mocks get_te_version() to 1.8 and expects TE 1.7-1.10's own Linear to reject the "
         "rng_tracker_name keyword, comparing TE's TypeError message verbatim: a property of TE's "
         "library; megatron-adapt's TE-named linears accept the keyword and build the model"),
    Skip(UT + "models/mimo/test_mimo_encoder_prefetch.py::test_real_cuda_*", "cuda",
         "runs the encoder prefetch producer on a real CUDA stream and waits on its CUDA event "
         "(skipped by Megatron itself where torch.cuda.is_available() is False)", backends=NOT_GPU),
    Skip(UT + "models/mimo/test_mimo_forward_step.py::test_move_batch_to_cuda_*", "cuda",
         "moves a batch with .cuda() and asserts tensor.is_cuda: " + CUDA_IS_CPU, backends=NOT_GPU),
    # tests/unit_tests/data: vocabularies and data sets from the network or /opt/data
    Skip(UT + "data/test_preprocess_data.py::*", "download",
         "reads the GPT-2 vocab / merges from /opt/data/tokenizers (the conftest's download) or "
         "fetches them with requests.get (gpt2_vocab / gpt2_merge)"),
    Skip(UT + "data/test_preprocess_mmdata.py::*", "download",
         "fetches the GPT-2 vocab / merges with requests.get (test_preprocess_data.gpt2_vocab)"),
    Skip(UT + "data/test_bin_reader.py::*", "download",
         "fetches the GPT-2 vocab / merges with requests.get (test_preprocess_data.gpt2_vocab)"),
    Skip(UT + "data/test_fim_dataset.py::*", "download",
         "reads /opt/data/tokenizers/huggingface and /opt/data/datasets/fim (the conftest's download)"),
    Skip(UT + "fusions/test_swiglu_fusion.py::test_weighted_bias_swiglu[[]input_dtype0[]]", "rounding",
         "bf16: compares bias_swiglu_impl (served by the backend's op) with Megatron's own "
         "weighted_bias_swiglu_impl (not patched) at atol 1e-3 / rtol 2e-2; the two round the "
         "backward differently (max |x.grad - fp64| over 20 seeds: ours 0.072, Megatron's "
         "unweighted 0.070, weighted 0.053); fp32 (input_dtype1) runs and passes", backends=NOT_GPU),
    Skip(UT + "dist_checkpointing/test_fully_parallel.py::TestCrossRanksReads::test_full_dp_reads",
         "ranks", "written for 8 ranks: expects rank 2 to save and read 'c' because ranks 0 and 1 "
         "already hold 'a' and 'b'; with fewer than 3 ranks a lower rank takes 'c' and the exact "
         "read sets differ (1 GPU: rank 0 reads {'a', 'c'})", needs_world=3),
    Skip(UT + "dist_checkpointing/models/test_mlp_glu.py::TestParallelMLPWithGLU::test_oom_is_handled",
         "memory", "provokes a CUDA out-of-memory error on purpose (torch.cat of two tensors of 60 % "
         "of the free device memory, expecting OutOfMemoryError); on the cpu backend device memory "
         "is host memory shared by every rank, and the host's OOM killer ends a rank instead "
         "(core_v0.16.1, 2 ranks: SIGKILL)", backends=("cpu",)),
    Skip(UT + "dist_checkpointing/models/test_mlp_glu.py::TestParallelMLPWithGLU::test_oom_is_handled",
         "memory", "fills 60 % of each GPU so that a merge runs out of device memory and falls back to "
         "the host, which then holds about 1.2 x a GPU's memory per rank: more than this host has for "
         "the run's ranks (one H200 on a 125 GiB host: the OOM killer ended the whole dist_checkpointing "
         "run, 2026-11-27)", backends=("cuda",), when=host_short_for_the_oom_fallback),
    Skip(UT + "dist_checkpointing/test_async_save.py::TestAsyncSave::test_get_async_strategy[[]nvrx[]]",
         "package", "needs nvidia-resiliency-ext's async checkpoint writer. The registries' release "
         "(0.4.1) has no __version__, which core_v0.19.0 reads at `import megatron.core` "
         "(dist_checkpointing/strategies/nvrx.py: AttributeError), so with it installed nothing imports",
         versions=">=0.19.0,<0.20.0"),
    Skip(UT + "dist_checkpointing/models/test_gpt_hybrid_interop.py::TestGPTToHybridFSDPLoad::*", "cuda",
         "Megatron-FSDP shards parameters as DTensors; initializing them draws from torch's "
         "OffsetBasedRNGTracker (torch.distributed.tensor._random), which requires a CUDA device "
         "(core_v0.19.0, cpu: RuntimeError at setup)", backends=NOT_GPU),
    Skip(UT + "dist_checkpointing/test_fp8.py::*", "te",
         "saves and loads TE's own Float8Tensor (transformer_engine.pytorch.float8_tensor, imported "
         "at module level): a tensor class of TE's library. megatron-adapt's fp8 keeps bf16 / fp32 "
         "parameters and scales, no Float8Tensor, so there is nothing of ours to checkpoint here"),
    Skip(UT + "transformer/test_transformer_layer.py::TestParallelTransformerLayer::test_chunked_mlp",
         "rounding", "asserts torch.equal of the layer with 1 and 4 MLP chunks (fp32); cuBLAS picks "
         "another GEMM kernel for 16 rows than for 64 (H100: F.linear 64x12 @ 12x48 against four "
         "16-row pieces differs by 1.9e-6 in plain PyTorch; the layer by 6.0e-8), so the two are "
         "not bitwise equal on a GPU; on cpu it runs and passes", backends=("cuda",),
         versions=">=0.17.0,<0.20.0"),  # core_v0.16.1's test_chunked_mlp compares nothing
    # -- the rest of the tree, first runs of 2026-11-27 (core_v0.19.0; docs/megatron-unit-tests.md)
    Skip(UT + "test_optimizer_cpu_offloading.py::*", "cuda",
         "Megatron's HybridDeviceOptimizer offloads CUDA parameters to the host (param.is_cuda); "
         + CUDA_IS_CPU + ", so it offloads none and then fails to find them among its copies "
         "(KeyError). megatron-adapt refuses it on cpu and npu at construction and "
         "--optimizer-cpu-offload at start (patches/start_checks)", backends=NOT_GPU),
    *(Skip(UT + "tokenizers/test_tokenizer.py::" + t, "download",
           "reads tokenizer files under /opt/data/tokenizers (sentencepiece, huggingface, megatron, "
           "tiktoken, multimodal: the conftest's download)")
      for t in ("test_sp_tokenizer", "test_hf_tokenizer", "test_megatron_tokenizer", "test_tiktoken_tokenizer",
                "test_write_metadata", "test_multimodal_tokenizer", "test_sft_tokenizer",
                "TestBuildTokenizer::test_build_hf_tokenizer", "TestBuildTokenizer::test_build_megatron_tokenizer",
                "TestBuildTokenizer::test_build_sp_tokenizer", "TestBuildTokenizer::test_build_tiktoken_tokenizer",
                "test_detokenize_skip_special_tokens_unsupported_backend*")),
    Skip(UT + "training/config/test_container_base.py::TestConfigContainer_ToYaml::test_to_yaml_with_msc_url",
         "package", "writes to msc://default/... through NVIDIA's multi-storage-client and a 'default' "
         "profile from an MSC config file the test does not write: installed from the registries "
         "(1.3.1) it raises 'Profile \"default\" not found'; not installed, the URL is opened as a "
         "local path (FileNotFoundError). Stock Megatron, no megatron-adapt, core_v0.19.0: the same"),
    Skip(UT + "transformer/moe/test_multihot_indices_converter.py::*", "cuda",
         "Megatron's own Triton kernel (moe/fused_indices_converter.py); " + TRITON_GPU_ONLY, backends=NOT_GPU),
    *(Skip(UT + f"inference/engines/test_dynamic_engine.py::TestDynamicInferenceEngine::{t}[[]*", "package",
           "the dynamic engine's " + FLASH_ATTN_KV)
      for t in ("test_speculative_block_boundary_crossing", "test_speculative_sequence_length_double_counting")),
    Skip(UT + "inference/test_batch_dimension_utils.py::TestMatchGraphConfigWithEP::test_any_prefill_rank_forces_eager*",
         "ranks", "needs one EP rank with a prefill batch and another with decode only; with one rank "
         "the only rank is the decode one, so the match is not forced eager", needs_world=2),
    Skip(UT + "test_utils.py::TestSingleGroupReductionHelpers::test_explicit_grid_group", "ranks",
         "splits the world into subgroups of ranks (new_subgroups_by_enumeration): with one rank the "
         "list is empty (\"ranks_per_subgroup_list cannot be empty\")", needs_world=2),
    Skip(UT + "transformer/experimental_attention_variant/test_dsa_tilelang_kernels.py::"
         "test_lighting_indexer_indices_preserves_single_head_weight_axis", "package",
         "calls the TileLang lightning-indexer kernel, None unless the tilelang package (GPU kernels "
         "compiled by TileLang's own CUDA toolchain) is installed"),
    Skip(UT + "transformer/test_cuda_graphs.py::TestTECudaGraphHelper::*", "te",
         "TECudaGraphHelper captures layers with TE's make_graphed_callables (--cuda-graph-impl "
         "transformer_engine; it asserts HAVE_TE_GRAPHS). megatron-adapt serves --cuda-graph-impl local"),
    Skip(UT + "transformer/test_cuda_graphs.py::TestSkipFp8WeightUpdateTensor::*", "te",
         "resets TE's FP8GlobalStateManager (imports transformer_engine.pytorch.fp8 inside the test)"),
    Skip(UT + "transformer/test_transformer_block.py::*::test_gpu_forward_selective_checkpoint_fp8", "cuda",
         "runs the block in fp8 (e4m3); " + FP8_REFUSED, backends=NOT_GPU),
    Skip(UT + "test_tokenizer.py::*", "download",
         "fetches the GPT-2 vocab / merges from s3.amazonaws.com (core_v0.16.1's tokenizer tests)",
         versions=">=0.15.0,<0.17.0"),
    Skip(UT + "ssm/test_hybrid_block.py::TestHybridBlock::test_gdn_gpu_forward", "cuda",
         "runs a GatedDeltaNet layer forward: fla's Triton kernels (chunk_gated_delta_rule); " + TRITON_GPU_ONLY,
         backends=NOT_GPU, versions=">=0.19.0"),
    Skip(UT + "ssm/test_gated_delta_net.py::*", "cuda",
         "Gated DeltaNet runs flash-linear-attention's Triton kernels (fla-core 0.6.0 from the "
         "registries: chunk_gated_delta_rule, l2norm); " + TRITON_GPU_ONLY, backends=NOT_GPU),
    *(Skip(UT + f"distributed/mfsdp_v2/{f}.py::*", "cuda",
           "Megatron-FSDP v2 shards through torch's FSDP2 / DTensor / symmetric-memory helpers, which "
           "require a CUDA device (torch/cuda/_utils.py: \"Expected a cuda device, but got: cpu\")",
           backends=NOT_GPU)
      for f in ("test_fully_shard", "test_context", "test_annotation", "test_symmetric_memory", "test_cuda_graph")),
    Skip(UT + "distributed/test_param_and_grad_buffer.py::test_grad_sync[[]2-*", "ranks",
         "num_distributed_optimizer_instances=2 needs a data-parallel size divisible by 2 "
         "(parallel_state.py: \"Data parallel size should be divisible by partial DistOpt shard factor\")",
         needs_world=2),
    Skip(UT + "distributed/test_reduce_scatter_with_fp32_accumulation.py::*::test_reduce_scatter_with_fp32_accumulation[[]False-*",
         "ranks", "expects a bf16 reduce-scatter to differ from one accumulated in fp32; with 1 rank "
         "nothing is summed, and with 2 ranks one bf16 addition of two bf16 values rounds exactly as "
         "the fp32 sum cast to bf16 (gloo and NCCL alike), so the results agree; from 3 ranks they differ",
         needs_world=3),
    Skip(UT + "fusions/test_mla_yarn_rope_apply.py::TestFusedApplyMLARope::test_forward_backward_for_kv[[]sbhd[]]",
         "rounding", "bf16: compares the backend's fused MLA YaRN RoPE backward with Megatron's unfused "
         "one at atol 0.05 / rtol 0.02; 1 element of 131072 is off by 0.068 (H200, core_v0.19.0); "
         "the forward and the other layouts pass", backends=("cuda",), versions=">=0.19.0,<0.20.0"),
    Skip(UT + "ssm/ops/test_ssm_kernel.py::TestMambaDynamicInference::*", "package",
         "Mamba's dynamic-inference prefill calls causal-conv1d's causal_conv1d_varlen_states "
         "(mamba_mixer.py; NameError without the package); causal-conv1d is a CUDA source build (no wheel "
         "on the registries). megatron-adapt serves the decode-step kernels on cpu / npu only",
         backends=("cuda",)),
    Skip(DSA_TESTS + "TestDSAttentionTensorParallel::test_dsa_forward_consistency", "te",
         "clones every value of the indexer's state_dict with .detach(); TE's modules keep an "
         "_extra_state tensor there, Megatron's own linears (and megatron-adapt's TE-named ones built on "
         "them) keep None (get_extra_state: \"Keep compatibility with TE state dict\")"),
    Skip(UT + "test_fp8_utils.py::TestFP8Padding::*", "te",
         "Megatron defines what it tests (prepare_model_for_fp8_inference's padding wrapper and its "
         "_fp8_inference_wrapped_modules set) only `if HAVE_TE`; the test mocks TE's Fp8Padding / "
         "Fp8Unpadding and TE linear types around it, and its setup fails on the absent set"),
    Skip(UT + "test_utils.py::test_straggler_detector", "cuda",
         "Megatron's StragglerDetector turns itself off where torch.cuda.is_available() is False "
         "(\"No CUDA, No Support\", core/utils.py), so its control port never opens (connection "
         "refused); the cpu backend does not claim CUDA is available", backends=NOT_GPU),
    Skip(UT + "export/trtllm/test_*_fp8.py::*", "cuda",
         "builds its model with fp8 set; " + FP8_REFUSED, backends=NOT_GPU),
    Skip(UT + "determinism/correctness/test_fp8_determinism.py::*", "cuda",
         "runs layers under fp8 recipes; " + FP8_REFUSED, backends=NOT_GPU),
    Skip(UT + "generalized_tensor_parallel/*.py::*", "te",
         "gtp_test_utils imports transformer_engine.pytorch (is_mxfp8_available, FP8GlobalStateManager) "
         "at module level: generalized tensor parallelism shards TE's quantized parameters "
         "(GTPShardedParam over TE modules)"),
    Skip(UT + "extension/test_te_lmhead_column_parallel_linear.py::TestGPTModelOutputLayerSelection::"
         "test_default_uses_column_parallel_linear", "te",
         "asserts the output layer is a ColumnParallelLinear (it is) and then that it is not TE's "
         "TELMHeadColumnParallelLinear, which is None without TE (isinstance: TypeError)"),
    Skip(UT + "transformer/test_te_layers_batch_invariant.py::*", "te",
         BATCH_INVARIANT_TE + "; the test compares TE layers with and without it"),
    Skip(UT + "rl/test_rl_batch_invariant.py::*", "te", BATCH_INVARIANT_TE),
    Skip(UT + "rl/test_rl_utils.py::TestRLUtils::test_optimizer_offload[[]*", "cuda",
         "checks that the optimizer state moves from the GPU to host memory and back (asserts 'cuda' in its "
         "devices first)", backends=NOT_GPU),
    Skip(UT + "rl/test_rl_utils.py::TestRLUtils::test_prepare_data_for_update[[]tp?-pp[248]]", "cuda",
         "relies on NCCL's point-to-point semantics: its MockModel returns (2, 4, 754) fp32 logits on every "
         "pipeline stage, so the first stage sends 24,128 bytes, while the next stage posts a receive of "
         "(seq 4, micro-batch 2, hidden_size 0) elements (the mock's TransformerConfig sets no hidden size). "
         "NCCL completes a receive smaller than its send without an error (NVIDIA/nccl#1938); gloo aborts "
         "('Received data size doesn't match expected size. 24128 vs 0')", backends=NOT_GPU),
    Skip(UT + "rl/test_rl_utils.py::TestRLUtils::test_get_logprobs_cuda_graphs[[]*", "cuda",
         "captures the logprob forward in CUDA graphs (cuda_graph_impl='local')", backends=NOT_GPU,
         versions=">=0.17.0,<0.20.0"),
    Skip(UT + "inference/test_moe_permute.py::*", "cuda",
         "Megatron's own Triton kernels for inference MoE (inference/moe/permute.py); " + TRITON_GPU_ONLY,
         backends=NOT_GPU),
    Skip(UT + "inference/test_vllm_fused_moe.py::*", "cuda",
         "Megatron's own Triton kernels (vLLM's fused MoE, moe_align_block_size, moe_sum); " + TRITON_GPU_ONLY,
         backends=NOT_GPU),
    Skip(UT + "inference/text_generation_controllers/test_mtp_utils.py::*", "cuda",
         "Megatron's own Triton kernels for speculative decoding (inference/text_generation_controllers/"
         "mtp_utils.py); " + TRITON_GPU_ONLY, backends=NOT_GPU),
    *(Skip(UT + "inference/text_generation_controllers/test_text_generation_controller.py::"
           f"TestTextGenerationController::{name}", "cuda",
           "Megatron's own Triton kernels for speculative decoding and KV-cache rewind (inference/"
           "text_generation_controllers/mtp_utils_triton.py); " + TRITON_GPU_ONLY,
           backends=NOT_GPU, versions=">=0.19.0,<0.20.0")
      for name in ("test_speculative_verify_tokens[[]*", "test_speculative_multinomial_sampling",
                   "test_rewind_kv_cache[[]*", "test_rewind_kv_cache_stale_padding_is_safe")),
    *(Skip(UT + f"inference/text_generation_controllers/test_text_generation_controller.py::{name}", "cuda",
           "checks the asynchronous sampling copies' CUDA events (recorded on torch.cuda.current_stream(), "
           "a CPU-ready event to synchronize): on the cpu backend the copy is synchronous and no event is "
           "recorded", backends=NOT_GPU, versions=">=0.19.0,<0.20.0")
      for name in ("test_run_async_sched_sample_records_gpu_ready_event",
                   "test_copy_async_sched_sample_to_cpu_uses_reusable_buffer_and_copy_stream",
                   "test_copy_async_sched_log_probs_to_cpu_uses_reusable_buffers_and_copy_stream")),
    *(Skip(UT + f"inference/text_generation_controllers/{f}.py::"
           "TestTextGenerationController::test_zero_tokens_generated_batch_vs_single", "cuda",
           "expects a bf16 model's prompt log-probs batched and one request at a time to agree to 1e-6 "
           "relative, which holds for the GPU's GEMMs at these shapes; the CPU's bf16 GEMMs block by "
           "batch size and differ by about 1e-4 (H100 host, 2 processes)", backends=NOT_GPU, versions=v)
      for f, v in (("test_text_generation_controller", ">=0.19.0,<0.20.0"),
                   ("test_simple_text_generation_controller", ">=0.15.0,<0.17.0"))),
    Skip(UT + "inference/engines/test_static_engine.py::TestStaticInferenceEngine::test_streaming", "cuda",
         "samples 10 tokens from a random model with the tokenizer's eod set to a token it can sample "
         "(vocab_size - 1): whether a draw ends a request early depends on the device's random stream. "
         "CUDA's draws miss it; the CPU generator's hit it (two outputs of equal length, then the "
         "stream ends early). core_v0.19.0's version sets an eod it cannot sample, and passes on cpu",
         backends=NOT_GPU, versions=">=0.15.0,<0.17.0"),
    Skip(UT + "transformer/test_cuda_graphs.py::TestInlineCaptureManager::*", "cuda",
         "core 0.19's inline capture of one function records it as a torch.cuda.CUDAGraph on a side "
         "torch.cuda.Stream (torch.cuda.set_stream rejects a CPU stream)", backends=NOT_GPU, versions=">=0.19.0"),
    Skip(UT + "transformer/test_full_cuda_graph.py::test_ddp_grad_accumulators_share_full_cuda_graph_stream", "cuda",
         "captures DDP's gradient hooks in a torch.cuda.CUDAGraph on a capture stream", backends=NOT_GPU),
    Skip(UT + "inference/test_mtp_cuda_graph_inference.py::*", "cuda",
         "captures and replays torch.cuda.CUDAGraph objects", backends=NOT_GPU),
    Skip(UT + "inference/test_mtp_cuda_graph_inference.py::TestMTPBlockScopeCudaGraph::*", "package",
         FLASH_ATTN_KV, backends=("cuda",)),
    Skip(UT + "inference/test_moe_dispatching_and_routing.py::TestNVLSAllGatherVDispatcher::*", "cuda",
         "NVLSAllGatherVDispatcher allocates NVLink SHARP symmetric memory "
         "(torch.distributed._symmetric_memory) for its all-gather", backends=NOT_GPU),
    Skip(UT + "inference/test_moe_dispatching_and_routing.py::TestNVLSAllGatherVDispatcher::"
         "test_cuda_graph_dispatch_combine[[]*", "cuda",
         "stores through an NVLink multicast address (Megatron's Triton kernel inference/moe/metadata.py, "
         "multimem.st); this machine has NVLink multicast turned off (TORCH_SYMM_MEM_DISABLE_MULTICAST / "
         "NCCL_NVLS_ENABLE=0), the address is 0 and Triton refuses the kernel ('tt.int_to_ptr' of an i32; "
         "2 x H200, 2026-11-28)", backends=("cuda",), when=nvlink_multicast_off),
    Skip(UT + "inference/test_moe_dispatching_and_routing.py::TestNVLSAllGatherVDispatcher::"
         "test_cuda_graph_dispatch_combine[[]*", "ranks",
         "expects the dispatch output padded to engine_max_tokens x EP; with EP 1 token_dispatch "
         "returns its input unpadded (`if self.ep_size == 1: return hidden_states, probs`)",
         backends=("cuda",), needs_world=2),
    Skip(UT + "transformer/experimental_attention_variant/test_absorbed_mla.py::*", "rounding",
         "compares absorbed and standard MLA in bf16 by cosine similarity > 0.9999, gradients "
         "included; on cpu the two bf16 paths round apart by slightly more (linear_kv_down_proj.weight "
         "gradient: 0.99987, core_v0.19.0, 2 ranks), and each case takes over 2 minutes on 2 cores. "
         "Runs and passes on the cuda backend", backends=("cpu",)),
    Skip(UT + "transformer/test_spec_customization.py::*", "te",
         "`import transformer_engine as te` at module level and builds TE's own te.pytorch modules "
         "(Linear, LayerNormLinear) into custom specs: tests of TE's library"),
    Skip(UT + "distributed/mfsdp_v1/test_mcore_fully_sharded_data_parallel.py::TestFullyShardedDataParallel::"
         "test_fsdp_db_persist_buf_on_alloc_fail", "ranks",
         "expects an FSDP unit outside the fixed double-buffer pool, which a data-parallel group of one rank does "
         "not shard (cpu, core_v0.19.0: fails with 1 process, passes with 2; failed so on one H200)",
         versions=">=0.19.0,<0.20.0", needs_world=2),
    Skip(UT + "fusions/test_rmsnorm_residual_fusion.py::*", "te",
         "tests TEFusedResidualRMSNorm against transformer_engine.pytorch.RMSNorm (imported at module "
         "level): TE's own fused kernel"),
    *(Skip(UT + f"distributed/{d}/test_mfsdp_fully_shard.py::*", "te",
           "imports transformer_engine and TE's FusedAdam at module level and fully shards TE modules "
           "(te.pytorch.Linear / TransformerLayer, TE's fp8 recipes)", versions=v)
      for d, v in (("mfsdp_v1", ">=0.17.0,<0.20.0"), ("megatron_fsdp", ">=0.15.0,<0.17.0"))),
    *(Skip(UT + "ssm/test_gated_delta_net.py::" + t, "package",
           "fla-core 0.6.0 refuses its gated chunk_bwd_dqkwg kernel on Hopper with Triton 3.4 - 3.7.0 "
           "(\"produces incorrect results\", fla issue #640): it needs Triton >= 3.7.1 or tilelang; the H100 / H200 "
           "machines have Triton 3.6 and no tilelang", backends=("cuda",))
      for t in ("TestGatedDeltaNet::test_selective_recompute_norm_out[[]*",
                "test_parallel_gated_delta_net_correctness[[]*")),
    *(Skip(UT + f"ssm/test_gated_delta_net.py::TestGatedDeltaNet::{t}[[]*-2]", "rounding",
           "compares the packed (THD) and padded (SBHD) forwards at 3e-4 in bf16; with context parallelism 2 "
           "the two layouts reach fla's chunked kernels split differently and round apart by one bf16 step "
           "(max |diff| 0.0078125 = 2^-7 on outputs of order 1, 15-17 % of the elements; 2 x H200, core_v0.19.0); "
           "at CP 1 they pass", backends=("cuda",))
      for t in ("test_gpu_forward_thd_correctness", "test_gpu_forward_thd_padding_correctness")),
    *(Skip(UT + f"distributed/mfsdp_v2/{t}", "torch",
           "Megatron's profiler helper (mfsdp_v2/profiler_utils.py: collect_linked_kernels) reads "
           "FunctionEvent.linked_correlation_id, which this torch does not have (AttributeError; "
           "torch 2.11 on the GPU machine of 2026-11-28)", backends=("cuda",), versions=">=0.19.0",
           when=torch_profiler_lacks_linked_correlation_id)
      for t in ("test_fully_shard.py::test_overlaps_communication_and_compute[[]*",
                "test_fully_shard.py::test_hsdp_defers_dp_outer_allreduce_to_last_microbatch",
                "test_symmetric_memory.py::test_fully_shard_symmetric_memory_matches_default_and_profiles_nccl[[]*",
                "test_symmetric_memory.py::test_fully_shard_zero_cta_moves_all_gather_to_copy_engine")),
    Skip(UT + "transformer/moe/test_grouped_mlp.py::TestTEGroupedMLP::*", "internals",
         "asserts that the TE spec builds TEGroupedMLP for bias-free experts; on core 0.15 - 0.16 megatron-adapt's "
         "spec keeps Megatron's legacy GroupedMLP there in bf16 (TEGroupedMLP only with biases or fp8; "
         "docs/moe.md)", versions=">=0.15.0,<0.17.0"),
    Skip(UT + "distributed/mfsdp_v2/test_optimizer.py::*", "te",
         "imports TE's FusedAdam (transformer_engine.pytorch.optimizers) at module level: TE's "
         "optimizer over Megatron-FSDP's sharded parameters"),
]


# Tests slower than a sweep's 150 s limit on a backend, by their size (not hangs): their own limit
SLOW: list[Slow] = [
    Slow(UT + "transformer/test_transformer_block_custom_pgs.py::TestTransformerBlockWithProcessGroups::"
         "test_params_and_grads_match_transformer_block[[]2-2-1-1[]]", 900,
         "two 3-layer hidden-4096 blocks (1.2 G parameters) forward and backward over 4 x 4096 tokens at "
         "TP 2 on the CPU: passed in 134 s (core_v0.16.1, 5 threads a rank) and 190 s (core_v0.19.0, 3 "
         "threads a rank, beside another run) on a 16-core host, 2026-11-29; over 380 s on others"),
    Slow(UT + "transformer/test_transformer_block_custom_pgs.py::TestTransformerBlockWithProcessGroups::"
         "test_params_and_grads_match_transformer_block[[]2-1-2-1[]]", 1500,
         "the same blocks with CP 2 (the ring's attention over full heads, 26.6 GB a rank): passed in "
         "386 s on a 251 GB host (2026-11-28); still running after 560 s with 5 threads a rank on a "
         "16-core host (core_v0.19.0, 2026-11-29)"),
    Slow(UT + "dist_checkpointing/models/test_mlp_glu.py::TestParallelMLPWithGLU::test_oom_is_handled", 900,
         "its merge falls back to the host with 60 % of each GPU's memory: at 2 ranks on 2 x H200 the host "
         "copies about 170 GB, past the sweep's 150 s limit (2026-11-28)", backends=("cuda",)),
]

# Test modules that import these Transformer Engine names at module level; the plugin serves them
# (see _te_fp8_shim) while the module imports.
TE_IMPORTING_MODULES = {UT + "models/test_gpt_model.py", UT + "models/test_mamba_model.py",
                        UT + "models/test_hybrid_model.py", UT + "test_optimizer.py",
                        UT + "dist_checkpointing/models/test_moe_experts.py",
                        UT + "transformer/test_cuda_graphs.py", UT + "inference/engines/test_dynamic_engine.py",
                        UT + "inference/text_generation_controllers/test_text_generation_controller.py",
                        UT + "inference/test_dynamic_sink_attention_e2e.py",
                        UT + "inference/text_generation_controllers/test_simple_text_generation_controller.py",
                        UT + "transformer/test_multi_latent_attention.py",
                        UT + "test_fp8_param.py", UT + "test_fp4_param.py"}

# Tests that take the default process group as given. In Megatron's CI an earlier test of the session
# has made it (Utils.initialize_model_parallel leaves it up); run alone, or after files whose tests are
# all skipped here (test_fp8_param.py without TE), they find none: "Default process group has not been
# initialized". At 2 ranks these are [ranks] skips (grids of 8); at 8 they run.
NEEDS_DEFAULT_GROUP = (UT + "test_hyper_comm_grid.py::TestHyperCommGrid::*",)

# Tests that import TE's classes from megatron.core.extensions.transformer_engine inside the test and
# check the built modules against them (isinstance); without TE those names are None (a TypeError in
# isinstance). While one of them runs, the names are the classes megatron-adapt's layer-spec
# provider gives for them, the classes the model was built from (see _te_classes).
TE_CLASS_TESTS = (UT + "models/test_hybrid_model.py::TestMLAQKNormResolution::*",
                  UT + "models/test_hybrid_model.py::TestMLAQKNormSpecValidation::*",
                  UT + "models/test_hybrid_model.py::TestMLADownProjFusion::*",
                  UT + "models/test_hybrid_model.py::TestDSAQKNormResolution::*",
                  # build DSA's indexer from TELinear / TENorm imported inside the test
                  *(DSA_TESTS + c + "::*" for c in ("TestDSAIndexer", "TestDSAttention", "TestIndexerTensorParallel",
                                                    "TestDSAttentionTensorParallel")),
                  DSA_TESTS + "test_lighting_indexer_indices_preserves_single_head_weight_axis*")
# Test modules that import those names at module level (try: ... except ImportError: None) and build
# specs from them: the same binding while the module imports.
TE_CLASS_MODULES = {UT + "models/mimo/test_mimo_1f1b_schedule.py",
                    UT + "dist_checkpointing/models/test_mamba.py",
                    UT + "transformer/test_transformer_block_custom_pgs.py",
                    # TE-named linears' initialisation at TP1 against TP4 (the provider's classes)
                    UT + "tensor_parallel/test_initialization.py",
                    # checks the hybrid spec's MLA core attention against the TEDotProductAttention it imports
                    UT + "ssm/test_hybrid_block.py",
                    # SequentialMLP's experts from TEColumnParallelLinear / TERowParallelLinear against the
                    # local linears (TP 2 x EP 2: a [ranks] skip below 4 ranks)
                    UT + "transformer/moe/test_sequential_mlp.py"}


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def pytest_addoption(parser):
    group = parser.getgroup("megatron-adapt")
    group.addoption("--megatron-adapt-json", default=None,
                    help="write each test's outcome as JSON here ({rank} is replaced by the rank)")
    group.addoption("--megatron-adapt-pg-timeout", type=float, default=300.0,
                    help="seconds before a collective of a process group the test made times out")
    group.addoption("--megatron-adapt-test-timeout", type=float, default=600.0,
                    help="seconds a test may run before it fails (0: no limit)")


def _backend_and_version():
    from megatron_adapt.core import active_backend
    from megatron_adapt.versions import megatron_core_version

    backend = active_backend()
    if backend is None:
        raise pytest.UsageError(
            "megatron_adapt.apps.pytest_plugin: megatron-adapt is not applied in this process; run "
            "pytest under `megatron-adapt-run` (or `import megatron_adapt` with MEGATRON_ADAPT_AUTO unset)")
    return backend.name, megatron_core_version()


def skips_for(backend: str, version) -> list[Skip]:
    from megatron_adapt.versions import in_range

    return [s for s in SKIPS if backend in s.backends and in_range(s.versions, version)
            and (not s.needs_world or _world() < s.needs_world)
            and (not s.needs_host_gb or host_memory_gb() < s.needs_host_gb)
            and (s.when is None or s.when())]


def host_memory_gb() -> float:
    """This host's physical memory in GB (1e9 bytes)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def skip_reason(nodeid: str, skips) -> str | None:
    for s in skips:
        if fnmatch.fnmatchcase(nodeid, s.pattern):
            return f"[{s.category}] {CATEGORIES[s.category]}: {s.reason}"
    return None


class _Plugin:
    def __init__(self, config):
        self.config = config
        self.backend, self.version = _backend_and_version()
        self.skips = skips_for(self.backend, self.version)
        self.outcomes: dict[str, dict] = {}
        self.deselected: list[str] = []
        self.lifted: dict[str, list[str]] = {}   # node id -> Megatron skipif reasons lifted (served)
        self.utils = None   # Megatron's test Utils, once its conftest is registered
        _pg_timeout(config.getoption("--megatron-adapt-pg-timeout"))
        if self.backend == "cpu":
            _free_groups_on_destroy()
            _track_ddp_instances()

    # -- the conftest's data download and Utils.initialize_model_parallel --------------------
    @pytest.hookimpl
    def pytest_plugin_registered(self, plugin, manager):
        name = getattr(plugin, "__name__", "")
        if not name.endswith("tests.unit_tests.conftest"):
            return
        if hasattr(plugin, "download_and_extract_asset"):
            def no_download(*args, **kwargs):
                raise RuntimeError("megatron_adapt.apps.pytest_plugin: no downloads; tests that need "
                                   "/opt/data are skipped (category 'download')")
            plugin.download_and_extract_asset = no_download
        utilities = importlib.import_module(name.rsplit(".", 1)[0] + ".test_utilities")
        _guard_world_size(utilities.Utils)
        self.utils = utilities.Utils
        checkpointing = sys.modules.get(name.rsplit(".", 1)[0] + ".dist_checkpointing")
        if checkpointing is not None and hasattr(checkpointing, "TempNamedDir"):
            _shared_dir_removed_by_rank_0_only(checkpointing.TempNamedDir, utilities.Utils)

    # -- skips and the TE shim ---------------------------------------------------------------
    @pytest.hookimpl(trylast=True)   # after `-k` / `-m` deselection: only the tests that run
    def pytest_collection_modifyitems(self, config, items):
        for item in items:
            lifted = _lift_served_skipifs(item)
            if lifted:
                self.lifted[item.nodeid] = lifted
            reason = skip_reason(item.nodeid, self.skips) or _layout_from_params(item)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector):
        if isinstance(collector, pytest.Module) and _relpath(collector) in TE_CLASS_MODULES:
            with _te_classes():
                return (yield)
        if isinstance(collector, pytest.Module) and _relpath(collector) in TE_IMPORTING_MODULES:
            try:
                _preimport_megatron(str(collector.path))
            except Exception:  # the module's own import reports it, as a collection error
                return (yield)
            with _te_fp8_shim():
                report = yield
            return report
        report = yield
        if isinstance(collector, pytest.Module) and report.failed:
            return _te_library_skip(collector, report, self.skips)
        return report

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        """A test that fails because the layout it asks for is larger than the world, where Megatron
        says so outside Utils.initialize_model_parallel (RANKS_ERRORS), is a [ranks] skip."""
        report = yield
        reason = _ranks_failure_reason(call.excinfo) if report.failed else None
        if reason:
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0, "Skipped: " + reason)
        return report

    # -- outcomes ----------------------------------------------------------------------------
    def pytest_collectreport(self, report):
        if report.failed:
            self.outcomes[report.nodeid] = {"outcome": "error", "when": "collect",
                                            "message": _short(report.longreprtext)}
        elif report.skipped and isinstance(report.longrepr, tuple):
            self.outcomes[report.nodeid] = {"outcome": "skipped",
                                            "reason": report.longrepr[2].removeprefix("Skipped: ")}

    def pytest_runtest_logreport(self, report):
        rec = self.outcomes.setdefault(report.nodeid, {"outcome": "passed"})
        if rec["outcome"] == "running":
            rec["outcome"] = "passed"
        if report.skipped and report.when in ("setup", "call"):
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            rec.update(outcome="skipped", reason=reason.removeprefix("Skipped: "))
        elif report.failed:
            if report.when == "call":
                rec.update(outcome="failed", message=_short(report.longreprtext))
            elif rec["outcome"] != "failed":
                rec.update(outcome="error", when=report.when, message=_short(report.longreprtext))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.outcomes[item.nodeid] = {"outcome": "running"}
        self._write()
        limit = time_limit(item.nodeid, self.config.getoption("--megatron-adapt-test-timeout"), self.backend)
        if not limit or not hasattr(signal, "SIGALRM"):
            return (yield)

        def expired(signum, frame):
            raise TimeoutError(f"megatron_adapt.apps.pytest_plugin: {item.nodeid} ran past its time limit "
                               f"of {limit:g} s (--megatron-adapt-test-timeout, or its SLOW entry)")
        previous = signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, limit)
        faulthandler.dump_traceback_later(limit + 60, exit=True)
        try:
            return (yield)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            faulthandler.cancel_dump_traceback_later()
            signal.signal(signal.SIGALRM, previous)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        """Collect this test's garbage before the next test starts. Megatron's MoEModelTestContainer
        destroys the parallel state in `__del__`; a container left in a reference cycle was collected
        by Python's cyclic GC at some point of a later test, whose groups then vanished ("expert model
        parallel group is not initialized" in test_a2a_token_dispatcher, one GPU, core_v0.16.1 and
        core_v0.19.0; "tensor model parallel group ..." in test_token_dispatcher). Only after tests
        of modules that use that container: a full collection costs ~0.4 s with Megatron loaded."""
        try:
            return (yield)
        finally:
            if hasattr(getattr(item, "module", None), "MoEModelTestContainer"):
                gc.collect()
            if self.backend == "cpu":
                _release_ddps_held_by_their_hooks()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item):
        _AT_TEST_START["microbatch_calculator"] = _microbatch_calculator_set()
        if any(fnmatch.fnmatchcase(item.nodeid, p) for p in NEEDS_DEFAULT_GROUP):
            _default_group_up(self.utils)
        # setup too: DSA's tests import TELinear / TENorm in setup_method and build the module there
        with _te_classes_for(item):
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        with _te_classes_for(item):
            return (yield)

    def pytest_runtest_logfinish(self, nodeid, location):
        self._write()  # after every test: a run killed by its time limit still has its counts

    def pytest_deselected(self, items):
        """Tests a `-m` expression left out (the script passes Megatron CI's own selection)."""
        self.deselected.extend(item.nodeid for item in items)

    def pytest_sessionfinish(self, session):
        self._write(finished=True)

    def _write(self, finished=False):
        path = self.config.getoption("--megatron-adapt-json")
        if not path:
            return
        path = path.replace("{rank}", str(_rank()))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump({"rank": _rank(), "world_size": _world(), "backend": self.backend,
                       "megatron_core": str(self.version), "finished": finished,
                       "markexpr": self.config.getoption("markexpr") or None,
                       "deselected": self.deselected, "lifted_skipifs": self.lifted,
                       "tests": self.outcomes}, f, indent=1)
        os.replace(path + ".tmp", path)


def _short(text: str, limit: int = 1500) -> str:
    return text if len(text) <= limit else text[-limit:]


def _relpath(node) -> str:
    return os.path.relpath(str(node.path), str(node.config.rootpath)).replace(os.sep, "/")


_LAYOUT_PARAMS = {"tp": ("tp", "tp_size", "tensor_model_parallel_size"),
                  "pp": ("pp", "pp_size", "pipeline_model_parallel_size"),
                  "cp": ("cp", "cp_size", "context_parallel_size")}


def _layout_from_params(item) -> str | None:
    """A [ranks] skip decided at collection from the test's own parameters (tp / pp / cp): Megatron's
    parametrised parallel tests often build and checkpoint a baseline model first and reach
    Utils.initialize_model_parallel with the layout only afterwards (test_attention's
    correctness tests: ~25 s a case on cpu before the runtime guard skips it). Only for tests that
    set the layout up for real (`_initialises_layout`)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    sizes = {}
    for axis, names in _LAYOUT_PARAMS.items():
        value = next((params[n] for n in names if n in params), 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return None
        sizes[axis] = value
    reason = _ranks_reason(sizes["tp"] * sizes["pp"] * sizes["cp"],
                           f"parametrised TP{sizes['tp']} x PP{sizes['pp']} x CP{sizes['cp']}")
    if reason and _initialises_layout(getattr(item, "function", None), getattr(item, "cls", None)):
        return reason
    return None


@functools.lru_cache(maxsize=None)
def _initialises_layout(fn, cls) -> bool:
    """The test, or a function of its module or class that it calls, sets up the parallel state for
    real (`initialize_model_parallel`, not `fake_initialize_model_parallel`): tests that only parse
    a layout or fake the ranks take tp / pp parameters too, and run in any world. (Once per test
    function, not per parametrised case.)"""
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    sources, mod = [src], inspect.getmodule(fn)
    for name in set(re.findall(r"\b([A-Za-z_]\w*)\s*\(", src)):
        for owner in (mod, cls):
            helper = getattr(owner, name, None) if owner is not None else None
            if inspect.isfunction(helper) and helper is not fn:
                try:
                    sources.append(inspect.getsource(helper))
                except (OSError, TypeError):
                    pass
    return any(re.search(r"(?<!fake_)initialize_model_parallel\(", s) for s in sources)


def _ranks_reason(need: int, what: str) -> str | None:
    """The [ranks] skip reason when `what` (a layout of `need` ranks) does not fit this world."""
    world = _world()
    if world % need == 0:
        return None
    return f"[ranks] {CATEGORIES['ranks']}: {what} needs a world size divisible by {need}, this run has {world}"


# Errors Megatron raises when a layout is larger than the world, outside Utils.initialize_model_parallel
# (tests written for 8 GPUs build HyperCommGrids in setup_class; others parse a TP 2 layout with
# Megatron's argument parser): (raising file, exception type, text of its message).
RANKS_ERRORS = (
    (os.path.join("megatron", "core", "hyper_comm_grid.py"), RuntimeError, "is over sized with world size"),
    (os.path.join("megatron", "training", "arguments.py"), AssertionError, "is not divisible by total_model_size"),
)


def _ranks_failure_reason(excinfo) -> str | None:
    """The [ranks] reason when `excinfo` is one of RANKS_ERRORS, raised in that file and not caught
    by the test (a test that expects the error, with pytest.raises, passes as it is)."""
    if excinfo is None:
        return None
    where = str(excinfo.traceback[-1].path) if excinfo.traceback else ""
    for path, kind, text in RANKS_ERRORS:
        if isinstance(excinfo.value, kind) and text in str(excinfo.value) and where.endswith(path):
            message = str(excinfo.value).splitlines()[0]
            return f"[ranks] {CATEGORIES['ranks']}: {path} says \"{message}\""
    return None


def _guard_world_size(utils_cls):
    original = utils_cls.initialize_model_parallel
    if getattr(original, "_megatron_adapt_guard", False):
        return

    def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                  virtual_pipeline_model_parallel_size=None, **kwargs):
        tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
        cp = kwargs.get("context_parallel_size", 1)
        ep = kwargs.get("expert_model_parallel_size", 1)
        etp = kwargs.get("expert_tensor_parallel_size") or tp
        dopt = kwargs.get("num_distributed_optimizer_instances") or 1   # each instance a DP subgroup
        dense = f"TP{tp} x PP{pp} x CP{cp}" + (f" x {dopt} distributed-optimizer instances" if dopt > 1 else "")
        for need, what in ((tp * pp * cp * dopt, dense), (ep * etp * pp, f"EP{ep} x ETP{etp} x PP{pp}")):
            reason = _ranks_reason(need, what)
            if reason:
                _leave_a_parallel_state(original)
                pytest.skip(reason)
        return original(tensor_model_parallel_size, pipeline_model_parallel_size,
                        virtual_pipeline_model_parallel_size, **kwargs)
    initialize_model_parallel._megatron_adapt_guard = True
    utils_cls.initialize_model_parallel = staticmethod(initialize_model_parallel)


def _default_group_up(utils_cls):
    """The default process group, made as Megatron's tests make it (Utils.initialize_distributed),
    where a NEEDS_DEFAULT_GROUP test would otherwise find none."""
    import torch.distributed as dist

    if utils_cls is not None and not dist.is_initialized():
        utils_cls.initialize_distributed()


def _shared_dir_removed_by_rank_0_only(temp_dir_cls, utils_cls):
    """Megatron's TempNamedDir (tests/unit_tests/dist_checkpointing) is one directory that every rank
    shares. Its cleanup() removes it on rank 0 only, but TemporaryDirectory's finalizer, which its
    __init__ registers on every rank, removes it on the others as soon as the object goes: at the
    end of the `with` block, since `as` binds the path, not the object. A rank that leaves a test
    late then removes the directory that rank 0 has already made again for the next test ("Checkpoint
    directory ... does not exist", FileExistsError in os.makedirs: test_optimizer.py at 8 ranks on
    2 cores, where ranks drift apart). Ranks other than 0 detach the finalizer: only rank 0 removes,
    as cleanup() intends."""
    original = temp_dir_cls.__init__
    if getattr(original, "_megatron_adapt_rank_0_removes", False):
        return

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        finalizer = getattr(self, "_finalizer", None)
        if getattr(utils_cls, "rank", 0) != 0 and finalizer is not None:
            finalizer.detach()
    __init__._megatron_adapt_rank_0_removes = True
    temp_dir_cls.__init__ = __init__


_AT_TEST_START = {"microbatch_calculator": None}   # global state as the running test found it


def _microbatch_calculator_set() -> bool:
    from megatron.core import num_microbatches_calculator as calculator

    return getattr(calculator, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None) is not None


def _leave_a_parallel_state(initialize):
    """Before a [ranks] skip in the middle of a test, leave the global state the next tests expect:
    - a test that tore the parallel state down to build a bigger layout (`destroy_model_parallel()`,
      then the layout this world cannot hold) would leave none, and the next tests of its class, set
      up once in `setup_class`, failed on "... group is not initialized" (TestDynamicContext,
      core_v0.19.0): the default layout (TP1 PP1) instead;
    - a micro-batch calculator the test set up itself would never reach the test's own
      `unset_num_microbatches_calculator()`, and the next case failed on "already initialized"
      (test_pipeline_layout, core_v0.16.1): unset it."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        initialize(1, 1)
    if _AT_TEST_START["microbatch_calculator"] is False and _microbatch_calculator_set():
        from megatron.core.num_microbatches_calculator import unset_num_microbatches_calculator

        unset_num_microbatches_calculator()


def _pg_timeout(seconds: float):
    import datetime

    import torch.distributed as dist

    original = dist.init_process_group
    if getattr(original, "_megatron_adapt_timeout", False):
        return

    def init_process_group(*args, **kwargs):
        kwargs.setdefault("timeout", datetime.timedelta(seconds=seconds))
        return original(*args, **kwargs)
    init_process_group._megatron_adapt_timeout = True
    dist.init_process_group = init_process_group


def _free_groups_on_destroy():
    """Megatron's destroy_model_parallel() forgets its groups but never destroys them: torch keeps
    every group alive, and on the cpu backend each is a gloo group with its own threads (about 50
    threads per initialize / destroy cycle, measured). A directory's hundreds of tests ran the host
    out of threads ("Resource temporarily unavailable" creating a gloo group, fork failing with
    BlockingIOError). Here the groups it forgets are destroyed (a local call for gloo)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    original = parallel_state.destroy_model_parallel
    if getattr(original, "_megatron_adapt_frees", False):
        return

    def destroy_model_parallel(*args, **kwargs):
        groups = [g for g in (getattr(parallel_state, "_global_process_group_list", None) or ())
                  if g is not None and g is not dist.GroupMember.WORLD]
        result = original(*args, **kwargs)
        live = dist.distributed_c10d._world.pg_map if dist.is_initialized() else {}
        for group in groups:
            if group in live:
                dist.destroy_process_group(group)
        return result
    destroy_model_parallel._megatron_adapt_frees = True
    parallel_state.destroy_model_parallel = destroy_model_parallel


_DDP_INSTANCES: "weakref.WeakSet" = weakref.WeakSet()


def _track_ddp_instances():
    """Remember each Megatron DistributedDataParallel made, weakly, for _release_ddps_held_by_their_hooks."""
    from megatron.core.distributed import distributed_data_parallel as ddp_module

    cls = ddp_module.DistributedDataParallel
    original = cls.__init__
    if getattr(original, "_megatron_adapt_tracks", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _DDP_INSTANCES.add(self)
    __init__._megatron_adapt_tracks = True
    cls.__init__ = __init__


def _release_ddps_held_by_their_hooks() -> int:
    """Free the models that a test's Megatron DDP keeps alive after the test has let them go.

    Megatron's DDP registers a hook on each parameter's AccumulateGrad node; the hook's closure holds
    the DDP, and so the model. A module that keeps a forward output as an attribute (the MoE token
    dispatchers keep `local_probs`) holds the autograd graph, which holds the AccumulateGrad nodes: a
    cycle through C++ autograd nodes, which Python's cyclic GC cannot see. Every model of every test
    then stays in memory: in core_v0.16.1's test_multi_token_prediction.py each case left two
    GPT+MoE models (~400 MB a rank), until 8 ranks on a 24 GiB host were killed by the OOM killer.
    A DDP whose only referrers are its own methods' hook closures is unreachable from Python; its
    attributes are dropped so the rest of the cycle is collected. Returns how many were released."""
    if not _DDP_INSTANCES:
        return 0
    gc.collect()
    candidates = list(_DDP_INSTANCES)
    dead = [ddp for ddp in candidates if _held_only_by_own_hooks(ddp, ignore=(candidates,))]
    for ddp in dead:
        ddp.__dict__.clear()
    released = len(dead)
    del candidates, dead
    if released:
        gc.collect()
    return released


def _held_only_by_own_hooks(obj, ignore=()) -> bool:
    """Whether every Python referrer of obj is a closure cell of a function defined in one of its
    classes' methods (its hooks), found in three passes of gc.get_referrers."""
    ignored = {id(x) for x in ignore}
    prefixes = tuple(c.__qualname__ + "." for c in type(obj).__mro__ if c.__module__.startswith("megatron."))

    def referrers(*objs, drop_tuples_of_them=False):
        searched = {id(o) for o in objs}
        found = [r for r in gc.get_referrers(*objs)
                 if id(r) not in ignored and not isinstance(r, types.FrameType)
                 and not (drop_tuples_of_them and isinstance(r, tuple) and all(id(x) in searched for x in r))]
        ignored.add(id(found))   # our own lists hold what they found
        return found

    cells = referrers(obj)
    if not cells or not all(isinstance(c, types.CellType) for c in cells):
        return False
    closures = referrers(*cells)
    if not all(isinstance(t, tuple) for t in closures):
        return False
    # a tuple made of the closures themselves is a call's argument tuple, not a holder
    functions = referrers(*closures, drop_tuples_of_them=True)
    return bool(functions) and all(isinstance(f, types.FunctionType) and f.__qualname__.startswith(prefixes)
                                   for f in functions)


def _te_library_skip(collector, report, skips):
    """A test module whose import fails only because it imports Transformer Engine's own library
    (no TE here), and that the skip table lists as [te] with the reason, is reported skipped with
    that reason; any other import error stays a collection error."""
    reason = skip_reason(_relpath(collector) + "::*", skips)
    if reason and reason.startswith("[te]") and "No module named 'transformer_engine" in report.longreprtext:
        report.outcome = "skipped"
        report.longrepr = (str(collector.path), 0, "Skipped: " + reason)
    return report


def _te_classes_for(item):
    """_te_classes() for the tests of TE_CLASS_TESTS, else nothing."""
    if any(fnmatch.fnmatchcase(item.nodeid, p) for p in TE_CLASS_TESTS):
        return _te_classes()
    return contextlib.nullcontext()


@contextlib.contextmanager
def _te_classes():
    """megatron.core.extensions.transformer_engine's TE class names bound, for one test, to the
    classes megatron-adapt's provider builds for them (patches/layer_specs.TE_NAMES), then restored."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.models.gpt.gpt_layer_specs import TESpecProvider

    from megatron_adapt.patches.layer_specs import TE_NAMES

    provider = TESpecProvider()
    names = {**TE_NAMES, "TELinear": lambda p: p.linear()}   # TE's duplicated linear (MLA, DSA)
    saved = {name: getattr(te_ext, name, None) for name in names}
    try:
        for name, served in names.items():
            setattr(te_ext, name, served(provider))
        yield
    finally:
        for name, value in saved.items():
            setattr(te_ext, name, value)


def _preimport_megatron(path: str, _seen=None):
    """Import the megatron modules a test module imports, before the TE shim exists: Megatron's
    own `try: import transformer_engine` must keep answering "absent". A test module it imports
    (`from tests.unit_tests... import`) is read the same way, not imported: it may import TE's
    names itself (test_dynamic_sink_attention_e2e imports test_dynamic_engine), and then imports
    under the shim with the test module."""
    seen = _seen if _seen is not None else set()
    if path in seen:
        return
    seen.add(path)
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            top = name.split(".")[0]
            if top == "megatron":
                importlib.import_module(name)
            elif top == "tests" and name not in sys.modules:
                spec = importlib.util.find_spec(name)
                if spec is not None and spec.origin and spec.origin.endswith(".py"):
                    _preimport_megatron(spec.origin, seen)
    # Megatron caches its answer (0.17+; on 0.15-0.16 the te_version patch does): ask before the
    # shim exists, so the test module's `is_te_min_version(...)` says "no TE".
    from megatron.core.utils import get_te_version
    get_te_version()


class _FP8Unavailable(RuntimeError):
    pass


@contextlib.contextmanager
def _te_fp8_shim():
    """`transformer_engine.pytorch.fp8` with the names Megatron's test modules import, for the
    duration of one test module's import. Nothing pretends FP8 works."""
    names = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.fp8")
    if any(n in sys.modules for n in names):
        raise RuntimeError("megatron_adapt.apps.pytest_plugin: a transformer_engine module is already "
                           "imported; the TE shim is for runs without Transformer Engine")
    reason = "megatron-adapt: Transformer Engine is not installed, FP8 is not available"

    def check_fp8_support():
        return False, reason

    def check_nvfp4_support():
        return False, reason.replace("FP8", "NVFP4")

    @contextlib.contextmanager
    def fp8_autocast(enabled=True, *args, **kwargs):
        if enabled:
            raise _FP8Unavailable(reason)
        yield

    modules = {n: types.ModuleType(n) for n in names}
    modules["transformer_engine"].pytorch = modules["transformer_engine.pytorch"]
    modules["transformer_engine.pytorch"].fp8 = modules["transformer_engine.pytorch.fp8"]
    fp8 = modules["transformer_engine.pytorch.fp8"]
    fp8.check_fp8_support, fp8.fp8_autocast = check_fp8_support, fp8_autocast
    fp8.check_nvfp4_support = check_nvfp4_support
    for name, m in modules.items():
        m.__megatron_adapt_shim__ = True
        if m is not fp8:
            m.__path__ = []  # a package with no submodules: other TE imports fail as without TE
    sys.modules.update(modules)
    try:
        yield
    finally:
        for n in names:
            sys.modules.pop(n, None)


def pytest_configure(config):
    # Enabled by `-p megatron_adapt.apps.pytest_plugin`: only then is this module a plugin at all.
    if not config.pluginmanager.has_plugin("megatron_adapt_unit_tests"):
        config.pluginmanager.register(_Plugin(config), "megatron_adapt_unit_tests")
