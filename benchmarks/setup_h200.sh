# The next device call (issues 15 and 16), under 10 minutes, run from the repository root of a checkout on the
# device after `source benchmarks/device_setup.sh`:
#
#     bash benchmarks/setup_h200.sh
#
# 1. the GPU tests: among them, since the last GPU run, forwards interrupted inside a block on CUDA;
# 2. setup_profile.py: whether freeing each weight's original as it is packed is what makes the package's
#    packing slower than setup_bench.py's (raw against "raw, sources kept", twice each, in one process);
# 3. host_tier_bench.py: the full Wan2.2 pipeline under a 32 GiB host budget, with the tier's own forecast of
#    each switch (`switch_forecast`) next to what the switch exposed (`switch_exposed_s`).
# Results go to $OUT; commit them under benchmarks/results/ with this file's commit.
set -u
out=${OUT:?set OUT to the folder results go to}
started=$(date +%s)
elapsed() { echo $(($(date +%s) - started)); }
timeout 100 python3 -m pytest -q -m gpu tests/ > "$out/gpu_tests_h200.log" 2>&1
echo "tests $(elapsed) s: $(tail -1 "$out/gpu_tests_h200.log")"
timeout 100 python3 benchmarks/setup_profile.py --variants raw "raw, sources kept" raw "raw, sources kept" \
  --out "$out/setup_profile_sources_h200.json" > "$out/setup_profile_sources_h200.log" 2>&1
echo "setup profile $(elapsed) s"
left=$((570 - $(elapsed)))
timeout "$left" python3 benchmarks/host_tier_bench.py --out "$out/host_tier_h200.json" \
  --peers-json benchmarks/results/peers_pretouched_17f_h200.json --time-limit $((left - 10)) \
  > "$out/host_tier_h200.log" 2>&1
echo "host tier $(elapsed) s"
