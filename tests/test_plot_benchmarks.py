"""scripts/plot_benchmarks.py makes every plot of docs/benchmarks.md from docs/results/*.json (CPU only)."""
import ast
import importlib.util
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "plot_benchmarks.py")


def script_plots() -> tuple:
    """The script's PLOTS tuple, read from its source (importing it needs matplotlib)."""
    tree = ast.parse(open(SCRIPT, encoding="utf-8").read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["PLOTS"]:
            return ast.literal_eval(node.value)
    raise AssertionError("scripts/plot_benchmarks.py has no PLOTS tuple")


EXPECTED = script_plots()  # what the script says it writes; docs/benchmarks.md must show each


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not importable: pip install matplotlib (it is in the [test] extra)")
def test_plot_benchmarks_writes_every_png(tmp_path):
    env = dict(os.environ, MPLBACKEND="Agg", MPLCONFIGDIR=str(tmp_path / "mplconfig"))
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path / "plots")], cwd=str(tmp_path),
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    made = sorted(os.listdir(tmp_path / "plots"))
    assert made == sorted(EXPECTED), made
    for name in EXPECTED:
        path = tmp_path / "plots" / name
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
        assert path.stat().st_size > 10_000, (name, path.stat().st_size)
    docs = open(os.path.join(REPO, "docs", "benchmarks.md")).read()
    for name in EXPECTED:
        assert f"plots/{name}" in docs, f"docs/benchmarks.md does not show {name}"
    shown = set(re.findall(r"plots/([\w.-]+\.png)", docs))
    assert shown <= set(made), f"docs/benchmarks.md shows plots the script does not make: {shown - set(made)}"


def test_plot_benchmarks_without_matplotlib_says_what_to_install(tmp_path):
    """With matplotlib hidden, the script exits non-zero with one line naming the package."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "matplotlib.py").write_text("raise ImportError('No module named matplotlib (hidden by the test)')\n")
    env = dict(os.environ, PYTHONPATH=str(shadow))
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path / "plots")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "needs matplotlib" in proc.stderr and "pip install matplotlib" in proc.stderr, proc.stderr
    assert not (tmp_path / "plots").exists()
