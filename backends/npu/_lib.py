"""The one place the npu backend imports torch_npu (lazily: importing the backend never needs it),
and where the call forms that differ between torch_npu releases are chosen, once, from
`torch_npu.__version__` (api()).

torch_npu builds belong to "Ascend Extension for PyTorch" releases (Ascend/pytorch README, version
table): 6.0.0 = 2.1.0.post10 / 2.3.1.post4 / 2.4.0.post2; 7.0.0 = 2.1.0.post12 / 2.3.1.post6 /
2.4.0.post4 / 2.5.1; 7.1.0 = 2.1.0.post13 / 2.5.1.post1 / 2.6.0; 7.2.0 = 2.1.0.post17 / 2.6.0.post3 /
2.7.1 / 2.8.0; 7.3.0 = 2.6.0.post5 / 2.7.1.post2 / 2.8.0.post2 / 2.9.0. What each release's ops take
is in Ascend/op-plugin's `op_plugin/config/op_plugin_functions.yaml` on the release's branch; the
rows the backend relies on are copied, with their sources, into tests/npu/torch_npu_api.py.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

RELEASES = (
    ("6.0.0", ("2.1.0.post10", "2.3.1.post4", "2.4.0.post2")),
    ("7.0.0", ("2.1.0.post12", "2.3.1.post6", "2.4.0.post4", "2.5.1")),
    ("7.1.0", ("2.1.0.post13", "2.5.1.post1", "2.6.0")),
    ("7.2.0", ("2.1.0.post17", "2.6.0.post3", "2.7.1", "2.8.0")),
    ("7.3.0", ("2.6.0.post5", "2.7.1.post2", "2.8.0.post2", "2.9.0")),
)
_ORDER = [r for r, _ in RELEASES]
PROBES: dict = {}   # what a first call found out about this build (cleared with the module by _reset)
_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:rc\d+)?(?:\.post(\d+))?")


@functools.lru_cache(maxsize=None)
def torch_npu():
    import torch_npu as module  # noqa: WPS433 (Ascend's PyTorch adapter)

    return module


def version() -> str:
    try:
        return getattr(torch_npu(), "__version__", "unknown")
    except ImportError:
        return "not installed"


def _parse(text: str):
    m = _VERSION.match(text or "")
    return None if m is None else ((int(m[1]), int(m[2]), int(m[3])), int(m[4] or 0))


def release_of(text: str) -> tuple[str, str]:
    """(Ascend Extension release, note) for a torch_npu version string. A build newer than the
    table takes the newest release's forms; an unknown or older one the oldest targeted (6.0.0)."""
    parsed = _parse(text)
    if parsed is None:
        return "6.0.0", f"version {text!r} not understood: 6.0.0 call forms assumed (the most conservative)"
    base, post = parsed
    found = None
    for release, builds in RELEASES:
        for build in builds:
            b, p = _parse(build)
            if b == base and p <= post:
                found = release
    if found:
        return found, ""
    if base > max(_parse(b)[0] for _, builds in RELEASES for b in builds):
        return _ORDER[-1], f"torch_npu {text} is newer than the release table: {_ORDER[-1]} call forms assumed"
    return "6.0.0", f"torch_npu {text} is not in the release table: 6.0.0 call forms assumed (the most conservative)"


def _at_least(release: str, first: str) -> bool:
    return _ORDER.index(release) >= _ORDER.index(first)


@dataclass(frozen=True)
class Api:
    """The call forms this torch_npu takes (each row: tests/npu/torch_npu_api.py)."""
    version: str
    release: str
    note: str
    gmm_tensor_group_list: bool   # 7.0.0+: group_list Tensor + group_type / group_list_type; 6.0.0: int[] only
    gmm_k_axis: bool              # 7.2.0+: group_type=2 (K-axis groups; x transposed) -> [E, k, n]
    matmul_add_fp32: bool         # 7.0.0+: torch_npu._npu_matmul_add_fp32 (ATB LinearOperation, enAccum)
    rotary_mode: bool             # 7.0.0+: npu_rotary_mul(..., rotary_mode='half'|'interleave')
    moe_token_permute: bool       # 7.1.0+: npu_moe_token_permute / npu_moe_token_unpermute

    def describe(self) -> str:
        return f"torch_npu {self.version} (Ascend Extension for PyTorch {self.release} call forms)" + \
            (f"; {self.note}" if self.note else "")


def api_for(text: str) -> Api:
    release, note = release_of(text)
    return Api(version=text, release=release, note=note,
               gmm_tensor_group_list=_at_least(release, "7.0.0"),
               gmm_k_axis=_at_least(release, "7.2.0"),
               matmul_add_fp32=_at_least(release, "7.0.0"),
               rotary_mode=_at_least(release, "7.0.0"),
               moe_token_permute=_at_least(release, "7.1.0"))


@functools.lru_cache(maxsize=None)
def api() -> Api:
    """Chosen once per process (at backend load: check() calls it) from torch_npu.__version__."""
    return api_for(str(getattr(torch_npu(), "__version__", "unknown")))


def _reset() -> None:
    """Forget the imported module and its call forms (tests swap emulation profiles)."""
    torch_npu.cache_clear()
    api.cache_clear()
    PROBES.clear()
