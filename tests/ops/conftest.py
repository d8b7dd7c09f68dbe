import pytest
import torch


@pytest.fixture(autouse=True)
def _seeded():
    """Every op test draws the same inputs whatever ran before it."""
    state = torch.get_rng_state()
    torch.manual_seed(0)
    yield
    torch.set_rng_state(state)
