"""Weight-gradient accumulation into Megatron's `main_grad` (gradient-accumulation fusion): the
reference, one `addmm_` in main_grad's dtype."""
from megatron_adapt import report
from megatron_adapt.backends import reference


def wgrad_accumulate(input, grad_output, main_grad):  # noqa: A002 (apex's argument order)
    report.ran("wgrad_accumulate", "cpu.addmm_")
    reference.wgrad_accumulate(input, grad_output, main_grad)
