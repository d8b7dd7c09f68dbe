"""scripts/megatron_unit_tests_sweep.py without Megatron: how it splits a tests/unit_tests tree into
chunks, and how `report` merges several sweeps (the newest complete result of a chunk wins), counts
per directory, categorises skips, lists problems and writes the done list that resumes a sweep."""
import importlib.util
import json
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "megatron_unit_tests_sweep.py")


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("megatron_unit_tests_sweep", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tree(root):
    for rel in ("tests/unit_tests/test_a.py", "tests/unit_tests/test_b.py", "tests/unit_tests/models/test_m1.py",
                "tests/unit_tests/models/test_m2.py", "tests/unit_tests/models/test_m3.py",
                "tests/unit_tests/models/helpers.py", "tests/unit_tests/models/sub/test_m4.py"):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x = 1\n")
    return str(root)


def test_chunks_cover_every_test_file_once_by_directory(sweep, tmp_path):
    chunks = sweep.chunks_of("core_v0.19.0", tree(tmp_path), "cpu", per_run=2)
    assert [c["id"] for c in chunks] == ["core_v0.19.0/cpu/top-00", "core_v0.19.0/cpu/models-00",
                                         "core_v0.19.0/cpu/models-01"]
    files = [f for c in chunks for f in c["files"]]
    assert sorted(files) == sorted(["tests/unit_tests/test_a.py", "tests/unit_tests/test_b.py",
                                    "tests/unit_tests/models/test_m1.py", "tests/unit_tests/models/test_m2.py",
                                    "tests/unit_tests/models/test_m3.py", "tests/unit_tests/models/sub/test_m4.py"])
    assert chunks[0]["dir"] == sweep.TOP and chunks[1]["dir"] == "models"


def write_chunk(out, chunk, tests, complete, started):
    d = out / chunk["tag"] / chunk["backend"] / chunk["name"]
    (d / "files").mkdir(parents=True, exist_ok=True)
    (d / "files" / "rank0.json").write_text(json.dumps({"finished": complete, "tests": tests}))
    (d / "chunk.json").write_text(json.dumps(dict(chunk, rc=0, seconds=1.0, started=started, complete=complete)))


def test_report_merges_sweeps_counts_and_resumes(sweep, tmp_path, capsys):
    lm = tree(tmp_path / "lm")
    top, models0, models1 = sweep.chunks_of("t", lm, "cpu", per_run=2)
    a, b = tmp_path / "call1", tmp_path / "call2"
    # call 1: top complete (a pass, a categorised skip, Megatron's own skip); models-00 stopped mid-run
    write_chunk(a, top, {"tests/unit_tests/test_a.py::x": {"outcome": "passed"},
                         "tests/unit_tests/test_a.py::y": {"outcome": "skipped", "reason": "[ranks] needs more"},
                         "tests/unit_tests/test_b.py::z": {"outcome": "skipped", "reason": "needs 8 GPUs"}},
                True, started=1)
    write_chunk(a, models0, {"tests/unit_tests/models/test_m1.py::x": {"outcome": "failed", "message": "boom"},
                             "tests/unit_tests/models/test_m2.py::y": {"outcome": "running"}}, False, started=2)
    # call 2: models-00 again, complete: it wins over call 1's
    write_chunk(b, models0, {"tests/unit_tests/models/test_m1.py::x": {"outcome": "passed"},
                             "tests/unit_tests/models/test_m2.py::y": {"outcome": "error", "message": "E  bad"}},
                True, started=3)
    done, js, md = tmp_path / "done.txt", tmp_path / "sweep.json", tmp_path / "sweep.md"
    assert sweep.main(["report", str(a), str(b), "--checkout", f"t={lm}", "--backend", "cpu",
                       "--files-per-run", "2", "--done-list", str(done), "--json", str(js),
                       "--markdown", str(md)]) == 0
    table = md.read_text().splitlines()
    assert table[0] == "| directory | t cpu |" and "| `models` | 1 / 0 / 0 / 1 (1 chunks not run) |" in table, table
    assert table[-1] == "| **total** | **2 / 0 / 2 / 1 (1 chunks not run)** |", table
    rows = {r["dir"]: r for r in json.loads(js.read_text())["rows"]}
    assert rows[sweep.TOP]["passed"] == 1 and rows[sweep.TOP]["skipped"] == 2
    assert rows["models"]["passed"] == 1 and rows["models"]["error"] == 1 and rows["models"]["failed"] == 0
    assert rows["models"]["chunks run"] == 1 and rows["models"]["chunks not run"] == 1   # models-01
    assert json.loads(js.read_text())["skips"]["t|cpu"] == {"ranks": 1, "megatron": 1}
    assert done.read_text().split() == ["t/cpu/models-00", "t/cpu/top-00"]
    assert "ERROR [t/cpu/models-00] tests/unit_tests/models/test_m2.py::y: E  bad" in capsys.readouterr().out


def test_two_rank_cuda_chunks_take_their_own_ids_gpu_pairs_and_a_file_list(sweep, tmp_path):
    lm = tree(tmp_path)
    assert sweep.backend_ranks("cuda") == ("cuda", 1) and sweep.backend_ranks("cpu") == ("cpu", 2)
    assert sweep.backend_ranks("cuda:2") == ("cuda", 2)
    for bad in ("rocm", "cuda:x"):
        with pytest.raises(Exception, match="expected one of"):
            sweep.backend_ranks(bad)
    assert sweep._backend_spec("cuda:1") == "cuda" and sweep._backend_spec("cpu:2") == "cpu"
    assert sweep.gpu_groups(2, 2) == ["0,1"] and sweep.gpu_groups(5, 2) == ["0,1", "2,3"]
    assert sweep.gpu_groups(1, 2) == [] and sweep.gpu_groups(3, 1) == ["0", "1", "2"]
    listed = tmp_path / "files.txt"
    listed.write_text("# the files with [ranks] skips\ntests/unit_tests/models/test_m2.py\ntest_b.py\n")
    only = sweep.read_only_files(str(listed))
    assert only == {"models/test_m2.py", "test_b.py"}
    chunks = sweep.chunks_of("t", lm, "cuda:2", per_run=6, only=only)
    assert [(c["id"], c["files"]) for c in chunks] == [
        ("t/cuda:2/top-00", ["tests/unit_tests/test_b.py"]),
        ("t/cuda:2/models-00", ["tests/unit_tests/models/test_m2.py"])]
