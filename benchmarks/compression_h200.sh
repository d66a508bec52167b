# Issue 16's GPU proof in two device calls of under 10 minutes each (the device tool's limit), run from the
# repository root of a checkout on the device, after `source benchmarks/device_setup.sh`:
#
#     bash benchmarks/compression_h200.sh 1    # GPU tests, codec_bench, 17 frames at 2.8 GB (every method)
#     bash benchmarks/compression_h200.sh 2    # 17 frames at 15.06 GB, 81 frames at 9.23 GB
#
# Results go to $OUT (the device tool's folder). Then, here, with both calls' files copied into
# benchmarks/results/: python3 benchmarks/compression_summary.py benchmarks/results/peers_compression_*_h200.json
# 2.8 GB is about the least budget at which the 40-block Wan2.2-A14B stack stages compressed loads (two slots
# of 703 MB with 492 MB of staging each, and the activations at 17 frames); flextensor runs at the same one.
set -u
out=${OUT:?set OUT to the folder results go to}
started=$(date +%s)
elapsed() { echo $(($(date +%s) - started)); }

if [ "${1:-}" = 1 ]; then
  timeout 90 python3 -m pytest -q -m gpu tests/test_compression.py tests/test_codec.py tests/test_host_memory.py \
    > "$out/gpu_tests_compression_h200.log" 2>&1
  echo "tests $(elapsed) s: $(tail -1 "$out/gpu_tests_compression_h200.log")"
  timeout 90 python3 benchmarks/codec_bench.py --iters 10 --encode-reps 2 --out "$out/codec_h200.json" \
    > "$out/codec_h200.log" 2>&1
  echo "codec $(elapsed) s"
  left=$((570 - $(elapsed)))
  timeout "$left" python3 benchmarks/peers.py --workload 17f_480x272 --methods native flextensor \
    flextensor_diffusers flextensor_diffusers_lossless flextensor_diffusers_lossless_disk \
    flextensor_diffusers_lossless_cached flextensor_diffusers_lossless_cached --budgets 2800000000 \
    --flextensor-budget 2800000000 --timeout 150 --deadline $((left - 60)) \
    --out "$out/peers_compression_17f_h200.json" > "$out/peers_compression_17f_h200.log" 2>&1
  echo "peers 17f $(elapsed) s"
elif [ "${1:-}" = 2 ]; then
  timeout 200 python3 benchmarks/peers.py --workload 17f_480x272 --methods native flextensor_diffusers \
    flextensor_diffusers_lossless --budgets 15062659584 --timeout 100 --deadline 150 \
    --out "$out/peers_compression_17f_middle_h200.json" > "$out/peers_compression_17f_middle_h200.log" 2>&1
  echo "peers 17f middle $(elapsed) s"
  left=$((570 - $(elapsed)))
  timeout "$left" python3 benchmarks/peers.py --workload 81f_832x480_cfg --methods native flextensor_diffusers \
    flextensor_diffusers_lossless --budgets 9234179686 --timeout 200 --deadline $((left - 90)) \
    --out "$out/peers_compression_81f_h200.json" > "$out/peers_compression_81f_h200.log" 2>&1
  echo "peers 81f $(elapsed) s"
else
  echo "usage: bash benchmarks/compression_h200.sh 1|2" >&2
  exit 2
fi
