"""The checking helpers can fail: a wrong result is caught at every tolerance used."""
import pytest
import torch

from _cuda_helpers import DTYPES, assert_close


@pytest.mark.parametrize("dtype", DTYPES)
def test_wrong_result_is_caught(dtype):
    ref = torch.randn(64, 64)
    with pytest.raises(AssertionError):
        assert_close((ref * 1.03).to(dtype), ref, dtype)
    with pytest.raises(AssertionError):
        assert_close(ref.clone().fill_(float("nan")), ref, dtype)
    assert_close(ref.to(dtype), ref, dtype)
