#!/usr/bin/env bash
# One prepared check of accumopt on a machine with one NVIDIA GPU and no network.
# Run from the repository root: bash bench/gpu/run.sh   (accumopt is imported from the
# checkout through PYTHONPATH; nothing is installed). Prints the versions and the GPU, runs the
# whole test suite (the CUDA tests run here; the rest checks this machine's torch version) when
# pytest and hypothesis are importable, then bench/gpu/check.py, whose table comes last.
# Everything is logged to $OUT/gpu_check.log ($OUT if set, else a temp dir), with check.py's
# results in $OUT/check.json. Time guards: 240 s for the tests, 280 s for check.py.
# Exit status: check.py's (0: every check passed), or 124 when it timed out. Arguments go to
# check.py (bash bench/gpu/run.sh --dry-run runs the whole script on a machine without a GPU).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-$(mktemp -d -t accumopt-gpu-XXXXXX)}"
mkdir -p "$out"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
py="$(command -v python || command -v python3)" || { echo "no python on PATH"; exit 2; }

main() {
  echo "== versions"
  "$py" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
ok = torch.cuda.is_available()
print("GPU:", torch.cuda.get_device_name(0) if ok else "none visible to torch",
      f"| {torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB" if ok else "")
EOF
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    || echo "nvidia-smi failed"

  echo "== tests (python -m pytest -q -rs: the whole suite, CUDA tests included)"
  local tests
  if "$py" -c 'import pytest, hypothesis' 2>/dev/null; then
    timeout 240 "$py" -m pytest -q -rs
    local rc=$?
    case $rc in
      0) tests="passed" ;;
      124) tests="failed (timed out after 240 s)" ;;
      *) tests="failed (pytest exit $rc)" ;;
    esac
  else
    tests="skipped (pytest or hypothesis not importable)"
  fi
  echo "tests: $tests"

  echo "== bench/gpu/check.py"
  timeout 280 "$py" bench/gpu/check.py --out "$out" --tests "$tests" "$@"
  local rc=$?
  [ "$rc" -eq 124 ] && echo "check.py timed out after 280 s"
  return "$rc"
}

main "$@" 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
