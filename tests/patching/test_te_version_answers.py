"""is_te_min_version answers True without TE only where a patch area serves what the check gates:
TransformerConfig's fp8 MoE checks (1.7.0.dev0, 1.11.0; area fp8) and MIMO's THD split under CP (1.10.0;
area context_parallel). The applier rebinds the patched function in every module that imported it,
so the answer goes by the calling module: any other module (Megatron's unit tests' skipif marks
among them) gets the original's False."""
import textwrap

ASK = textwrap.dedent("""
    import importlib
    import megatron_adapt
    megatron_adapt.apply("cpu", quiet=True)
    from megatron.core import utils
    def ask(module, version):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            return "absent"
        return eval(f"is_te_min_version({{version!r}})", {{**vars(mod), "version": version}})
    for module, version in {cases!r}:
        print("ANSWER", module, version, ask(module, version))
""")

CASES = [("megatron.core.transformer.transformer_config", "1.11.0"),
         ("megatron.core.transformer.transformer_config", "1.7.0.dev0"),
         ("megatron.core.transformer.transformer_config", "1.10.0"),
         ("megatron.core.utils", "1.11.0"),
         ("megatron.core.transformer.attention", "1.11.0"),
         ("megatron.core.models.mimo.partition.utils", "1.10.0")]


def answers(python, env=None):
    proc = python(ASK.format(cases=CASES), env=env)
    return {tuple(line.split()[1:3]): line.split()[3] for line in proc.stdout.splitlines() if line.startswith("ANSWER")}


def test_served_versions_go_by_the_calling_module(python):
    got = answers(python)
    tc = "megatron.core.transformer.transformer_config"
    assert got[(tc, "1.11.0")] == "True" and got[(tc, "1.7.0.dev0")] == "True", got
    assert got[(tc, "1.10.0")] == "False", got
    assert got[("megatron.core.utils", "1.11.0")] == "False", got
    assert got[("megatron.core.transformer.attention", "1.11.0")] == "False", got
    assert got[("megatron.core.models.mimo.partition.utils", "1.10.0")] in ("True", "absent"), got   # core >= 0.17


def test_a_disabled_area_serves_nothing(python):
    got = answers(python, env={"MEGATRON_ADAPT_DISABLE": "fp8,context_parallel"})
    assert {v for v in got.values()} <= {"False", "absent"}, got
