#!/usr/bin/env bash
# Megatron-LM's own unit tests under megatron-adapt on GPUs (cuda backend): issue 11's 16 files with
# 1 GPU, and again with 2 GPUs where the machine has them. Results (per-file counts, summary.json,
# each run's pytest.log and per-rank JSON) under $OUT; the counts are also printed.
#
#   MEGATRON_LM_PATH=<Megatron-LM checkout, tag core_v<installed megatron-core>> OUT=<dir> \
#     [MCORE_WHEEL=<megatron_core-*.whl>] [WHEELS=<dir of wheels>] [RUN_TIMEOUT=s] [TEST_TIMEOUT=s] bash scripts/megatron_unit_tests_gpu.sh
#
# On a machine without network: WHEELS names a directory holding every wheel to install
# (`.gpu-wheels/`, filled by `pip download` as docs/megatron-unit-tests.md says); MCORE_WHEEL the
# megatron-core wheel matching the checkout. Installs megatron-adapt from this checkout (--no-deps).
set -euo pipefail
: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout (with tests/unit_tests)}"
: "${OUT:?set OUT to the directory for the results}"
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
PIP=("$PY" -m pip install -q --disable-pip-version-check)
if [ -n "${WHEELS:-}" ]; then PIP+=(--no-index --find-links "$WHEELS"); fi
mkdir -p "$OUT"
"${PIP[@]}" pytest pytest-mock mock six regex pyyaml pydantic psutil einops wrapt packaging setuptools wheel
if [ -n "${MCORE_WHEEL:-}" ]; then "${PIP[@]}" --no-deps "$MCORE_WHEEL"; fi
# megatron-adapt from this checkout, unless this Python already imports it (e.g. from PYTHONPATH)
"$PY" -c "import megatron_adapt.backends" 2>/dev/null || "${PIP[@]}" --no-deps --no-build-isolation -e "$HERE"
"$PY" - <<'PYEOF' | tee "$OUT/environment.txt"
import importlib.metadata as m, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("gpus", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
for d in ("megatron-core", "megatron-adapt", "pytest", "transformer-engine", "apex", "flash-attn"):
    try:
        print(d, m.version(d))
    except m.PackageNotFoundError:
        print(d, "not installed")
PYEOF
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
rc=0
"$PY" "$HERE/scripts/megatron_unit_tests.py" --backend cuda --nproc 1 --out "$OUT/cuda-1gpu" \
    --run-timeout "${RUN_TIMEOUT:-1500}" --test-timeout "${TEST_TIMEOUT:-600}" 2>&1 | tee "$OUT/cuda-1gpu.txt" || rc=$?
if [ "$NGPU" -ge 2 ]; then
  "$PY" "$HERE/scripts/megatron_unit_tests.py" --backend cuda --nproc 2 --out "$OUT/cuda-2gpu" \
      --run-timeout "${RUN_TIMEOUT:-1500}" --test-timeout "${TEST_TIMEOUT:-600}" 2>&1 | tee "$OUT/cuda-2gpu.txt" || rc=$?
fi
exit $rc
