#!/usr/bin/env bash
# Issue 47's GPU proof on one H100/H200: benchmarks/quantized_bench.py, its JSON and log under $OUT.
#
# Wheels, once, here (not on the device), from the worktree root; the device lacks torchao as well as diffusers:
#   bash ../shared/device/fetch-wheels.sh torchao==0.18.0
# which adds torchao-0.18.0-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl (3.4 MB, no dependencies)
# to the base set. torchao 0.18.0 fits the device's torch 2.11: its __init__ loads its compiled (abi3) extensions
# from torch 2.11.0 on, which is its floor (0.17.0 declares the same one); 0.18.0 is also what the dev venv runs.
#
# Device call (carry [".whl"]; the device's copy of the tree has no usable .git, so name the commit):
#   CODE_COMMIT=<git rev-parse HEAD> bash benchmarks/quantized_gpu.sh [all|stack|card] [more bench arguments]
#   all (default): the stack rows, then the smallest card if no more than $CARD_START_S (default 240) s have
#                  passed                                                  -> $OUT/quantized_<card>.json, .log
#   stack:         the stack rows only ($ROWS, default bf16,int8,fp8)     -> $OUT/quantized_stack_<card>.json, .log
#   card:          the smallest card only                                 -> $OUT/quantized_card_<card>.json, .log
# The bench is stopped after $LIMIT_S (default 570) s, so that what it wrote comes back; it writes its JSON after
# every row.
set -uo pipefail
source benchmarks/device_setup.sh || exit 1
mode=${1:-all}
[ $# -gt 0 ] && shift
# The card in the files' names (h100, h200): timings compare only within one card.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h100|h200' | head -1 | tr '[:upper:]' '[:lower:]')
card=${card:-gpu}
case "$mode" in
  all) name=quantized_${card}; args=(--rows "${ROWS:-bf16,int8,fp8}" --time-limit "${CARD_START_S:-240}") ;;
  stack) name=quantized_stack_${card}; args=(--rows "${ROWS:-bf16,int8,fp8}" --skip-smallest-card) ;;
  card) name=quantized_card_${card}; args=(--rows "") ;;
  *) echo "unknown mode $mode: all, stack or card"; exit 2 ;;
esac
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee "$OUT/$name.log"
timeout "${LIMIT_S:-570}" python3 benchmarks/quantized_bench.py --out "$OUT/$name.json" "${args[@]}" "$@" 2>&1 \
  | tee -a "$OUT/$name.log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/$name.log"
