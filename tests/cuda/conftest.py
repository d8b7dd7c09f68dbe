"""tests/cuda: the cuda backend's kernels against fp32 references.

Without a GPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set here before
anything imports triton) on small shapes; with one they run compiled on larger shapes.
Setting the variable only changes how Triton kernels execute, so other test directories are
unaffected (they launch no Triton kernels).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
