"""Typed configuration, resolved from explicit arguments first, then the environment.

Never read from sys.argv: Megatron owns the command line.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

ENV_BACKEND = "MEGATRON_ADAPT_BACKEND"
ENV_STRICT = "MEGATRON_ADAPT_STRICT"
ENV_DISABLE = "MEGATRON_ADAPT_DISABLE"
ENV_REPORT = "MEGATRON_ADAPT_REPORT"
ENV_AUTO = "MEGATRON_ADAPT_AUTO"  # "0": `import megatron_adapt` does not apply (library / test use)
ENV_QUIET = "MEGATRON_ADAPT_QUIET"  # "1": no start-up table on rank 0
ENV_ATTENTION_LAYOUT = "MEGATRON_ADAPT_ATTENTION_LAYOUT"  # sbhd (SBH) | bshd (BSH)
ENV_ALLOW_UNTESTED = "MEGATRON_ADAPT_ALLOW_UNTESTED_MEGATRON"  # "1": try a megatron-core newer than SUPPORTED
ENV_EXTERNAL = "MEGATRON_ADAPT_EXTERNAL"  # auto | off | liger | apex (backends/cuda/providers.py)
ENV_CHECKPOINT_HARDEN = "MEGATRON_ADAPT_CHECKPOINT_HARDEN"  # "1": patches/checkpoint_hardening.py
ENV_CUDA_GRAPHS = "MEGATRON_ADAPT_CUDA_GRAPHS"  # auto | off | local (patches/cuda_graphs.py)
CUDA_GRAPH_MODES = ("auto", "off", "local")
ENV_EAGER_OPS = "MEGATRON_ADAPT_EAGER_OPS"  # triton | torch (backends/cuda/_common.py: eager_native)
EAGER_OPS_MODES = ("torch", "triton")
EXTERNAL_MODES = ("auto", "off", "liger", "apex", "flash_attn")
ATTENTION_LAYOUTS = {"sbhd": "sbhd", "sbh": "sbhd", "bshd": "bshd", "bsh": "bshd"}


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _split(value: str | None) -> frozenset[str]:
    return frozenset(p.strip() for p in (value or "").split(",") if p.strip())


def _layout(value: str | None) -> str:
    key = (value or "sbhd").strip().lower()
    if key not in ATTENTION_LAYOUTS:
        from .errors import ConfigError
        raise ConfigError(f"{ENV_ATTENTION_LAYOUT}={value!r}: expected SBH/sbhd (Megatron's "
                          "[seq, batch, head, dim] order) or BSH/bshd (batch-first)")
    return ATTENTION_LAYOUTS[key]


def _choice(env: str, value: str | None, modes: tuple, hint: str) -> str:
    """One of `modes` (the first is the default), or a ConfigError naming the variable."""
    mode = (value or modes[0]).strip().lower()
    if mode not in modes:
        from .errors import ConfigError
        raise ConfigError(f"{env}={value!r}: expected one of {', '.join(modes)} ({hint})")
    return mode


def _external(value: str | None) -> str:
    return _choice(ENV_EXTERNAL, value, EXTERNAL_MODES, "auto: another library's kernel only where it measures faster")


def _cuda_graphs(value: str | None) -> str:
    return _choice(ENV_CUDA_GRAPHS, value, CUDA_GRAPH_MODES,
                   "auto (default): Megatron's --cuda-graph-impl local where megatron-adapt has measured it "
                   "safe, eager elsewhere with the reason; off: Megatron's flags alone; local: graphs "
                   "wherever Megatron can capture")


def _eager_ops(value: str | None) -> str:
    return _choice(ENV_EAGER_OPS, value, EAGER_OPS_MODES,
                   "the cuda backend's norms, activations and bias-dropout-add outside CUDA-graph capture: "
                   "torch: PyTorch's native ops, fewer host microseconds; triton: its Triton kernels")


@dataclass(frozen=True)
class Config:
    backend: str = "auto"
    strict: bool = False
    disabled: frozenset[str] = field(default_factory=frozenset)
    report_path: str | None = None
    quiet: bool = False
    attention_layout: str = "sbhd"  # memory order the attention kernel reads q/k/v in
    external: str = "auto"          # other libraries' kernels: auto (where faster) | off | liger | apex | flash_attn
    allow_untested: bool = False    # a megatron-core newer than SUPPORTED warns instead of failing
    checkpoint_harden: bool = False  # checkpoint files 0640 / dirs 0750, refuse world-writable, weights_only
    cuda_graphs: str = "auto"       # Megatron's own CUDA graphs: auto (where measured safe) | off (Megatron's flags decide) | local
    cuda_graphs_chosen: bool = False  # cuda_graphs came from the environment or a switch, not the default
    eager_ops: str = "torch"        # cuda norms / activations / bias-dropout-add outside graph capture: torch | triton

    @classmethod
    def resolve(cls, backend: str | None = None, **switches) -> "Config":
        """Explicit arguments win over the environment.

        switches: strict=bool, report_path=str, quiet=bool, attention_layout=str, external=str,
        allow_untested=bool, checkpoint_harden=bool, cuda_graphs=str, eager_ops=str, disable=iterable of areas, and
        ``<area>=False`` to turn one patch area off (``cross_entropy=False``).
        """
        env = os.environ
        disabled = set(_split(env.get(ENV_DISABLE)))
        disabled |= set(switches.pop("disable", ()) or ())
        for key in list(switches):
            if key in ("strict", "report_path", "quiet", "attention_layout", "external", "allow_untested",
                       "checkpoint_harden", "cuda_graphs", "eager_ops"):
                continue
            value = switches.pop(key)
            if value is False:
                disabled.add(key)
            elif value is True:
                disabled.discard(key)
            else:
                raise TypeError(f"unknown switch {key}={value!r}: area switches take True/False")
        harden = switches.get("checkpoint_harden", _truthy(env.get(ENV_CHECKPOINT_HARDEN)))
        if harden and _truthy(env.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")):
            from .errors import ConfigError
            raise ConfigError(f"{ENV_CHECKPOINT_HARDEN}=1 loads checkpoints with torch.load(weights_only=True), "
                              "but TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set: unset one of the two")
        return cls(
            backend=(backend or env.get(ENV_BACKEND) or "auto").strip().lower(),
            strict=switches.get("strict", _truthy(env.get(ENV_STRICT))),
            disabled=frozenset(disabled),
            report_path=switches.get("report_path", env.get(ENV_REPORT) or None),
            quiet=switches.get("quiet", _truthy(env.get(ENV_QUIET))),
            attention_layout=_layout(switches.get("attention_layout", env.get(ENV_ATTENTION_LAYOUT))),
            external=_external(switches.get("external", env.get(ENV_EXTERNAL))),
            allow_untested=switches.get("allow_untested", _truthy(env.get(ENV_ALLOW_UNTESTED))),
            checkpoint_harden=bool(harden),
            cuda_graphs=_cuda_graphs(switches.get("cuda_graphs", env.get(ENV_CUDA_GRAPHS))),
            cuda_graphs_chosen=bool(switches.get("cuda_graphs") or env.get(ENV_CUDA_GRAPHS)),
            eager_ops=_eager_ops(switches.get("eager_ops", env.get(ENV_EAGER_OPS))),
        )

    def enabled(self, area: str) -> bool:
        return area not in self.disabled and "all" not in self.disabled
