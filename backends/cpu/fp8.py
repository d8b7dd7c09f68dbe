"""fp8 on the cpu backend: not served for training (torch's CPU `_scaled_mm` is a slow reference
path with no fp8 arithmetic units behind it); `fp8_linear` is left out of this backend's op table."""
from __future__ import annotations


def fp8_unavailable(recipe: str | None = None) -> str:
    return ("CPUs have no fp8 matrix units (torch's CPU _scaled_mm only emulates them): fp8 here "
            "would be a slow emulation, not training")
