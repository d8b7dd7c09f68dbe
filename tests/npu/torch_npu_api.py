"""The real torch_npu signatures the npu backend uses: one table, each row citing its source.

`schema` is copied verbatim from the source (op-plugin's `op_plugin/config/op_plugin_functions.yaml`
on the release's branch -- the schema torch_npu's Python bindings are generated from -- or the
`m.def(...)` of an ATB op). test_npu_api_table.py parses it and checks the emulation against it
under every profile: same names, parameters (inspect.signature: names, kinds, defaults), return
structure, and the refusals listed here. A maintainer with hardware can check a row by opening its
source, or by running scripts/npu_device_check.py.

Binding rule used (inferred, not stated by the docs): a schema argument `Tensor self` is bound in
Python as `input`, as torchgen does for functions (torch.add(input, other)); op-plugin generates
torch_npu's bindings with torchgen. The backend passes those arguments positionally either way.

Releases (Ascend Extension for PyTorch) -> torch_npu builds: Ascend/pytorch README version table
(6.0.0: 2.1.0.post10 / 2.3.1.post4 / 2.4.0.post2; 7.0.0: 2.5.1, 2.4.0.post4 ...; 7.1.0: 2.6.0 ...;
7.3.0: 2.6.0.post5 ...), mirrored in backends/npu/_lib.py RELEASES.
"""
from __future__ import annotations

from dataclasses import dataclass, field

OP_PLUGIN = "Ascend/op-plugin"
YAML = "op_plugin/config/op_plugin_functions.yaml"
BRANCH_COMMIT = {   # op-plugin branch heads read for this table (git ls-remote / the mirrored history)
    "6.0.0": "ddb7ed2faa959af71bf97e3c727b231c96b73c2b",
    "7.0.0": "7b9ce1ceb57a900461be4c12dacc72da53429328",
    "7.1.0": "57c52665a1e1b007f10a3dbce00d37929c3c851a",
    "7.3.0": "b3065ed3ed174b08b7ecfcc564c0c464fb91fd13",
}
ALL = ("6.0.0", "7.0.0", "7.1.0", "7.3.0")


def yaml(release):
    return f"{OP_PLUGIN}@{release} ({BRANCH_COMMIT[release][:8]}) {YAML}"


@dataclass(frozen=True)
class Refusal:
    what: str        # what the source says is not accepted
    call: str        # python expression over `t` (torch_npu) and `torch`, which must raise
    match: str       # regex the error must match
    source: str


@dataclass(frozen=True)
class Row:
    releases: tuple
    schema: str
    source: str
    layout: str      # return arity and layouts, in words (checked by `example` + `expect`)
    example: str     # python expression over `t` and `torch`: a valid call
    expect: str      # python expression over `out`: True when the result has the documented layout
    refusals: tuple = field(default=())

    @property
    def op(self):
        return self.schema.split("(", 1)[0].strip()


FA_ARGS = "torch.randn(1, 2, 8, 4).half(), torch.randn(1, 2, 8, 4).half(), torch.randn(1, 2, 8, 4).half(), 2, 'BNSD'"
FA_GRAD_ARGS = ("torch.randn(1, 2, 8, 4).half(), torch.randn(1, 2, 8, 4).half(), torch.randn(1, 2, 8, 4).half(), "
                "torch.randn(1, 2, 8, 4).half(), 2, 'BNSD', softmax_max=torch.zeros(1, 2, 8, 8), "
                "softmax_sum=torch.full((1, 2, 8, 8), 8.), attention_in=torch.randn(1, 2, 8, 4).half()")
FA_GRAD_BAD_MAX = FA_GRAD_ARGS.replace("softmax_max=torch.zeros(1, 2, 8, 8)", "softmax_max=torch.zeros(1, 2, 8)")
GMM_X = "[torch.randn(6, 4).bfloat16()]"

# The Ascend Extension releases the emulation models (emulation/torch_npu/_ops.py PROFILES).
PROFILES = ("6.0.0", "7.0.0", "7.1.0", "7.3.0")

ROWS = (
    Row(ALL, "npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
        f"{yaml('6.0.0')}; same line in 7.0.0, 7.1.0, 7.3.0; docs/context/torch_npu-npu_rms_norm.md",
        "(y like x, rstd fp32 with gamma's dims reduced to 1)",
        "t.npu_rms_norm(torch.randn(3, 8).bfloat16(), torch.ones(8).bfloat16())",
        "out[0].shape == (3, 8) and out[0].dtype == torch.bfloat16 and out[1].shape == (3, 1) and out[1].dtype == torch.float32",
        (Refusal("gamma dtype differs from x", "t.npu_rms_norm(torch.randn(2, 8), torch.ones(8).half())", "gamma dtype",
                 "torch_npu-npu_rms_norm.md (gamma: same dtype as x)"),)),
    Row(ALL, "npu_swiglu(Tensor self, int dim=-1) -> Tensor",
        f"{yaml('6.0.0')}; same line in 7.0.0 - 7.3.0; docs/context/torch_npu-npu_swiglu.md",
        "one tensor, half of x along dim", "t.npu_swiglu(torch.randn(3, 8))", "out.shape == (3, 4)",
        (Refusal("odd size along dim", "t.npu_swiglu(torch.randn(3, 7))", "even", "torch_npu-npu_swiglu.md"),)),
    Row(ALL, "npu_scaled_masked_softmax(Tensor x, Tensor mask, Scalar scale=1, bool fixed_triu_mask=False) -> Tensor",
        f"{yaml('6.0.0')}; same line in 7.0.0 - 7.3.0; docs/context/torch_npu-npu_scaled_masked_softmax.md",
        "one tensor like x (NCHW)",
        "t.npu_scaled_masked_softmax(torch.randn(1, 1, 32, 32).half(), torch.zeros(1, 1, 32, 32, dtype=torch.bool))",
        "out.shape == (1, 1, 32, 32) and out.dtype == torch.float16",
        (Refusal("fixed_triu_mask=True (reserved)", "t.npu_scaled_masked_softmax(torch.randn(1, 1, 32, 32).half(), "
                 "torch.zeros(1, 1, 32, 32, dtype=torch.bool), 1.0, True)", "fixed_triu_mask",
                 "torch_npu-npu_scaled_masked_softmax.md"),)),
    Row(("6.0.0", "7.0.0", "7.1.0"),
        "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, Tensor? pse=None, "
        "Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., float keep_prob=1., "
        "int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, int[]? prefix=None, "
        "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, "
        "bool sync=False) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)",
        f"{yaml('6.0.0')}; same line in 7.0.0, 7.1.0; docs/context/torch_npu-npu_fusion_attention.md",
        "7-tuple: attention_out (query's layout), softmax_max, softmax_sum [B, N, Sq, 8] fp32, softmax_out, seed, offset, numels",
        f"t.npu_fusion_attention({FA_ARGS})", "out[0].shape == (1, 2, 8, 4) and out[1].shape == (1, 2, 8, 8)",
        (Refusal("sparse_mode 2 without the 2048x2048 compressed mask",
                 f"t.npu_fusion_attention({FA_ARGS}, atten_mask=torch.zeros(8, 8, dtype=torch.bool), sparse_mode=2)",
                 "compressed", "torch_npu-npu_fusion_attention.md (sparse_mode 2/3/4: optimised 2048x2048 mask)"),)),
    Row(("7.3.0",),
        "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, Tensor? pse=None, "
        "Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., float keep_prob=1., "
        "int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, int[]? prefix=None, "
        "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, "
        "bool sync=False, str softmax_layout=\"\", Tensor? sink=None) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)",
        f"{yaml('7.3.0')} (7.2.0 adds softmax_layout, 7.3.0 sink; the backend passes neither)",
        "7-tuple as above", f"t.npu_fusion_attention({FA_ARGS})", "len(out) == 7 and out[0].shape == (1, 2, 8, 4)"),
    Row(("6.0.0", "7.0.0", "7.1.0"),
        "npu_fusion_attention_grad(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, str input_layout, *, "
        "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, Tensor? softmax_max=None, "
        "Tensor? softmax_sum=None, Tensor? softmax_in=None, Tensor? attention_in=None, float scale_value=1., "
        "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, int seed=0, "
        "int offset=0, int numels=0, int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, "
        "int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False) -> (Tensor, Tensor, Tensor, Tensor)",
        f"{yaml('6.0.0')}; same line in 7.0.0, 7.1.0; op_plugin/python/meta/_meta_registrations.py (dq/dk/dv like "
        "query/key/value, dpse empty); MindSpeed's ring attention (mindspeed/core/context_parallel) calls it per ring step",
        "4-tuple: dq, dk, dv (shapes of query, key, value), dpse",
        f"t.npu_fusion_attention_grad({FA_GRAD_ARGS})",
        "out[0].shape == (1, 2, 8, 4) and out[1].shape == (1, 2, 8, 4) and out[2].dtype == torch.float16",
        (Refusal("softmax_max not [B, N, Sq, 8]", f"t.npu_fusion_attention_grad({FA_GRAD_BAD_MAX})", "softmax_max",
                 "_meta_registrations.py (softmax_max [B, N, S1, 8] fp32)"),)),
    Row(("7.3.0",),
        "npu_fusion_attention_grad(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, str input_layout, *, "
        "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, Tensor? softmax_max=None, "
        "Tensor? softmax_sum=None, Tensor? softmax_in=None, Tensor? attention_in=None, float scale_value=1., "
        "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, int seed=0, "
        "int offset=0, int numels=0, int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, "
        "int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, str softmax_layout=\"\", Tensor? sink=None) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        f"{yaml('7.3.0')} (adds softmax_layout, sink and a fifth output, dsink; the backend passes neither and "
        "reads the first three)",
        "5-tuple: dq, dk, dv, dpse, dsink", f"t.npu_fusion_attention_grad({FA_GRAD_ARGS})",
        "len(out) == 5 and out[0].shape == (1, 2, 8, 4)"),
    Row(("6.0.0",), "npu_rotary_mul(Tensor self, Tensor r1, Tensor r2) -> Tensor",
        f"{yaml('6.0.0')} (no rotary_mode: interleaved rope falls back)",
        "one tensor like input",
        "t.npu_rotary_mul(torch.randn(2, 1, 3, 8), torch.rand(2, 1, 1, 8), torch.rand(2, 1, 1, 8))",
        "out.shape == (2, 1, 3, 8)",
        (Refusal("rotary_mode keyword (absent)", "t.npu_rotary_mul(torch.randn(2, 1, 3, 8), torch.rand(2, 1, 1, 8), "
                 "torch.rand(2, 1, 1, 8), rotary_mode='interleave')", "unexpected keyword", yaml("6.0.0")),)),
    Row(("7.0.0", "7.1.0", "7.3.0"), "npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> Tensor",
        f"{yaml('7.0.0')}; same line in 7.1.0, 7.3.0 (master adds `Tensor? rotate=None`); "
        "docs/context/torch_npu-npu_rotary_mul.md (7.1.0+: half/interleave, r1/r2 layouts, D < 896)",
        "one tensor like input",
        "t.npu_rotary_mul(torch.randn(2, 1, 3, 8), torch.rand(2, 1, 1, 8), torch.rand(2, 1, 1, 8), rotary_mode='interleave')",
        "out.shape == (2, 1, 3, 8)",
        (Refusal("interleave with r1/r2 not broadcast (S11D/1S1D/11SD only)",
                 "t.npu_rotary_mul(torch.randn(2, 3, 4, 8), torch.rand(2, 3, 1, 8), torch.rand(2, 3, 1, 8), rotary_mode='interleave')",
                 "not supported", "torch_npu-npu_rotary_mul.md"),)),
    Row(("7.0.0", "7.1.0", "7.3.0"), "_npu_matmul_add_fp32(Tensor x, Tensor weight, Tensor(a!) C) -> ()",
        f"{OP_PLUGIN}@7.0.0 - 7.3.0 op_plugin/ops/atb/LinearAtb.cpp (TORCH_LIBRARY atb m.def; transposeA=true, "
        "enAccum=true), exposed as torch_npu._npu_matmul_add_fp32 by op_plugin/python/atb/_atb_ops.py (API_LIST); "
        "absent from the 6.0.0 branch. dtypes: CANN ATB 'Fusion of Matmul and InplaceAdd' "
        "(hiascend.com CANNCommunityEdition 850alpha002/900 API ascendtb_01_0164): x/weight fp16/bf16, accum fp32, "
        "'If the input data type is float16, transposeA cannot be set to true'",
        "returns nothing; C [k, n] += x[m, k]^T @ weight[m, n] in place",
        "t._npu_matmul_add_fp32(torch.ones(3, 2).bfloat16(), torch.ones(3, 4).bfloat16(), C)",
        "out is None and bool((C == 3).all())",
        (Refusal("float16 with transposeA", "t._npu_matmul_add_fp32(torch.ones(3, 2).half(), torch.ones(3, 4).half(), "
                 "torch.zeros(2, 4))", "float16", "ascendtb_01_0164 (transposeA, float16)"),)),
    Row(("6.0.0",),
        "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
        "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
        "int[]? group_list=None, int? split_item=0, ScalarType? output_dtype=None) -> Tensor[]",
        f"{yaml('6.0.0')} (the torch 2.1+ line); ops/opapi/GroupedMatmulKernelNpuOpApi.cpp@6.0.0 (group_list "
        "cumulative: y_i has group_list[i] - group_list[i-1] rows; weight[i].sizes()[1]: 2-D weights); "
        "hiascend Pytorch/600 ptaoplist_000851 (x/weight fp16, bf16, int8)",
        "list of one [M, n] tensor (split_item 2/3)",
        f"t.npu_grouped_matmul({GMM_X}, [torch.randn(4, 5).bfloat16()] * 2, group_list=[2, 6], split_item=2)",
        "isinstance(out, list) and len(out) == 1 and out[0].shape == (6, 5)",
        (Refusal("group_type keyword (absent)", f"t.npu_grouped_matmul({GMM_X}, [torch.randn(4, 5).bfloat16()] * 2, "
                 "group_list=[2, 6], split_item=2, group_type=0)", "unexpected keyword", yaml("6.0.0")),
         Refusal("a Tensor group_list (int[] only)", f"t.npu_grouped_matmul({GMM_X}, [torch.randn(4, 5).bfloat16()] * 2, "
                 "group_list=torch.tensor([2, 6]), split_item=2)", "group_list", yaml("6.0.0")),
         Refusal("fp32 (fp16/bf16/int8 only)", "t.npu_grouped_matmul([torch.randn(6, 4)], [torch.randn(4, 5)] * 2, "
                 "group_list=[2, 6], split_item=2)", "dtype", "ptaoplist_000851"))),
    Row(("7.0.0",),
        "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
        "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
        "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
        "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
        "int? group_type=-1, int? group_list_type=0, int? act_type=0, ScalarType? output_dtype=None) -> Tensor[]",
        f"{yaml('7.0.0')}; GroupedMatmulKernelNpuOpApi.cpp@7.0.0 allocates y [x.size(0), n] whatever group_type "
        "(no [E, k, n] output: K-axis grouping unusable)",
        "list of one [M, n] tensor",
        f"t.npu_grouped_matmul({GMM_X}, [torch.randn(2, 4, 5).bfloat16()], group_list=torch.tensor([2, 6]), split_item=2, group_type=0)",
        "isinstance(out, list) and len(out) == 1 and out[0].shape == (6, 5)",
        (Refusal("group_type 2", "t.npu_grouped_matmul([torch.randn(6, 4).bfloat16().t()], [torch.randn(6, 5).bfloat16()], "
                 "group_list=torch.tensor([2, 6]), split_item=3, group_type=2)", "K-axis", "GroupedMatmulKernelNpuOpApi.cpp@7.0.0"),)),
    Row(("7.1.0", "7.3.0"),
        "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
        "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
        "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
        "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
        "int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, "
        "ScalarType? output_dtype=None) -> Tensor[]",
        f"{yaml('7.1.0')}; same line in 7.2.0, 7.3.0; GroupedMatmulKernelNpuOpApi.cpp: 7.1.0 TORCH_CHECKs group_type "
        "in (-1, 0); 7.2.0/7.3.0 take -1/0/2 (\"GMM k axis support\", op-plugin bd5db7c7, 2025-08-13), y [E, k, n] for 2; "
        "docs/context/torch_npu-npu_grouped_matmul.md@7.3.0 (group_type 2 = K axis); aclnnGroupedMatmulV4.md "
        "(cann/ops-transformer gmm/grouped_matmul/docs; groupType 2, single tensors: x transposed, weight not, y 3-D)",
        "list of one tensor: [M, n] (group_type 0), [E, k, n] (group_type 2)",
        f"t.npu_grouped_matmul({GMM_X}, [torch.randn(2, 4, 5).bfloat16()], group_list=torch.tensor([2, 6]), split_item=2, group_type=0)",
        "isinstance(out, list) and len(out) == 1 and out[0].shape == (6, 5)",
        (Refusal("group_type not passed", f"t.npu_grouped_matmul({GMM_X}, [torch.randn(2, 4, 5).bfloat16()], "
                 "group_list=torch.tensor([2, 6]), split_item=2)", "Requires manual passing group_type",
                 "GroupedMatmulKernelNpuOpApi.cpp@7.1.0"),
         Refusal("group_type 1 (N axis)", f"t.npu_grouped_matmul({GMM_X}, [torch.randn(2, 4, 5).bfloat16()], "
                 "group_list=torch.tensor([2, 6]), split_item=2, group_type=1)", "group.type",
                 "GroupedMatmulKernelNpuOpApi.cpp@7.1.0/7.3.0"),
         Refusal("K-axis x not transposed (a contiguous copy)", "t.npu_grouped_matmul([torch.randn(6, 4).bfloat16().t().contiguous()], "
                 "[torch.randn(6, 5).bfloat16()], group_list=torch.tensor([2, 6]), split_item=3, group_type=2)",
                 "group_type|transposed", "aclnnGroupedMatmulV4.md (groupType 2: x must be transposed); 7.1.0: refused outright"))),
    Row(("7.1.0", "7.3.0"),
        "npu_moe_token_permute(Tensor tokens, Tensor indices, int? num_out_tokens=None, bool padded_mode=False) -> (Tensor, Tensor)",
        f"{yaml('7.1.0')}; same line in 7.3.0; absent in 6.0.0 and 7.0.0; docs/context/torch_npu-npu_moe_token_permute.md",
        "(permuted_tokens [T*topk, h], sorted_indices int32 [T*topk])",
        "t.npu_moe_token_permute(torch.randn(3, 4).bfloat16(), torch.tensor([[0, 1], [1, 2], [0, 2]]))",
        "out[0].shape == (6, 4) and out[1].dtype == torch.int32 and out[1].shape == (6,)",
        (Refusal("padded_mode=True", "t.npu_moe_token_permute(torch.randn(3, 4).bfloat16(), torch.tensor([[0, 1], [1, 2], "
                 "[0, 2]]), padded_mode=True)", "padded_mode", "torch_npu-npu_moe_token_permute.md"),)),
    Row(("7.1.0", "7.3.0"),
        "npu_moe_token_unpermute(Tensor permuted_tokens, Tensor sorted_indices, Tensor? probs=None, bool padded_mode=False, "
        "int[]? restore_shape=None) -> Tensor",
        f"{yaml('7.1.0')}; same line in 7.3.0; docs/context/torch_npu-npu_moe_token_unpermute.md",
        "one tensor [T, h]",
        "t.npu_moe_token_unpermute(torch.randn(6, 4).bfloat16(), torch.arange(6, dtype=torch.int32), "
        "probs=torch.ones(3, 2).bfloat16())",
        "out.shape == (3, 4) and out.dtype == torch.bfloat16",
        (Refusal("sorted_indices not int32", "t.npu_moe_token_unpermute(torch.randn(6, 4).bfloat16(), torch.arange(6))",
                 "int32", "torch_npu-npu_moe_token_unpermute.md"),)),
)


def rows_for(release):
    return [r for r in ROWS if release in r.releases]
