"""megatron-adapt: one distribution; `backends/` and `patches/` install as subpackages of megatron_adapt."""
from setuptools import setup

PACKAGES = {
    "megatron_adapt": "megatron_adapt",
    "megatron_adapt.bootstrap": "megatron_adapt/bootstrap",
    "megatron_adapt.apps": "megatron_adapt/apps",
    "megatron_adapt.backends": "backends",
    "megatron_adapt.backends.cpu": "backends/cpu",
    "megatron_adapt.backends.cuda": "backends/cuda",
    "megatron_adapt.backends.npu": "backends/npu",
    "megatron_adapt.patches": "patches",
}

# The Megatron-LM training code imports these at start-up but megatron-core does not declare them.
MEGATRON_LM_RUNTIME = ["six", "regex", "pyyaml", "pydantic", "psutil", "einops"]
# pretrain_gpt.py --sft (tests/megatron_lm/test_pretrain_gpt_sft.py): SFTTokenizer loads an HF tokenizer,
# SFTDataset reads jsonl through `datasets`; core_v0.16's SFTTokenizer reads transformers 4's return types.
SFT_RUNTIME = ["transformers<5", "datasets"]

setup(
    name="megatron-adapt",
    version="0.1.0",
    description="Hardware-backend plugin layer for NVIDIA Megatron-LM (cuda, npu, cpu)",
    python_requires=">=3.10",
    packages=list(PACKAGES),
    py_modules=["megatron_adapt_cli"],  # the console scripts' entry points: see its docstring
    package_dir=PACKAGES,
    install_requires=["torch>=2.4", "wrapt>=1.15", "packaging"],
    extras_require={
        "megatron": ["megatron-core>=0.15.0,<0.20"] + MEGATRON_LM_RUNTIME,
        "test": ["pytest>=7", "pytest-mock", "mock", "megatron-core>=0.15.0,<0.20", "triton", "numpy", "liger-kernel", "matplotlib"] + MEGATRON_LM_RUNTIME,
        "sft": SFT_RUNTIME,  # only the --sft stock-script tests need them (they skip without)
        "cuda": ["triton>=3.0", "nvidia-cudnn-frontend>=1.22",   # cudnn: packed (thd) attention on Hopper
                 "nvmath-python>=1.0"],   # cuBLASLt beta=1: the fp8 wgrad accumulates into main_grad in the GEMM
        "liger": ["liger-kernel"],  # candidates the cuda backend uses where they measure faster
        "flash_attn": ["flash-attn-4[cu13]>=4.0.0b36"],  # FlashAttention-4 (CuTe DSL), same rule
        "npu": [],  # torch_npu comes from Ascend's own index, matched to the CANN toolkit
    },
    entry_points={
        "console_scripts": [
            "megatron-adapt=megatron_adapt_cli:main",
            "megatron-adapt-run=megatron_adapt_cli:run",
        ]
    },
)
