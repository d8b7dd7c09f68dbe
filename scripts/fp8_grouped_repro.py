"""Is the experts' fp8 grouped linear bit-reproducible on this GPU, and is its weight cache bit-equal to
casting at every call? At the MoE bench's shapes (8 experts, 8192 routed rows, hidden 2048, fc1 5632):
forward + backward without the cache, repeated with the caching allocator's layout moved between
repeats, then with the cache (made, then reused). Prints, per repeat, whether y, dx and dW equal the
first run's to the bit and their largest difference.

Why (docs/fp8.md, "The experts' fp8 weight cache"): on an H200 the bench's --no-fp8-wgrad run gave the
old code's losses to the last digit with the cache, the fp8-wgrad run differed from the 5th digit; the
fp8 wgrad GEMM (torch._scaled_grouped_mm, 2d x 2d) is the code the two runs do not share. Ran on an H200
on 2026-11-29: every repeat equal to the bit, cached and not (docs/fp8.md, "The experts' fp8 wgrad goes into
main_grad per expert").

    python3 scripts/fp8_grouped_repro.py      # one Hopper GPU, megatron-adapt installed
"""
import torch

from megatron_adapt.backends.cuda import fp8
from megatron_adapt.backends.fp8_scaling import Fp8Recipe, Fp8WeightCache


def main():
    torch.manual_seed(0)
    e, t, h, f = 8, 8192, 2048, 5632
    sizes = [t // e] * e
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(e, f, h, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(t, f, device="cuda", dtype=torch.bfloat16)

    def once(cache):
        x.grad = w.grad = None
        y = fp8.fp8_grouped_gemm(x, w, sizes, Fp8Recipe(), weight_cache=cache)
        y.backward(dy)
        torch.cuda.synchronize()
        return y.detach().clone(), x.grad.clone(), w.grad.clone()

    def show(label, got, ref):
        print(label, "bit-equal (y, dx, dW):", [bool(torch.equal(a, b)) for a, b in zip(got, ref)],
              "max |diff|:", [float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref)], flush=True)

    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    ref = once(None)
    held = []
    for i in range(6):
        held.append(torch.empty(int(1e6) * (i + 1), device="cuda"))   # move the allocator's layout
        show(f"uncached, repeat {i}:", once(None), ref)
    cache = Fp8WeightCache()
    for i in range(4):
        cache.skip = i > 0
        show(f"cached, call {i} ({'reused' if i else 'made'}):", once(cache), ref)


if __name__ == "__main__":
    main()
