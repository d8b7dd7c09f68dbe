"""MEGATRON_ADAPT_CUDA_GRAPHS: the switch that turns Megatron's --cuda-graph-impl local on through
the wrapped `parse_args`, refuses configurations graphs cannot capture (naming why), and never
overrides a launch's own flag. Each case in a fresh interpreter with the environment it needs."""
import json
import textwrap

import pytest

CASE = textwrap.dedent("""
    import types
    import megatron_adapt
    from megatron_adapt import report
    megatron_adapt.apply("cpu", quiet=True)  # the configuration (switch, strict) comes from the environment
    from megatron_adapt.patches.cuda_graphs import build_switch
    ns = types.SimpleNamespace(cuda_graph_impl={impl!r}, num_experts={experts!r})
    wrapper = build_switch(types.SimpleNamespace(name={backend!r}), None)
    out = wrapper(lambda: ns, None, (), {{}})
    print("IMPL", out.cuda_graph_impl)
    import json
    print("FALLBACKS", json.dumps([o["fallback_reason"] for o in report.as_dict()["ops"] if o["fallback_reason"]]))
    print("OPS", report.as_dict()["ops"])
""")


def run_case(python, mode, backend="cuda", impl="none", experts=None, strict=False):
    env = {"MEGATRON_ADAPT_CUDA_GRAPHS": mode, "MEGATRON_ADAPT_STRICT": "1" if strict else "0"}
    return python(CASE.format(impl=impl, experts=experts, backend=backend), env=env, check=False)


@pytest.mark.parametrize("mode", ["local", "auto"])
def test_turns_graphs_on_where_they_capture(python, mode):
    proc = run_case(python, mode)
    assert proc.returncode == 0, proc.stderr
    assert "IMPL local" in proc.stdout
    assert f"--cuda-graph-impl local (MEGATRON_ADAPT_CUDA_GRAPHS={mode})" in proc.stdout
    assert "turned on Megatron's --cuda-graph-impl local" in proc.stderr


def test_off_leaves_megatron_alone(python):
    proc = run_case(python, "off")
    assert proc.returncode == 0 and "IMPL none" in proc.stdout and "cuda_graphs.switch" not in proc.stdout


def test_launch_flag_wins(python):
    proc = run_case(python, "local", impl="transformer_engine")
    assert "IMPL transformer_engine" in proc.stdout and "the launch's own flag kept" in proc.stdout


@pytest.mark.parametrize("backend,experts,reason", [
    ("cpu", None, "CUDA graphs need the cuda backend (this process runs cpu)"),
    ("cuda", 8, "MoE (--num-experts)"),
])
def test_refusal_names_the_reason(python, backend, experts, reason):
    local = run_case(python, "local", backend=backend, experts=experts)
    fallbacks = json.loads(local.stdout.split("FALLBACKS ", 1)[1].splitlines()[0])
    assert "IMPL none" in local.stdout and len(fallbacks) == 1 and fallbacks[0].startswith(reason), local.stdout
    assert f"running eager: {reason}" in local.stderr
    auto = run_case(python, "auto", backend=backend, experts=experts)
    assert "IMPL none" in auto.stdout and f"eager (auto: {reason}" in auto.stdout
    strict = run_case(python, "local", backend=backend, experts=experts, strict=True)
    assert strict.returncode != 0 and "StrictFallbackError" in strict.stderr and reason in strict.stderr


def test_unknown_mode_is_a_clear_error(python):
    proc = python("from megatron_adapt.config import Config; Config.resolve()", check=False,
                  env={"MEGATRON_ADAPT_CUDA_GRAPHS": "always"})
    assert proc.returncode != 0 and "MEGATRON_ADAPT_CUDA_GRAPHS='always': expected one of off, local, auto" in proc.stderr
