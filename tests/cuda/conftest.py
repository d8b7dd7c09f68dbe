"""tests/cuda: the cuda backend's kernels against fp32 references.

Without a GPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set here before
anything imports triton) on small shapes; with one they run compiled on larger shapes.
Setting the variable only changes how Triton kernels execute, so other test directories are
unaffected (they launch no Triton kernels).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _ours_only(monkeypatch):
    """These tests check OUR kernels: no other library's kernel may be chosen for a call (with
    Liger-Kernel installed it wins some shapes). test_cuda_providers sets its own mode."""
    monkeypatch.setenv("MEGATRON_ADAPT_EXTERNAL", "off")
    # and on a GPU, outside graph capture, not PyTorch's native op either (the default for eager
    # calls: MEGATRON_ADAPT_EAGER_OPS); test_cuda_eager_ops tests that choice
    monkeypatch.setenv("MEGATRON_ADAPT_EAGER_OPS", "triton")


@pytest.fixture(autouse=True)
def _release_gpu_cache():
    """With a GPU, hand cached blocks back after each test: under `pytest -n 16` on an 80 GB
    H100, 16 workers' caches left the TP=2 test's spawned ranks out of memory."""
    yield
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
