"""The README's commands as a user runs them: the installed console scripts, in a subprocess, in an
environment with no MEGATRON_ADAPT_* switch the README does not show (the suite's own
MEGATRON_ADAPT_AUTO=0 once hid a broken `megatron-adapt report`). Plus the two ways a first hour
went wrong: a source checkout on sys.path, and a demo worker that dies before it reports."""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
BIN = os.path.dirname(sys.executable)  # where pip put this interpreter's console scripts

# The cheap commands CI runs as printed; each must be in the README.
EXPECTED = ("megatron-adapt report", "megatron-adapt report --json", "megatron-adapt-run python -c",
            "megatron-adapt demo")


def readme_commands() -> list[tuple[str, str | None]]:
    """(command, expected last line or None) for every `megatron-adapt...` command in the README's
    bash blocks; `a && b && megatron-adapt demo` gives `megatron-adapt demo`; a trailing
    `# prints: X` comment is the output the README promises."""
    text = open(README, encoding="utf-8").read()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split("&&")[-1].strip()
            if not line.startswith("megatron-adapt"):
                continue
            cmd, _, comment = line.partition("  #")
            prints = re.match(r"\s*prints:\s*(.+)", comment)
            found.append((cmd.strip(), prints.group(1).strip() if prints else None))
    return found


def user_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MEGATRON_ADAPT_") and k not in ("PYTHONWARNINGS", "PYTHONPATH")}
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    return env


def run_as_user(cmd: str, timeout: int, cwd: str = REPO) -> subprocess.CompletedProcess:
    if cmd.split()[0] not in ("megatron-adapt", "megatron-adapt-run") or not shutil.which(cmd.split()[0], path=BIN):
        pytest.fail(f"console script for {cmd!r} is not installed beside {sys.executable}: pip install -e .")
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, env=user_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_readme_shows_the_cheap_commands():
    commands = [c for c, _ in readme_commands()]
    for expected in EXPECTED:
        assert any(c == expected or c.startswith(expected + " ") for c in commands), \
            f"README has no `{expected}` command in a ```bash block (found: {commands})"


def _check(cmd: str, proc: subprocess.CompletedProcess, prints: str | None):
    assert proc.returncode == 0, f"`{cmd}` exited {proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}"
    assert "error" not in proc.stdout.lower().split("\n")[-1]
    if prints is not None:
        assert proc.stdout.strip().splitlines()[-1] == prints, f"`{cmd}` printed {proc.stdout[-500:]!r}"
    if cmd == "megatron-adapt report --json":
        data = json.loads(proc.stdout)
        assert data["backend"] == "cpu" and data["patches"]
        assert not [p for p in data["patches"] if p["status"] == "failed"]
    elif cmd.startswith("megatron-adapt report"):
        assert "applied" in proc.stdout and "cpu" in proc.stdout
    elif cmd.startswith("megatron-adapt demo"):
        assert re.search(r"TP=2: loss [\d.]+ -> [\d.]+ \(falling\)", proc.stdout), proc.stdout[-2000:]
        assert re.search(r"PP=2: loss [\d.]+ -> [\d.]+ \(falling\)", proc.stdout), proc.stdout[-2000:]


def cheap(cmd: str) -> bool:
    """The commands that need no Megatron-LM checkout, GPU or data (the demo has its own test)."""
    return any(cmd == e or cmd.startswith(e + " ") for e in EXPECTED) and not cmd.startswith("megatron-adapt demo")


@pytest.mark.parametrize("cmd,prints", [c for c in readme_commands() if cheap(c[0])]
                         or [pytest.param(None, None, marks=pytest.mark.skip("README lists no command"))])
def test_readme_command_runs_as_printed(cmd, prints):
    _check(cmd, run_as_user(cmd, timeout=300), prints)


def test_readme_demo_runs_as_printed():
    demos = [c for c in readme_commands() if c[0].startswith("megatron-adapt demo")]
    assert demos, "README has no `megatron-adapt demo` command"
    cmd, prints = demos[0]
    _check(cmd, run_as_user(cmd, timeout=600), prints)


def test_report_from_another_directory():
    """Outside the checkout nothing on sys.path can stand in for the installed package."""
    proc = run_as_user("megatron-adapt report --json", timeout=300, cwd=os.path.expanduser("~"))
    _check("megatron-adapt report --json", proc, None)


def test_source_checkout_on_sys_path_runs_whole(tmp_path):
    """A checkout ahead of the installed package on sys.path (a script inserting it, `python -m`
    from the clone after `pip install .`) imports the checkout's backends and patches, which
    setup.py maps in from beside the package folder, instead of dying at `from . import backends`."""
    checkout = tmp_path / "clone"
    for part in ("megatron_adapt", "backends", "patches"):
        shutil.copytree(os.path.join(REPO, part), checkout / part,
                        ignore=shutil.ignore_patterns("__pycache__"))
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(checkout)!r})
        import megatron_adapt, megatron_adapt.backends.cpu, megatron_adapt.patches.norms
        print(megatron_adapt.backends.__file__); print(megatron_adapt.patches.__file__)
    """)
    env = {**user_env(), "MEGATRON_ADAPT_AUTO": "0"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    backends_file, patches_file = proc.stdout.split()
    assert backends_file.startswith(str(checkout)) and patches_file.startswith(str(checkout)), proc.stdout


def test_dead_demo_worker_ends_the_run():
    """Workers that die at import (here: an unknown backend in the environment they inherit) end
    the run at once with an error naming the rank; the parent used to wait on its queue forever."""
    code = textwrap.dedent("""
        import os
        os.environ["MEGATRON_ADAPT_AUTO"] = "0"
        from megatron_adapt.apps.demo import RunConfig, run
        os.environ.update(MEGATRON_ADAPT_AUTO="1", MEGATRON_ADAPT_BACKEND="no-such-backend")
        try:
            run(RunConfig(steps=2, tp=2, backend="cpu"))
        except RuntimeError as exc:
            print("RAISED:", exc)
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=user_env(), capture_output=True, text=True,
                          timeout=120)  # the old runner never returned here
    assert re.search(r"RAISED: demo worker rank \d exited with code [1-9]\d* before it reported", proc.stdout), \
        f"STDOUT:\n{proc.stdout[-2000:]}\nSTDERR:\n{proc.stderr[-2000:]}"
    assert "no-such-backend" in proc.stderr  # the worker's own error is shown
