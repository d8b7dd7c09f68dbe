"""Mamba-2 ops on Ascend: the PyTorch reference (torch_npu dispatches its ops to NPU kernels),
each call reported as a fallback, because no torch_npu op serves them in training:

- SSD chunked scan: torch_npu has no selective-scan / SSD op (its gated-delta-rule ops,
  npu_chunk_gated_delta_rule / npu_recurrent_gated_delta_rule, are another recurrence).
- causal conv1d: npu_masked_causal_conv1d (op-plugin v2.6+, Ascend 950 only) takes window 3 only,
  no bias and no activation (Megatron's Mamba uses window 4, a bias and SiLU);
  npu_fused_causal_conv1d is an inference op that updates a conv-state cache in place.
- gated RMSNorm: npu_rms_norm has no gate and no groups.
(Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml, master of 2026-08.)
"""
from megatron_adapt import report
from megatron_adapt.backends import reference

NO_SCAN = "torch_npu has no SSD / selective-scan op"
NO_CONV = ("torch_npu's npu_masked_causal_conv1d takes window 3 only, no bias, no activation "
           "(Ascend 950); npu_fused_causal_conv1d is inference-only")
NO_GATED_NORM = "torch_npu's npu_rms_norm has no gate (z) and no groups"


def ssd_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
             dt_limit=(0.0, float("inf")), initial_states=None, seq_idx=None,
             return_final_states=False):
    report.fell_back("ssd_scan", "npu.reference.ssd_scan", NO_SCAN)
    return reference.ssd_scan(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                              dt_softplus=dt_softplus, dt_limit=dt_limit,
                              initial_states=initial_states, seq_idx=seq_idx,
                              return_final_states=return_final_states)


def causal_conv1d(x, weight, bias=None, activation=None, seq_idx=None):
    report.fell_back("causal_conv1d", "npu.torch.conv1d", NO_CONV)
    return reference.causal_conv1d(x, weight, bias, activation, seq_idx)


def rms_norm_gated(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    report.fell_back("rms_norm_gated", "npu.reference.rms_norm_gated", NO_GATED_NORM)
    return reference.rms_norm_gated(x, weight, z, eps, group_size, norm_before_gate)


NO_DECODE = ("torch_npu has no selective-state-update op, and its npu_fused_causal_conv1d (a "
             "conv-state cache op) is not yet matched to this contract on an Ascend device")


def ssm_conv_update(x, conv_state, weight, bias, silu, conv_state_indices=None,
                    intermediate_conv_states=None):
    report.fell_back("ssm_conv_update", "npu.reference.ssm_conv_update", NO_DECODE)
    return reference.ssm_conv_update(x, conv_state, weight, bias, silu, conv_state_indices,
                                     intermediate_conv_states)


def ssm_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                     state_batch_indices=None, intermediate_ssm_states=None):
    report.fell_back("ssm_state_update", "npu.reference.ssm_state_update", NO_DECODE)
    return reference.ssm_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                                      state_batch_indices, intermediate_ssm_states)
