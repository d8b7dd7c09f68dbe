"""EMULATION of torch_npu.contrib (only transfer_to_npu)."""
