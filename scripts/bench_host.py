"""What the GPU benchmark scripts share: the host CPU that every figure names, and one timing rule
(triton.testing.do_bench medians). Imported as `from bench_host import ...` by scripts run as
`python3 scripts/<name>.py` (the script's folder is on sys.path)."""
import platform
import subprocess


def cpu_model() -> str:
    """lscpu's model name (the host of a GPU figure), else platform.processor()."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name"))
    except Exception:   # noqa: BLE001 - no lscpu, or no model line
        return platform.processor()


def bench(fn) -> float:
    """Median ms of fn on the GPU."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=60)


def device_copy_gbs(dev: str = "cuda", nbytes: int = 1 << 28) -> float:
    """The device's copy bandwidth (GB/s, read + write) that kernel figures are a fraction of."""
    import torch
    src, dst = torch.empty(nbytes, dtype=torch.uint8, device=dev), torch.empty(nbytes, dtype=torch.uint8, device=dev)
    return 2 * nbytes / bench(lambda: dst.copy_(src)) / 1e6
