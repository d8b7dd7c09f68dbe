"""PatchContract: the mechanics every patch must satisfy. One subclass per patches/ module."""
import json
import os
from functools import lru_cache

import pytest

from adapt_testutil import run_python

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe.py")


@lru_cache(maxsize=None)
def probe(scenario: str, env_items: tuple = ()):
    out = run_python([PROBE, scenario], env=dict(env_items)).stdout
    line = next(l for l in out.splitlines() if l.startswith("PROBE-JSON:"))
    return json.loads(line[len("PROBE-JSON:"):])


def specs_of(area):
    from probe import specs_for_this_megatron

    # the probes run the cpu backend: a spec for other backends only is tested by its own test
    return [s for s in specs_for_this_megatron() if s.area == area and "cpu" in s.backends]


class PatchContract:
    """Subclasses set `area`; every spec of that area is checked in every scenario."""

    area: str = ""
    env: tuple = ()     # (name, value) pairs the probes run with (an area behind a switch)

    def _targets(self):
        targets = [s.target for s in specs_of(self.area)]
        if not targets:
            from megatron_adapt.core import all_specs
            from megatron_adapt.versions import megatron_core_version

            ranges = sorted({s.versions for s in all_specs() if s.area == self.area})
            assert ranges, f"area {self.area!r} declares no specs"
            pytest.skip(f"area {self.area!r} has no target in megatron-core {megatron_core_version()} "
                        f"(its specs are for {', '.join(ranges)})")
        return targets

    def test_target_exists_and_applies_when_patched_before_import(self):
        res = probe("before", self.env)
        for t in self._targets():
            assert res[t]["status"] == "applied", (t, res[t])
            assert res[t]["ours"], t
            assert all(res[t]["aliases_ours"]), (t, "an alias still holds the original")

    def test_applies_when_patched_after_import(self):
        res = probe("after", self.env)
        for t in self._targets():
            assert res[t]["status"] == "applied" and res[t]["ours"], (t, res[t])
            assert all(res[t]["aliases_ours"]), t

    def test_idempotent(self):
        res = probe("idempotent", self.env)
        for t in self._targets():
            assert res["first"][t] == res["second"][t], t

    def test_revert_restores_every_site_and_reapplies(self):
        res = probe("revert", self.env)
        assert res["device_restored"]
        for t in self._targets():
            assert res["patched"][t]["ours"], t
            assert res["restored"][t], f"{t} not restored"
            assert res["reapplied"][t]["ours"], f"{t} not re-applied after revert"
        assert all(res["alias_restored"].values()), res["alias_restored"]

    def test_disabled_by_switch(self):
        res = probe("disabled", self.env)
        for t in self._targets():
            assert res[t]["status"] == "disabled" and res[t]["original"], (t, res[t])
