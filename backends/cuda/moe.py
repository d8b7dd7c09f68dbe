"""Mixture-of-experts ops on NVIDIA GPUs.

grouped_gemm: PyTorch's grouped matmul (`torch._grouped_mm`, CUTLASS grouped GEMM kernels; bf16 on
compute capability 9.0+, operand strides 16-byte aligned): one launch for all experts forward,
two backward (dx grouped over rows, dw grouped over the contraction). Anything else runs one
matmul per expert, reported as a fallback with the reason.

Permutation, chunk sort and router: PyTorch index / sort / top-k kernels on the GPU, written so
that nothing waits for the host (output sizes come from num_out_tokens and the input length,
chunk offsets from device-side cumsums), the property TE's fused kernels give Megatron's
`--moe-permute-fusion` path.
"""
from __future__ import annotations

import torch

from megatron_adapt import report
from megatron_adapt.backends import reference


def grouped_mm_reason(x, w, trans_b=False):
    """None when torch._grouped_mm serves these operands here, else why not."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return f"dtypes {x.dtype}/{w.dtype} (torch._grouped_mm takes bf16)"
    if x.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(x.device)
        if major < 9:
            return f"compute capability {major}.{minor} (torch._grouped_mm needs 9.0+)"
    k, n = x.shape[1], (w.shape[1] if trans_b else w.shape[2])
    if k % 8 or n % 8:
        return f"k={k}, n={n} not multiples of 8 (bf16 strides must be 16-byte aligned)"
    if x.shape[0] == 0:
        return "no rows"
    return None


class _GroupedMM(torch.autograd.Function):
    """y = x @ w[e] per row group; offs = int32 end offsets of the groups on x's device."""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return torch._grouped_mm(x, w, offs=offs)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch._grouped_mm(dy, w.transpose(-2, -1), offs=offs)
        if ctx.needs_input_grad[1]:
            # groups along the contraction: [k, T] x [T, n] -> [E, k, n]; empty groups give zeros.
            # w a transposed view ([E, n, k] storage, TE-layout weights): the gradient in that
            # layout, so the weights' gradients come out contiguous
            if w.transpose(-2, -1).is_contiguous():
                dw = torch._grouped_mm(dy.t(), x, offs=offs).transpose(-2, -1)
            else:
                dw = torch._grouped_mm(x.t(), dy, offs=offs)
        return dx, dw, None


def group_offsets(tokens_per_expert, device):
    """int32 end offsets of the row groups, on `device`.

    Sizes already on the device: a cumsum. Host sizes (a list, or a CPU tensor: what
    Megatron's dispatchers hand the experts) are copied to the device, except while a CUDA
    graph is being captured on it: a copy from pageable host memory cannot be captured (and a
    captured one would re-read freed host memory at every replay), so there the offsets are
    written by device kernels from the Python ints (sizes fixed for the graph's life, as
    capacity-padded dispatch gives them): one arange when every group has the same size, else
    one fill per group."""
    if isinstance(tokens_per_expert, torch.Tensor) and tokens_per_expert.device.type != "cpu":
        return torch.cumsum(tokens_per_expert.to(device=device, dtype=torch.int32), 0, dtype=torch.int32)
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        sizes = tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor) else tokens_per_expert
        return offsets_on_device([int(n) for n in sizes], device)
    if not isinstance(tokens_per_expert, torch.Tensor):
        tokens_per_expert = torch.tensor(tokens_per_expert)
    return torch.cumsum(tokens_per_expert.to(device=device, dtype=torch.int32, non_blocking=True), 0,
                        dtype=torch.int32)


def offsets_on_device(sizes: list[int], device) -> torch.Tensor:
    """cumsum(sizes) as an int32 tensor on `device`, made by kernels alone (no host copy)."""
    if sizes and sizes[0] > 0 and all(n == sizes[0] for n in sizes):
        return torch.arange(sizes[0], sizes[0] * len(sizes) + 1, sizes[0], device=device, dtype=torch.int32)
    out = torch.empty(len(sizes), device=device, dtype=torch.int32)
    end = 0
    for i, n in enumerate(sizes):
        end += n
        out[i].fill_(end)  # a fill kernel with the value as its argument (`out[i] = end` copies
        # a host scalar, which a CUDA graph capture refuses)
    return out


def grouped_mm(x, w, tokens_per_expert, trans_b=False):
    """The torch._grouped_mm path (callers check grouped_mm_reason first)."""
    wk = w.transpose(-2, -1) if trans_b else w
    return _GroupedMM.apply(x.contiguous(), wk, group_offsets(tokens_per_expert, x.device))


def grouped_gemm(x, w, tokens_per_expert, trans_b: bool = False):
    why = grouped_mm_reason(x, w, trans_b) or (None if x.is_cuda else f"tensors on {x.device}")
    if why is None:
        report.ran("grouped_gemm", "cuda.torch._grouped_mm")
        return grouped_mm(x, w, tokens_per_expert, trans_b)
    report.fell_back("grouped_gemm", "cuda.loop(matmul per expert)", why)
    return reference.grouped_gemm(x, w, tokens_per_expert, trans_b)


def grouped_gemm_wgrad(a, b, tokens_per_expert):
    """dw[e] = a_e^T @ b_e: torch._grouped_mm with the groups along the contraction (the kernel
    grouped_gemm's backward runs for dW), else one matmul per expert, reported with the reason."""
    why = grouped_mm_reason(a, b.unsqueeze(0)) or (None if a.is_cuda else f"tensors on {a.device}")
    if why is None:
        report.ran("grouped_gemm_wgrad", "cuda.torch._grouped_mm(k-axis groups)")
        return torch._grouped_mm(a.contiguous().t(), b.contiguous(), offs=group_offsets(tokens_per_expert, a.device))
    report.fell_back("grouped_gemm_wgrad", "cuda.loop(matmul per expert)", why)
    return reference.grouped_gemm_wgrad(a, b, tokens_per_expert)


def moe_permute(tokens, routing_map, probs=None, num_out_tokens=None):
    report.ran("moe_permute", "cuda.torch.sort+index_select")
    return reference.moe_permute(tokens, routing_map, probs, num_out_tokens)


def moe_unpermute(permuted, row_map, restore_shape, merging_probs=None):
    report.ran("moe_unpermute", "cuda.torch.index_add(fp32)")
    return reference.moe_unpermute(permuted, row_map, restore_shape, merging_probs)


def moe_sort_chunks(input, split_sizes, sorted_idxs, probs=None):  # noqa: A002
    report.ran("moe_sort_chunks", "cuda.torch.searchsorted+index_select")
    return reference.moe_sort_chunks(input, split_sizes, sorted_idxs, probs)


def moe_topk_router(logits, topk, use_pre_softmax=False, num_groups=None, group_topk=None,
                    scaling_factor=None, score_function="softmax", expert_bias=None):
    report.ran("moe_topk_router", f"cuda.torch.{score_function}_topk")
    return reference.moe_topk_router(logits, topk, use_pre_softmax, num_groups, group_topk,
                                     scaling_factor, score_function, expert_bias)


def moe_router_scores(logits, topk, score_function="softmax"):
    report.ran("moe_router_scores", f"cuda.torch.{score_function}")
    return reference.moe_router_scores(logits, topk, score_function)
