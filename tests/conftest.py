"""Tests never apply patches in the pytest process by accident: `import megatron_adapt` stays inert
here (MEGATRON_ADAPT_AUTO=0). Tests that patch Megatron do so in subprocesses, so every scenario
starts from a clean interpreter, as a user's process would."""
import os
import pytest

os.environ["MEGATRON_ADAPT_AUTO"] = "0"
HERE = os.path.dirname(os.path.abspath(__file__))


from adapt_testutil import run_python  # noqa: E402

# tests/cuda's conftest sets TRITON_INTERPRET=1 at collection (on a machine with no GPU) for its own
# kernels. Set process-wide, it also reached every later test's subprocesses: the fp8 workers then ran
# the cuda backend's Triton quantizers under the interpreter on CPU tensors (the MoE fp8 test took
# 284 s instead of 8 s) instead of the torch path they take in the release tiers, where tests/cuda is
# not collected. A value the user set stays everywhere.
_INTERPRET_SET_BY_USER = "TRITON_INTERPRET" in os.environ
_INTERPRET_DIRS = (os.path.join(HERE, "cuda") + os.sep,)


@pytest.fixture(autouse=True)
def _triton_interpreter_only_in_tests_cuda(request, monkeypatch):
    if not _INTERPRET_SET_BY_USER and not str(request.node.path).startswith(_INTERPRET_DIRS):
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(scope="session")
def python():
    return run_python
