"""Mamba-2 ops: the references (the chunked SSD scan, the causal conv1d, the gated RMSNorm),
fp32 math in PyTorch ops, differentiated by autograd."""
from megatron_adapt import report
from megatron_adapt.backends import reference


def ssd_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
             dt_limit=(0.0, float("inf")), initial_states=None, seq_idx=None,
             return_final_states=False):
    report.ran("ssd_scan", "cpu.reference.ssd_scan")
    return reference.ssd_scan(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                              dt_softplus=dt_softplus, dt_limit=dt_limit,
                              initial_states=initial_states, seq_idx=seq_idx,
                              return_final_states=return_final_states)


def causal_conv1d(x, weight, bias=None, activation=None, seq_idx=None):
    report.ran("causal_conv1d", "cpu.torch.conv1d")
    return reference.causal_conv1d(x, weight, bias, activation, seq_idx)


def rms_norm_gated(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    report.ran("rms_norm_gated", "cpu.reference.rms_norm_gated")
    return reference.rms_norm_gated(x, weight, z, eps, group_size, norm_before_gate)


def ssm_conv_update(x, conv_state, weight, bias, silu, conv_state_indices=None,
                    intermediate_conv_states=None):
    report.ran("ssm_conv_update", "cpu.reference.ssm_conv_update")
    return reference.ssm_conv_update(x, conv_state, weight, bias, silu, conv_state_indices,
                                     intermediate_conv_states)


def ssm_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                     state_batch_indices=None, intermediate_ssm_states=None):
    report.ran("ssm_state_update", "cpu.reference.ssm_state_update")
    return reference.ssm_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                                      state_batch_indices, intermediate_ssm_states)
