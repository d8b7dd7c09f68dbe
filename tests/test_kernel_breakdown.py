"""scripts/kernel_breakdown.py sums a profiled step's GPU kernels by kind (CPU only: a synthetic
torch.profiler trace with the kernel names an H100 run printed)."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "kernel_breakdown.py")

KERNELS = [   # (name, start us, duration us)
    ("nvjet_sm90_qqtst_192x192_128x4_2x1_v_bz_coopB_TNN", 0, 100),              # e4m3 x e4m3
    ("nvjet_sm90_qrtst_128x128_128x6_1x2_h_bz_coopA_algo2_TNT", 100, 50),       # e4m3 x e5m2
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 150, 40),                 # bf16
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", 190, 30),
    ("_cast_kernel", 220, 20),
    ("_amax_kernel", 240, 10),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, "
     "at::native::AbsMaxOps<c10::BFloat16>, unsigned int, float, 4> >", 250, 8),
    ("_norm_fwd", 300, 6),     # after a 42 us gap: busy time must leave it out
]


def run(tmp_path, *args):
    trace = {"traceEvents": [{"ph": "X", "cat": "kernel", "name": n, "ts": t, "dur": d}
                             for n, t, d in KERNELS]
             + [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 999},   # not GPU time
                {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 254, "dur": 6}]}   # overlaps
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "host.1.pt.trace.json").write_text(json.dumps(trace))
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "tb"), "--json", str(out), *args],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text()), proc.stdout


def test_kernels_are_summed_by_kind(tmp_path):
    res, text = run(tmp_path, "--steps", "2")
    cats = res["categories_ms_per_step"]
    assert cats["gemm fp8"] == 0.075            # both nvjet fp8 kinds, (100 + 50) us over 2 steps
    assert cats["gemm"] == 0.02                 # the bf16 one only
    assert cats["attention"] == 0.015           # cuDNN SDPA, although its name says wgmma
    assert cats["fp8 casts (Triton)"] == 0.015  # _cast_kernel and _amax_kernel
    assert cats["fp8 amax (torch reduce)"] == 0.004
    assert cats["norms"] == 0.003 and cats["gpu_memcpy"] == 0.003
    assert res["kernel_ms_per_step"] == 0.135   # 270 us of kernels
    assert res["gpu_busy_ms_per_step"] == 0.133  # their union: the copy overlaps a kernel by 4 us
    assert res["span_ms_per_step"] == 0.153
    assert res["top_kernels"][0]["name"].startswith("nvjet_sm90_qqtst")
    assert "gemm fp8" in text
    gaps = res["idle_gaps"]   # one 40 us gap (the copy ends at 260; the norm starts at 300)
    assert gaps["ms_per_step"]["20-100 us"] == 0.02 and gaps["count_per_step"]["20-100 us"] == 0.5
    assert sum(gaps["ms_per_step"].values()) == 0.02
    assert gaps["longest"] == [{"us": 40.0, "host_ops": ["aten::mm"]}]


def test_core_019s_gzipped_trace_is_found(tmp_path):
    import gzip
    (tmp_path / "torch_profile").mkdir()
    with gzip.open(tmp_path / "torch_profile" / "rank-0.json.gz", "wt") as f:
        json.dump({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "_cast_kernel", "ts": 0, "dur": 40}]}, f)
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0 and "fp8 casts (Triton)" in proc.stdout and "0.04" in proc.stdout


def test_no_trace_is_an_error_that_says_where(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode != 0 and "no *.pt.trace.json" in proc.stderr
