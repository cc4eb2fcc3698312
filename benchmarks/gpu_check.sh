#!/usr/bin/env bash
# The CUDA check of issue 29, as one command for a lent GPU machine (no network, its own python3).
#
#   bash benchmarks/gpu_check.sh                      # on the GPU machine, from the repo root
#   GPU_CHECK_DRY_RUN=1 OUT=/tmp/o bash benchmarks/gpu_check.sh   # CPU dry run (tests/cuda/test_gpu_check.py)
#
# Steps, each bounded by `timeout`, 470 s at most in all (GPU_CHECK_TOTAL):
#   0. async_ckpt importable without installing (PYTHONPATH=repo root); crc32c, which the image
#      lacks, installed from the wheels benchmarks/gpu_prepare.sh put in .device/wheels (carried);
#   1. versions and nvidia-smi                         -> $OUT/env.log
#   2. the CUDA tests (tests/cuda/test_cuda.py + the cuda tests of test_lazy.py and test_hostile_staging.py)
#                                                      -> $OUT/cuda_tests.log
#   3. benchmarks/bench_cuda.py (2 GiB state on the GPU) -> $OUT/bench_cuda.json, $OUT/bench_cuda.log
#   4. what ran, what was skipped and why, exit codes  -> $OUT/gpu_check.json
# Without crc32c (no wheel carried) async_ckpt cannot be imported: the tests are skipped and the
# benchmark measures its references only; gpu_check.json says so. Exit status: 0 when every step
# that ran passed, 1 otherwise.
#
# Environment: OUT (default ./gpu_check_out), PYTHON (default python3), GPU_CHECK_DRY_RUN=1 (CPU,
# tiny sizes: the CUDA tests skip), GPU_CHECK_WHEELS (default .device/wheels),
# GPU_CHECK_TEST_TIMEOUT (s, default 130), GPU_CHECK_BENCH_TIMEOUT (s, default 250, less when
# the steps before took long: the run ends by GPU_CHECK_TOTAL, default 470 s),
# GPU_CHECK_BENCH_ARGS (extra arguments for bench_cuda.py, e.g. "--size-mb 512").
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
OUT=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT" || exit 2
PY=${PYTHON:-python3}
DRY=${GPU_CHECK_DRY_RUN:-0}
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/.device/wheels}
TEST_TIMEOUT=${GPU_CHECK_TEST_TIMEOUT:-130}
BENCH_TIMEOUT=${GPU_CHECK_BENCH_TIMEOUT:-250}
TOTAL=${GPU_CHECK_TOTAL:-470}  # the benchmark's bound shrinks so that the whole run ends by then
SITE=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_site.XXXXXX") || exit 2
trap 'rm -rf "$SITE"' EXIT
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PJRT_DEVICE=${PJRT_DEVICE:-CPU}
NOTES=()
note() { echo "gpu_check: $*"; NOTES+=("$*"); }
started=$(date +%s)

# ---- 0. dependencies -------------------------------------------------------------------------
if ! "$PY" -c "import crc32c" 2>/dev/null; then
    if compgen -G "$WHEELS/crc32c-*.whl" >/dev/null; then
        if timeout 30 "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
                --target "$SITE" --find-links "$WHEELS" crc32c; then
            note "crc32c installed from $WHEELS into $SITE"
        else
            note "crc32c: no wheel in $WHEELS fits this python ($("$PY" -V 2>&1)); run benchmarks/gpu_prepare.sh"
        fi
    else
        note "crc32c missing and no wheel in $WHEELS: run benchmarks/gpu_prepare.sh here, carry .device"
    fi
fi
OURS=1
if ! IMPORT_ERR=$("$PY" -c "import async_ckpt" 2>&1); then
    OURS=0
    note "async_ckpt cannot be imported: CUDA tests skipped, benchmark runs its references only: $(echo "$IMPORT_ERR" | tail -1)"
fi

# ---- 1. versions -----------------------------------------------------------------------------
{
    echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')  host: $(uname -srm)  nproc: $(nproc)  dry run: $DRY"
    timeout 40 "$PY" - <<'EOF'
import importlib.metadata as md, sys
print("python", sys.version.split()[0], sys.executable)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
try:
    import async_ckpt
    print("async_ckpt", async_ckpt.__version__, async_ckpt.__file__)
except Exception as e:
    print(f"async_ckpt: not importable ({type(e).__name__}: {e})")
for name in ("crc32c", "fsspec", "numpy", "pytest", "pytest-timeout", "hypothesis", "safetensors", "transformers",
             "lightning", "xxhash"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(f"{name}: not installed")
EOF
    if command -v nvidia-smi >/dev/null; then timeout 15 nvidia-smi; else echo "nvidia-smi: not found"; fi
    df -h "${TMPDIR:-/tmp}" 2>/dev/null
} 2>&1 | tee "$OUT/env.log"

# ---- 2. CUDA tests ---------------------------------------------------------------------------
TESTS_RC=skipped
if [ "$OURS" = 1 ]; then
    timeout -k 5 "$TEST_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider -rs -k cuda \
        tests/cuda/test_cuda.py tests/save_restore/test_lazy.py tests/damage/test_hostile_staging.py 2>&1 | tee "$OUT/cuda_tests.log"
    TESTS_RC=$?
    [ "$TESTS_RC" = 124 ] && note "CUDA tests stopped after ${TEST_TIMEOUT}s"
else
    echo "skipped: async_ckpt cannot be imported (see env.log)" | tee "$OUT/cuda_tests.log"
fi

# ---- 3. benchmark ----------------------------------------------------------------------------
LEFT=$((TOTAL - ($(date +%s) - started) - 5))
[ "$LEFT" -lt "$BENCH_TIMEOUT" ] && BENCH_TIMEOUT=$((LEFT > 30 ? LEFT : 30))
BENCH_ARGS=(--out "$OUT" --budget-s $((BENCH_TIMEOUT * 3 / 4)))
[ "$DRY" = 1 ] && BENCH_ARGS+=(--dry-run)
# shellcheck disable=SC2206  # word splitting of the extra arguments is meant
BENCH_ARGS+=(${GPU_CHECK_BENCH_ARGS:-})
timeout -k 5 "$BENCH_TIMEOUT" "$PY" benchmarks/bench_cuda.py "${BENCH_ARGS[@]}" 2>&1 | tee "$OUT/bench_cuda.log"
BENCH_RC=$?
[ "$BENCH_RC" = 124 ] && note "benchmark stopped after ${BENCH_TIMEOUT}s (bench_cuda.json holds what it measured)"

# ---- 4. summary ------------------------------------------------------------------------------
RC=0
{ [ "$TESTS_RC" = 0 ] || [ "$TESTS_RC" = skipped ]; } || RC=1
[ "$BENCH_RC" = 0 ] || RC=1
printf '%s\n' "${NOTES[@]+"${NOTES[@]}"}" | "$PY" -c '
import json, sys
notes = [ln for ln in sys.stdin.read().splitlines() if ln]
tests, bench, dry, ours, took, rc, out = sys.argv[1:8]
json.dump({"tests_rc": tests if tests == "skipped" else int(tests), "bench_rc": int(bench), "dry_run": dry == "1",
           "async_ckpt_importable": ours == "1", "elapsed_s": int(took), "rc": int(rc), "notes": notes},
          open(out + "/gpu_check.json", "w"), indent=1)
' "$TESTS_RC" "$BENCH_RC" "$DRY" "$OURS" $(($(date +%s) - started)) "$RC" "$OUT"
echo "gpu_check: tests rc=$TESTS_RC, benchmark rc=$BENCH_RC, $(($(date +%s) - started))s; files in $OUT:"
ls -l "$OUT"
exit "$RC"
