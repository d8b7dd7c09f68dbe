"""Every error megatron-adapt raises on bad input; each message says what to do."""


class MegatronAdaptError(RuntimeError):
    """Base class."""


class UnknownBackendError(MegatronAdaptError, ValueError):
    """MEGATRON_ADAPT_BACKEND (or apply(backend=...)) names no backend we have."""


class BackendUnavailableError(MegatronAdaptError):
    """An explicitly requested backend cannot run here (no GPU, no torch_npu, ...)."""


class UnsupportedMegatronVersionError(MegatronAdaptError, ImportError):
    """The megatron-core found is outside the range every patch was verified on."""


class StrictFallbackError(MegatronAdaptError):
    """MEGATRON_ADAPT_STRICT=1 and an op or patch had to fall back."""


class PatchError(MegatronAdaptError):
    """A patch could not be applied (target missing, signature incompatible)."""


class ConfigError(MegatronAdaptError, ValueError):
    """A megatron-adapt setting (environment variable or argument) with a value it does not take."""


class UnsupportedFeatureError(MegatronAdaptError, ValueError):
    """A Megatron feature that the selected backend (or megatron-adapt) cannot serve was asked for:
    refused at start, naming the flag, the backend and the reason (never a silent fallback)."""
