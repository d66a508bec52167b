#!/usr/bin/env bash
# One device call of GPU proof: the GPU tests and the chosen benchmarks, each bounded, logs and JSON under $OUT.
# Usage on the device (carry .whl): bash benchmarks/gpu_proof.sh STEP... where STEP is one of
#   tests        python3 -m pytest -q -m gpu tests (or $TESTS) -> $OUT/gpu_tests_<card>.log
#   tests_reverse  the same, test files in reverse order (--order reverse): no test may need another's leftovers
#                                                             -> $OUT/gpu_tests_reverse_<card>.log
#   quantized    quantized_bench.py: the 40-block stack at 17 frames under 2.8 GB, bf16/int8/fp8 ($QUANT_ROWS) against
#                native, each bitwise; then the full pipeline with int8 transformers on an emulated 5 GB card unless
#                $QUANT_CARD is 0; $FFN_CHUNKS as below       -> $OUT/quantized_<card>.json, .log
#   quantized_card  only that smallest card, weights $CARD_WEIGHTS (int8, fp8: layerwise casting), each block's
#                feed-forward in $FFN_CHUNKS chunks when set (chunk_feed_forward; the native reference alike); where
#                it completes, the same generation natively, frames compared bitwise; where it fails, its floor
#                measured under a $FLOOR_CAP-byte card          -> $OUT/quantized_card_<card>.json, .log
#   engine17     engine_bench.py, 17 frames, 3 budgets        -> $OUT/engine17_<card>.json, .log
#   engine81     engine_bench.py, 81 frames with CFG, 3 budgets, native in the same run -> $OUT/engine81_<card>.json, .log
#   engine       engine_bench.py, 81 and 17 frames, 3 budgets -> $OUT/engine_<card>.json, .log
#   compile17    compile_bench.py, 17 frames                  -> $OUT/compile17_<card>.json, .log
#   tiers        tiers_bench.py on the full Wan2.2 pipeline, configurations $TIERS_CONFIGS (default: the reference
#                and the compressed 32 GiB tier, which verifies every load: issue 25's reproduction), no set-up
#                block, the package's log lines timestamped; $TIERS_STEPS: the measured generation's steps (default 4),
#                $TIERS_WARMUP_STEPS the warm-up's (default as many as the measured one's, so that its first switch
#                follows a generation as long as itself, as in back-to-back generations of one length)
#                                                             -> $OUT/tiers_<card>.json, .log
#   setup        tiers_bench.py's set-up block on the 40-block stack: raw, FlexTensor, compressed first (the default:
#                encoded between forwards), from the payload file, and encoded before set-up returns
#                (compressed_first_at_setup), each started only with $PHASE_MIN_S (default 50) s of the
#                limit left; $SETUP_RUNS: a comma list of them; $SETUP_REPEATS: raw and the cached set-up that many
#                more times, in turns, each repeat set-up and the first forward only (each figure then the median)
#                                                             -> $OUT/tiers_setup_<card>.json, .log
#   time_to_video  time_to_video.py: the full Wan2.2-T2V-A14B pipeline built once, then each of $TTV_CONFIGS (default
#                native,ram,host32_compressed,host24_compressed,flextensor; NAME:first for no later run) from its
#                set-up to its mp4, phase by phase, $TTV_STEPS steps (default 40), no run started that cannot finish;
#                $TTV_WORKDIR kept for a later call's NAME:later (a warm machine keeps /tmp), $TTV_REFERENCE: an
#                earlier call's JSON whose native frames' digest every row is compared with
#                                                             -> $OUT/time_to_video_<card>.json, .log
#   ltx2_peaks80, ltx2_peaks40  max_length.py: the offloaded LTX-2 maximum's one trial at 80 GB (2,473 frames) or 40 GB
#                (1,185 frames), 1 step, its peak model from ltx2_max_length_h200.json: the peak from the true maximum
#                since enable (issue 46; those trials ran before the peak fold)
#                                                             -> $OUT/ltx2_peaks_<cap>_<card>.json, .log
# Each step runs under its own time limit (seconds, env STEP_LIMIT_S, default 420; the tests' own TESTS_LIMIT_S
# when set) so that one hung step cannot take the whole call; the code's commit is written to $OUT/code.txt.
set -uo pipefail
source benchmarks/device_setup.sh || exit 1
limit=${STEP_LIMIT_S:-420}
# The card in the files' names (h100, h200): a call may get either, and timings compare only within one card.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h100|h200|a100|l40s?' | head -1 | tr '[:upper:]' '[:lower:]')
card=${card:-gpu}
echo "${CODE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo "no git")}" >"$OUT/code.txt"  # the device's git may be stale
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv >>"$OUT/code.txt"
for step in "$@"; do
  start=$(date +%s)
  case "$step" in
    tests) timeout "${TESTS_LIMIT_S:-$limit}" python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf ${TESTS:-tests} \
        >"$OUT/gpu_tests_${card}.log" 2>&1 ;;
    tests_reverse) timeout "${TESTS_LIMIT_S:-$limit}" python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf \
        --order reverse ${TESTS:-tests} >"$OUT/gpu_tests_reverse_${card}.log" 2>&1 ;;
    quantized) timeout "$limit" python3 benchmarks/quantized_bench.py --rows "${QUANT_ROWS:-bf16,int8,fp8}" \
        $([ "${QUANT_CARD:-1}" = 0 ] && echo --skip-smallest-card) --time-limit "${QUANT_TIME_LIMIT_S:-$((limit - 200))}" \
        ${FFN_CHUNKS:+--ffn-chunks "$FFN_CHUNKS"} \
        --out "$OUT/quantized_${card}.json" >"$OUT/quantized_${card}.log" 2>&1 ;;
    quantized_card) timeout "$limit" python3 benchmarks/quantized_bench.py --rows "" \
        --card-weights "${CARD_WEIGHTS:-int8}" ${FLOOR_CAP:+--floor-cap "$FLOOR_CAP"} ${FFN_CHUNKS:+--ffn-chunks "$FFN_CHUNKS"} \
        --out "$OUT/quantized_card_${card}.json" >"$OUT/quantized_card_${card}.log" 2>&1 ;;
    engine17) timeout "$limit" python3 benchmarks/engine_bench.py --workloads 17f_480x272 --budgets 3 --reps 3 \
        --out "$OUT/engine17_${card}.json" >"$OUT/engine17_${card}.log" 2>&1 ;;
    engine81) timeout "$limit" python3 benchmarks/engine_bench.py --workloads 81f_832x480_cfg --budgets 3 --reps 2 \
        --out "$OUT/engine81_${card}.json" >"$OUT/engine81_${card}.log" 2>&1 ;;
    engine) timeout "$limit" python3 benchmarks/engine_bench.py --budgets 3 --reps 2 \
        --out "$OUT/engine_${card}.json" >"$OUT/engine_${card}.log" 2>&1 ;;
    compile17) timeout "$limit" python3 benchmarks/compile_bench.py --workloads 17f_480x272 \
        --out "$OUT/compile17_${card}.json" >"$OUT/compile17_${card}.log" 2>&1 ;;
    tiers) TIERS_BENCH_LOG=INFO timeout "$limit" python3 benchmarks/tiers_bench.py --no-setup \
        --configs "${TIERS_CONFIGS:-ram_raw,host32_compressed}" ${TIERS_STEPS:+--steps "$TIERS_STEPS"} \
        ${TIERS_WARMUP_STEPS:+--warmup-steps "$TIERS_WARMUP_STEPS"} --time-limit $((limit - 15)) \
        --out "$OUT/tiers_${card}.json" >"$OUT/tiers_${card}.log" 2>&1 ;;
    setup) timeout "$limit" python3 benchmarks/tiers_bench.py --setup-only --phase-min-s "${PHASE_MIN_S:-50}" \
        ${SETUP_RUNS:+--setup-runs "$SETUP_RUNS"} --setup-repeats "${SETUP_REPEATS:-0}" --time-limit $((limit - 15)) --out "$OUT/tiers_setup_${card}.json" >"$OUT/tiers_setup_${card}.log" 2>&1 ;;
    time_to_video) timeout "$limit" python3 benchmarks/time_to_video.py \
        --configs "${TTV_CONFIGS:-native,ram,host32_compressed,host24_compressed,flextensor}" --steps "${TTV_STEPS:-40}" \
        ${TTV_REFERENCE:+--reference "$TTV_REFERENCE"} ${TTV_WORKDIR:+--workdir "$TTV_WORKDIR" --keep-workdir} \
        --time-limit $((limit - 30)) --out "$OUT/time_to_video_${card}.json" >"$OUT/time_to_video_${card}.log" 2>&1 ;;
    ltx2_peaks80|ltx2_peaks40) cap=${step#ltx2_peaks}GB; frames=$([ "$cap" = 40GB ] && echo 1185 || echo 2473)
      timeout "$limit" python3 benchmarks/max_length.py --modes offload --steps 1 --profiling-steps 0 --no-quality \
        --fit-from benchmarks/results/ltx2_max_length_h200.json --x264-preset ultrafast --video-dir /tmp/ltx2_videos \
        --deadline $((limit - 60)) --caps "$cap" --offload-start-frames "$frames" --max-frames "$frames" \
        --out "$OUT/ltx2_peaks_${cap}_${card}.json" >"$OUT/ltx2_peaks_${cap}_${card}.log" 2>&1
      rm -rf /tmp/ltx2_videos ;;
    *) echo "unknown step $step" ;;
  esac
  echo "step $step: exit $? after $(($(date +%s) - start)) s" | tee -a "$OUT/code.txt"
done
