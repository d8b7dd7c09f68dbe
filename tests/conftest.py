"""Tests never apply patches in the pytest process by accident: `import megatron_adapt` stays inert
here (MEGATRON_ADAPT_AUTO=0). Tests that patch Megatron do so in subprocesses, so every scenario
starts from a clean interpreter, as a user's process would."""
import os
import pytest

os.environ["MEGATRON_ADAPT_AUTO"] = "0"
HERE = os.path.dirname(os.path.abspath(__file__))


from adapt_testutil import run_python  # noqa: E402


@pytest.fixture(scope="session")
def python():
    return run_python
