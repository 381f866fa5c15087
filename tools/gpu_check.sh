#!/usr/bin/env bash
# The CUDA path on a real GPU, in one prepared run of under 8 minutes, for a machine like:
# one H100/H200, 16 cores, Python 3.12 with a CUDA build of torch, pyarrow and numpy, but
# no DALI and no package registry. Run from anywhere:  bash tools/gpu_check.sh
#
#   1. builds fastload._C in place: `pip install --no-deps --no-build-isolation --no-index -e .`
#      when pybind11 is installed; else (setup.py imports pybind11, and pip cannot fetch it
#      offline) tools/build_ext_inplace.py compiles csrc/ against the pybind11 headers torch
#      ships, and the tree is used through PYTHONPATH;
#   2. `pytest -m cuda` outside tests/test_cuda_gpu.py (without DALI the image tests skip);
#   3. the fake-free CUDA delivery tests: tests/test_cuda_gpu.py (slow ones included);
#   4. `fastload doctor --device cuda` (without DALI its dali check fails: expected here);
#   5. bench/bench_tensor.py --device cuda: fastload's page-locked host-to-device rate against
#      torch's own pinned copy and a raw cudaMemcpyAsync on the same bytes.
# Writes one short table to stdout and to $OUT/gpu_check.md (or ./gpu_check.md), the full
# output to gpu_check.log beside it. Exit 0 on a machine without a GPU (it says so); else
# 1 if a step failed unexpectedly.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${OUT:-.}
LOG="$DEST/gpu_check.log"
TABLE="$DEST/gpu_check.md"
BUDGET=460  # seconds for all steps (the machine's start and the copy back come on top)
T0=$(date +%s)
ROWS=()
FAILED=0

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)' \
    >/dev/null 2>&1; then
  why=$("$PY" -c 'import torch; print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, "
                  f"torch.cuda.is_available() = {torch.cuda.is_available()}")' 2>&1 | tail -1)
  echo "gpu_check: no usable CUDA GPU here ($why): nothing to check; run this on a GPU machine"
  exit 0
fi
: >"$LOG"

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }

# step NAME MAX_SECONDS EXPECTED_NOTE CMD...: runs CMD under a time limit, logs its output,
# adds a row (name, pass/FAIL/timeout, seconds, the last summary line of its output).
step() {
  local name=$1 max=$2 note=$3; shift 3
  local budget; budget=$(left)
  if (( budget < 20 )); then
    ROWS+=("| $name | skipped | 0 | out of time (the run keeps under 8 minutes) |"); return 0
  fi
  (( max > budget )) && max=$budget
  local t=$(date +%s) rc out
  echo "===== $name: $*" >>"$LOG"
  out=$(timeout --kill-after=10 "$max" "$@" 2>&1); rc=$?
  printf '%s\n' "$out" >>"$LOG"
  local s=$(( $(date +%s) - t )) last
  last=$(printf '%s\n' "$out" | grep -E ' (passed|failed|skipped|error)|^[0-9]+ fail,|^built |killed|GB/s' | tail -1 \
         | tr '|' '/' | cut -c1-160)
  local status=pass
  if (( rc == 124 || rc == 137 )); then status="timeout (${max}s)"; FAILED=1
  elif (( rc != 0 )); then
    if [[ -n $note ]]; then status="fail: $note"; else status="FAIL (exit $rc)"; FAILED=1; fi
  fi
  ROWS+=("| $name | $status | $s | ${last:-} |")
  STEP_OUT=$out
  return $rc
}

GPU=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0), "x", torch.cuda.device_count())' 2>/dev/null)
TORCH=$("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null)
if "$PY" -c 'import nvidia.dali' >/dev/null 2>&1; then DALI=yes; else DALI=no; fi
# What this interpreter has of fastload's dependencies and the tests' (no registry to fetch them)
missing=()
for m in xxhash tqdm PIL pytest pytest_timeout pybind11 nvidia.dali; do
  "$PY" -c "import $m" >/dev/null 2>&1 || missing+=("$m")
done
ROWS+=("| modules missing | - | 0 | ${missing[*]:-none}$( [[ " ${missing[*]:-} " == *" xxhash "* ]] && echo ': fastload needs xxhash to write datasets, so the tests and bench that make one fail' ) |")
PYTEST=("$PY" -m pytest -q -p no:randomly -p no:cacheprovider)
# pyproject's addopts has --strict-config, which refuses its own `timeout` key without pytest-timeout
"$PY" -c 'import pytest_timeout' >/dev/null 2>&1 || PYTEST+=(-o "addopts=-ra")
HAVE_PYTEST=yes
"$PY" -c 'import pytest' >/dev/null 2>&1 || HAVE_PYTEST=no

# 1. the extension
built=no
if "$PY" -c 'import pybind11' >/dev/null 2>&1; then
  step "build: pip install -e . (no isolation, no index)" 240 "falling back to tools/build_ext_inplace.py" \
    "$PY" -m pip install --no-deps --no-build-isolation --no-index -e . --config-settings editable_mode=compat \
    && built=yes
else
  ROWS+=("| pybind11 | not installed | 0 | setup.py imports it and pip cannot fetch it offline: building with torch's pybind11 headers instead |")
fi
if [[ $built == no ]]; then
  step "build: tools/build_ext_inplace.py" 240 "" "$PY" tools/build_ext_inplace.py
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c 'import fastload._C' >>"$LOG" 2>&1; then
  ROWS+=("| import fastload._C | FAIL | 0 | no usable extension: the remaining steps cannot run |")
  FAILED=1
else
  # 2. the cuda-marked tests, the delivery tests apart
  if [[ $HAVE_PYTEST == yes ]]; then
    step "pytest -m cuda (but test_cuda_gpu.py)" 150 "" \
      "${PYTEST[@]}" -m cuda --ignore=tests/test_cuda_gpu.py -rs
    # 3. the fake-free delivery tests
    step "delivery tests (tests/test_cuda_gpu.py)" 200 "" "${PYTEST[@]}" tests/test_cuda_gpu.py -rs
  else
    ROWS+=("| pytest -m cuda, delivery tests | not run | 0 | pytest is not installed here |")
    FAILED=1
  fi
  # 4. the doctor
  note=""
  [[ $DALI == no ]] && note="expected: DALI is not installed"
  step "fastload doctor --device cuda" 60 "$note" "$PY" -m fastload doctor --device cuda
  if [[ $DALI == no ]] && printf '%s\n' "$STEP_OUT" | grep -E '^fail ' | grep -vqE '^fail +dali '; then
    ROWS[-1]="${ROWS[-1]/fail: expected: DALI is not installed/FAIL beyond DALI}"; FAILED=1
  fi
  # 5. the host-to-device rates
  step "bench_tensor.py --device cuda" 150 "" "$PY" bench/bench_tensor.py --device cuda --repeats 3
  H2D=$(printf '%s\n' "$STEP_OUT" | sed -n '/^## Host to device/,$p' | grep -E '^(Large|MNIST)')
fi

{
  echo "## tools/gpu_check.sh: $GPU; torch $TORCH; DALI: $DALI; $(nproc) cores; $(date -u +%FT%TZ)"
  echo
  echo "| step | result | s | summary |"
  echo "|---|---|---|---|"
  printf '%s\n' "${ROWS[@]}"
  if [[ -n ${H2D:-} ]]; then echo; echo "Host to device (GB/s):"; printf '%s\n' "$H2D"; fi
  echo
  echo "total $(( $(date +%s) - T0 )) s; full output: $LOG"
} | tee "$TABLE"
exit $FAILED
