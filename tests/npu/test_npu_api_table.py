"""The emulation against the table of real torch_npu schemas (torch_npu_api.py), under every
profile: the same functions (and no others), the same parameters (names, keyword-only or not,
defaults), the same return structure and layouts, the same documented refusals. And the backend's
call-form choice (_lib.api()) agrees with the table row by row."""
import ast
import inspect

import pytest
import torch

from torch_npu_api import PROFILES, ROWS, rows_for

KW = inspect.Parameter.KEYWORD_ONLY
POS = inspect.Parameter.POSITIONAL_OR_KEYWORD


def _split(args):
    out, depth, cur = [], 0, ""
    for ch in args:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


def _default(text):
    return {"None": None, "True": True, "False": False}.get(text, None) if text in ("None", "True", "False") \
        else ast.literal_eval(text)


def parse(schema):
    """'name(Type a, *, Type b=1) -> Ret' -> (name, [(param, kind, default | empty)], returns)."""
    name, rest = schema.split("(", 1)
    args, ret = rest.rsplit(") -> ", 1)
    params, kind = [], POS
    for arg in _split(args):
        if arg == "*":
            kind = KW
            continue
        decl, _, default = arg.partition("=")
        pname = decl.rsplit(" ", 1)[1]
        params.append(("input" if pname == "self" else pname, kind,
                       _default(default) if default else inspect.Parameter.empty))
    return name.strip(), params, ret.strip()


def test_parser_reads_the_schema_forms():
    name, params, ret = parse("f(Tensor self, Tensor(a!) C, *, int[]? g=None, str m='half', float s=1., "
                              "Scalar k=1, str l=\"\") -> (Tensor, int)")
    assert name == "f" and ret == "(Tensor, int)"
    assert params == [("input", POS, inspect.Parameter.empty), ("C", POS, inspect.Parameter.empty),
                      ("g", KW, None), ("m", KW, "half"), ("s", KW, 1.0), ("k", KW, 1), ("l", KW, "")]


def test_every_profile_has_rows_and_each_row_names_a_source():
    for release in PROFILES:
        assert rows_for(release)
    for row in ROWS:
        assert row.source and row.layout and set(row.releases) <= set(PROFILES), row.op
        for refusal in row.refusals:
            assert refusal.source, (row.op, refusal.what)


def test_same_functions(torch_npu):
    assert sorted(torch_npu.OPS) == sorted(r.op for r in rows_for(torch_npu.PROFILE))
    for row in ROWS:
        if torch_npu.PROFILE not in row.releases and row.op not in torch_npu.OPS:
            assert not hasattr(torch_npu, row.op), f"{row.op} exists in emulated {torch_npu.PROFILE}"


@pytest.mark.parametrize("index", range(len(ROWS)), ids=[f"{r.op}@{'/'.join(r.releases)}" for r in ROWS])
def test_same_parameters_returns_and_refusals(torch_npu, index):
    row = ROWS[index]
    if torch_npu.PROFILE not in row.releases:
        pytest.skip(f"row not in {torch_npu.PROFILE}")
    name, params, returns = parse(row.schema)
    fn = getattr(torch_npu, name)
    got = [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
    assert got == params, f"{name}: emulation {got}\n table {params}"

    C = torch.zeros(2, 4)   # noqa: N806 (the example of _npu_matmul_add_fp32 accumulates into it)
    out = eval(row.example, {"t": torch_npu, "torch": torch, "C": C})  # noqa: S307 (table expressions)
    if returns == "()":
        assert out is None
    elif returns == "Tensor":
        assert isinstance(out, torch.Tensor)
    elif returns == "Tensor[]":
        assert isinstance(out, list) and all(isinstance(o, torch.Tensor) for o in out)
    else:
        kinds = [k.strip() for k in returns.strip("()").split(",")]
        assert isinstance(out, tuple) and len(out) == len(kinds)
        for value, kind in zip(out, kinds):
            assert isinstance(value, {"Tensor": torch.Tensor, "int": int}[kind]), (kind, type(value))
    assert eval(row.expect, {"out": out, "torch": torch, "C": C}), f"{name}: layout is not {row.layout}"  # noqa: S307

    for refusal in row.refusals:
        with pytest.raises((torch_npu.EmulatedNPUError, TypeError), match=refusal.match):
            eval(refusal.call, {"t": torch_npu, "torch": torch})  # noqa: S307


def test_backend_call_forms_follow_the_table(torch_npu):
    """The forms _lib.api() chooses from this profile's __version__ are the ones its rows allow."""
    from megatron_adapt.backends.npu import _lib

    forms = _lib.api()
    assert forms.release == torch_npu.PROFILE and not forms.note
    rows = {r.op: r.schema for r in rows_for(torch_npu.PROFILE)}
    assert forms.gmm_tensor_group_list == ("Tensor? group_list" in rows["npu_grouped_matmul"])
    assert forms.rotary_mode == ("rotary_mode" in rows["npu_rotary_mul"])
    assert forms.matmul_add_fp32 == ("_npu_matmul_add_fp32" in rows)
    assert forms.moe_token_permute == ("npu_moe_token_permute" in rows)
    k_axis = [r for r in rows_for(torch_npu.PROFILE) if r.op == "npu_grouped_matmul"][0]
    assert forms.gmm_k_axis == ("y [E, k, n] for 2" in k_axis.source and torch_npu.PROFILE != "7.1.0")


@pytest.mark.parametrize("version,release", [
    ("2.1.0.post10", "6.0.0"), ("2.1.0.post11", "6.0.0"), ("2.4.0.post2", "6.0.0"), ("2.1.0.post12", "7.0.0"),
    ("2.5.1", "7.0.0"), ("2.5.1.post1", "7.1.0"), ("2.6.0", "7.1.0"), ("2.6.0.post3", "7.2.0"),
    ("2.7.1", "7.2.0"), ("2.6.0.post5+gitabc", "7.3.0"), ("2.9.0", "7.3.0"), ("2.10.0", "7.3.0"),
    ("2.1.0.post8", "6.0.0"), ("2.2.0", "6.0.0"), ("garbage", "6.0.0")])
def test_release_of_a_version(version, release):
    from megatron_adapt.backends.npu import _lib

    got, note = _lib.release_of(version)
    assert got == release
    known = any(version.split("+")[0] == b for _, builds in _lib.RELEASES for b in builds)
    assert (note == "") == (known or version in ("2.1.0.post11", "2.5.1.post1", "2.6.0.post5+gitabc"))
