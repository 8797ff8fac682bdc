#!/usr/bin/env bash
# The device check of issue 29: on one GPU (an H200: ~10 minutes), each step in its own process,
#   1. the tiny DeepSeek-V4.1 checkpoint's greedy tokens on CUDA (default and Triton kernels)
#      against the CPU's;
#   2. workload W on the embedded model: deepwell against transformers on the same GPU;
#   3. decode at batch 1 and 64 as a share of the GPU's memory bandwidth (embedded model);
#  3b. decode CUDA graphs: a padded step captured and replayed against eager (embedded model
#      and tiny V4.1), and greedy tokens with graphs against --enforce-eager;
#   4. the medium V4.1 checkpoint: its tokens on CUDA against the CPU's, and its decode.
# --cpu rehearses the same steps on this CPU at tiny sizes (Triton through its interpreter);
# --dry-run prints the commands only. No GPU has run it yet (docs/benchmarks.md).
#
#   benchmarks/gpu_check.sh [--cpu] [--dry-run] [--peak-gbps 4800] [--python .venv/bin/python]
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
MODE=cuda
DRY=0
PEAK=4800
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) MODE=cpu ;;
    --dry-run) DRY=1 ;;
    --peak-gbps) PEAK="$2"; shift ;;
    --python) PY="$2"; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
CHECK="$ROOT/benchmarks/gpu_check.py"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ "$MODE" = cpu ]; then
  # The same steps, sized for a CPU in a few minutes; Triton runs in its interpreter.
  export TRITON_INTERPRET=1
  DEVICE=cpu; TOKENS=4; W=(--requests 4 --scale 0.05 --hf-batch-sizes 4); DECODE=(--tokens 4)
  BATCHES=(1 4); MEDIUM=tiny; LIMIT=600
else
  DEVICE=cuda; TOKENS=16; W=(); DECODE=(--tokens 64); BATCHES=(1 64); MEDIUM=medium; LIMIT=240
fi

run() {  # one process, bounded in time; its JSON line on stdout. A failed step says so and
          # the check goes on: one broken measurement should not hide the others.
  echo "+ $*" >&2
  if [ "$DRY" = 1 ]; then echo '{}'; return; fi
  local status=0
  timeout "$LIMIT" "$PY" "$@" || status=$?
  if [ "$status" != 0 ]; then echo "{\"failed\": \"exit $status\"}"; fi
}

same_tokens() {  # label, then two JSON lines
  if [ "$DRY" = 1 ]; then return; fi
  if [ "$2" = "$3" ]; then echo "$1: identical greedy tokens"; else
    echo "$1: tokens DIFFER"; echo "  cpu:  $2"; echo "  other: $3"; fi
}

tokens_check() {  # checkpoint dir, label
  local cpu cuda triton
  cpu=$(run "$CHECK" tokens --model "$1" --device cpu --dtype float32 --max-tokens "$TOKENS")
  cuda=$(run "$CHECK" tokens --model "$1" --device "$DEVICE" --dtype float32 --max-tokens "$TOKENS")
  triton=$(run "$CHECK" tokens --model "$1" --device "$DEVICE" --dtype float32 \
    --kernels triton --max-tokens "$TOKENS")
  same_tokens "$2, $DEVICE (default kernels) vs cpu" "$cpu" "$cuda"
  same_tokens "$2, $DEVICE (--kernels triton) vs cpu" "$cpu" "$triton"
}

echo "== gpu_check ($MODE): $("$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")')"

echo "== 1. tiny DeepSeek-V4.1: greedy tokens"
run -m deepwell.cli tiny-checkpoint "$WORK/tiny" >/dev/null
tokens_check "$WORK/tiny" "tiny V4.1"

echo "== 2. workload W, embedded model"
run "$CHECK" w --engine deepwell --device "$DEVICE" "${W[@]}"
run "$CHECK" w --engine transformers --device "$DEVICE" "${W[@]}"

echo "== 3. decode, embedded model (bandwidth share of $PEAK GB/s)"
for batch in "${BATCHES[@]}"; do
  run "$CHECK" decode --device "$DEVICE" --batch "$batch" --peak-gbps "$PEAK" "${DECODE[@]}"
done

echo "== 3b. CUDA graphs for decode: capture and replay against eager, tokens against --enforce-eager"
run "$CHECK" graphs --device "$DEVICE" --batch 5 --max-tokens "$TOKENS" "${DECODE[@]}"
run "$CHECK" graphs --model "$WORK/tiny" --device "$DEVICE" --dtype float32 --batch 5 \
  --max-tokens "$TOKENS" "${DECODE[@]}"

echo "== 4. $MEDIUM DeepSeek-V4.1: greedy tokens and decode"
run -m deepwell.cli tiny-checkpoint "$WORK/$MEDIUM" --preset "$MEDIUM" >/dev/null
tokens_check "$WORK/$MEDIUM" "$MEDIUM V4.1"
for batch in "${BATCHES[@]}"; do
  run "$CHECK" decode --model "$WORK/$MEDIUM" --device "$DEVICE" --batch "$batch" \
    --peak-gbps "$PEAK" "${DECODE[@]}"
done
