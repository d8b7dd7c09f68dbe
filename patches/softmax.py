"""FusedScaleMaskSoftmax.forward on the backend's softmax op, for every shape and dtype.

Megatron's CUDA extension (scaled_masked_softmax_cuda) covers fp16/bf16 with 16 < sk <= 4096 and
falls back to unfused PyTorch otherwise; without the extension the default
`--masked-softmax-fusion` crashes. The op takes Megatron's masking conventions: an explicit mask
wins, a causal mask is generated only when none is given, a sliding window replaces both.
"""
from megatron_adapt import report
from megatron_adapt.spec import PatchSpec


def build(backend, original):
    softmax = backend.op("scaled_masked_softmax")
    from megatron.core.transformer.enums import AttnMaskType

    def forward(self, input, mask, softmax_offset=None):
        if softmax_offset is not None:
            report.fell_back("scaled_masked_softmax", "megatron.forward_torch_softmax",
                             "softmax_offset (off-by-one / learnable softmax)")
            return original(self, input, mask, softmax_offset)
        window = self.window_size
        causal = window is None and mask is None and self.attn_mask_type == AttnMaskType.causal
        if causal and input.size(2) > 1:  # Megatron's own contract (forward_torch_softmax)
            assert input.size(2) == input.size(3), "causal mask is only for self attention"
        return softmax(input, None if window is not None else mask, self.scale, causal, window,
                       self.softmax_in_fp32 and self.input_in_float16)
    return forward


SPECS = [
    PatchSpec("megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.forward", area="softmax",
              build=build),
]
