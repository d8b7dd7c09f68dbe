"""Core attention: the reference, torch's scaled_dot_product_attention (math / flash kernels on CPU)."""
from megatron_adapt import report
from megatron_adapt.backends import context_parallel, reference


def attention(q, k, v, attn_mask=None, causal=False, scale=None, dropout_p=0.0, window_size=None):
    report.ran("attention", "cpu.torch.sdpa")
    return reference.attention(q, k, v, attn_mask, causal, scale, dropout_p, window_size)


def attention_bias(q, k, v, bias, attn_mask=None, causal=False, scale=None, dropout_p=0.0, window_size=None):
    report.ran("attention_bias", "cpu.torch.sdpa")
    return reference.attention_bias(q, k, v, bias, attn_mask, causal, scale, dropout_p, window_size)


def attention_thd(q, k, v, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                  causal=True, scale=None, dropout_p=0.0, window_size=None):
    report.ran("attention_thd", "cpu.torch.sdpa.per_sequence")
    return reference.attention_thd(q, k, v, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                                   cu_seqlens_kv_padded, causal, scale, dropout_p, window_size)



def attention_cp(q, k, v, pos, doc, causal, scale, window_size, groups, comm_type, dropout_p=0.0):
    report.ran("attention_cp", f"cpu.torch.{comm_type}")
    return context_parallel.attention_cp(q, k, v, pos, doc, causal, scale, window_size, groups, comm_type,
                                         dropout_p)
