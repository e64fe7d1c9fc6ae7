#!/usr/bin/env bash
# Everything the Triton kernels need a GPU for, on one CUDA machine (issue 18, part 2), in calls of under 10 minutes:
#
#   bash benchmarks/gpu_all.sh                          # call 1: tests and benchmarks
#   bash benchmarks/gpu_all.sh tests                    # the native kernel tests alone
#   bash benchmarks/gpu_all.sh tune fp8_block fp8_block_grouped   # call 2: the FP8 GEMMs' tile sweep
#   bash benchmarks/gpu_all.sh tune nvfp4 nvfp4_grouped           # call 3: the NVFP4 GEMMs' tile sweep
#
# Call 1 runs
#   1. every kernel test natively: tests/test_kernels_{quantize,gemm,grouped,compile}.py, their Triton launches
#      compiled for this GPU (benchmarks/native_kernel_tests.py), the same assertions as CI's interpreter runs
#   2. benchmarks/bench_gemm.py at M = 1, 16, 128, 2048, 8192 (Llama-3-8B, Qwen3-8B layers)
#   3. benchmarks/bench_grouped_gemm.py (Qwen3-Next-like experts: 512 top-10 and 128 top-8; 16..32768 tokens)
# and writes under $OUT (default benchmarks/results): env.txt (device, date, versions, commit, commands),
# kernel_tests.log, bench.log and each benchmark's .json/.md -- 7 files. `tune KERNEL...` runs
# benchmarks/tune_tiles.py for those kernels instead (every candidate tile of each shape class timed and checked;
# ~170 compiles for all four, ~6 min of compiling alone on a 2-core CPU, hence two calls):
# env_tune_KERNELS.txt, tune_KERNELS.log and its .json/.md. Needs python3 with torch and triton (tested against
# nothing yet: written for torch 2.11 / triton 3.6, no vLLM, no network); quantkit is put on PYTHONPATH from this
# checkout, not installed. Each step has a time limit (seconds, env overridable), TESTS_S + GEMM_S + GROUPED_S <= 560
# and TUNE_S 560, so a call ends inside 10 minutes; a step that runs out leaves what it wrote (the benchmarks rewrite
# their files after each shape or kernel class, marked incomplete) and the next one still runs.
#
#   OUT=/some/dir bash benchmarks/gpu_all.sh ...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-benchmarks/results}")
PY=${PYTHON:-python3}
TESTS_S=${TESTS_S:-190} GEMM_S=${GEMM_S:-170} GROUPED_S=${GROUPED_S:-200} TUNE_S=${TUNE_S:-560}
MODE=${1:-all}
[ "$#" -gt 0 ] && shift
case $MODE in
  all|tests) [ "$#" = 0 ] || { echo "gpu_all.sh: '$MODE' takes no arguments" >&2; exit 2; } ;;
  tune) [ "$#" -gt 0 ] || { echo "gpu_all.sh: tune needs kernel names (fp8_block nvfp4 fp8_block_grouped nvfp4_grouped)" >&2; exit 2; } ;;
  *) echo "gpu_all.sh: unknown mode '$MODE' (all, tests, or tune KERNEL...)" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
if [ "$MODE" = tune ]; then  # each tune call its own env and log files: calls with the same OUT keep theirs
  TAG=tune_$(IFS=-; echo "$*"); ENV=$OUT/env_$TAG.txt
else
  ENV=$OUT/env.txt
fi

# quantkit as pyproject.toml's package-dir maps it (quantkit.kernels = kernels/, ...), without pip: a tree of
# links on PYTHONPATH. pytest runs from inside it, since `python -m` puts the working directory first on
# sys.path and the checkout's own quantkit/ has no kernels/ (the scripts put their own folder first instead).
REPO=$PWD
SITE=$(mktemp -d)
mkdir "$SITE/quantkit"
for f in quantkit/*; do ln -s "$PWD/$f" "$SITE/quantkit/"; done
for d in kernels pipelines evals; do ln -s "$PWD/$d" "$SITE/quantkit/$d"; done
export PYTHONPATH="$SITE:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET

TESTS=("$REPO"/tests/test_kernels_{quantize,gemm,grouped,compile}.py)
TEST_CMD=("$PY" -m pytest --noconftest -p native_kernel_tests -p no:cacheprovider -q -n "${TEST_WORKERS:-8}" --tb=short -rfE
          "${TESTS[@]}")  # pytest-xdist: compiling the kernels is most of the time
GEMM_CMD=("$PY" benchmarks/bench_gemm.py --m 1 16 128 2048 8192 --out "$OUT")
GROUPED_CMD=("$PY" benchmarks/bench_grouped_gemm.py --out "$OUT")
TUNE_CMD=("$PY" benchmarks/tune_tiles.py --out "$OUT" --kernels "$@")

{
  echo "date (UTC): $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown) $(git status --porcelain 2>/dev/null | grep -q . && echo '(with local changes)')"
  echo "host: $(uname -srm), $(nproc) CPUs"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1
  "$PY" -c 'import sys, torch, triton; p = torch.cuda.get_device_properties(0); print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}; {p.name}: {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}")' 2>&1
  if [ "$MODE" = tune ]; then
    echo "step (time limit s): tune $TUNE_S"
    echo "tune:    ${TUNE_CMD[*]}"
  else
    echo "steps (time limit s): tests $TESTS_S, gemm $GEMM_S, grouped $GROUPED_S"
    echo "tests:   ${TEST_CMD[*]}"
    echo "gemm:    ${GEMM_CMD[*]}"
    echo "grouped: ${GROUPED_CMD[*]}"
  fi
} > "$ENV"
cat "$ENV"

step() {  # step NAME LIMIT LOG CMD...: run with a time limit, output to the terminal and LOG, record the status
  local name=$1 limit=$2 log=$3; shift 3
  local start=$SECONDS
  echo "== $name" | tee -a "$log"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "$name: exit $rc$([ "$rc" = 124 ] && echo ' (time limit)') after $((SECONDS - start)) s" | tee -a "$ENV"
}

if [ "$MODE" = tune ]; then
  step "tune_tiles" "$TUNE_S" "$OUT/$TAG.log" "${TUNE_CMD[@]}"
  rm -rf "$SITE"
  echo "== summary"
  tail -n 1 "$ENV"
  exit 0
fi
step "kernel tests (native)" "$TESTS_S" "$OUT/kernel_tests.log" env -C "$SITE" "${TEST_CMD[@]}"
if [ "$MODE" = tests ]; then
  rm -rf "$SITE"
  grep -h -E "passed|failed|error" "$OUT/kernel_tests.log" | tail -n 2
  exit 0
fi
step "bench_gemm" "$GEMM_S" "$OUT/bench.log" "${GEMM_CMD[@]}"
step "bench_grouped_gemm" "$GROUPED_S" "$OUT/bench.log" "${GROUPED_CMD[@]}"
rm -rf "$SITE"
echo "== summary"
tail -n 3 "$ENV"
grep -h -E "passed|failed|error" "$OUT/kernel_tests.log" | tail -n 2
