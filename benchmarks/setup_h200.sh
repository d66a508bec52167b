# Set-up on the H200 (issues 15 and 16) in one device call of under 10 minutes, run from the repository root
# of a checkout on the device after `source benchmarks/device_setup.sh`:
#
#     bash benchmarks/setup_h200.sh
#
# 1. pretouch_memory.py: how much slower the machine's first touch of memory is (a lazily backed VM charges
#    a set-up that allocates new host memory, as ours does and flextensor's does not), and touches it once;
# 2. device_encoder_bench.py: the device encoder alone and beside packing (set-up's shape), to tell whether
#    compressing while packing (Runtime._set_up) wins over packing first;
# 3. peers.py at 17 frames, 2.8 GB: native, flextensor (its warm-up takes ~60 s: a long timeout), ours raw
#    and compressed, set-up figures of one run.
# Results go to $OUT; commit them under benchmarks/results/ with this file's commit.
set -u
out=${OUT:?set OUT to the folder results go to}
started=$(date +%s)
elapsed() { echo $(($(date +%s) - started)); }
timeout 120 python3 benchmarks/pretouch_memory.py --out "$out/pretouch_h200.json" > "$out/pretouch_h200.log" 2>&1
echo "pretouch $(elapsed) s: $(grep -E 'touch_gbps' "$out/pretouch_h200.log" | tr -d ' \n')"
timeout 120 python3 benchmarks/device_encoder_bench.py --units 12 --beside-units 20 \
  --out "$out/device_encoder_beside_h200.json" > "$out/device_encoder_beside_h200.log" 2>&1
echo "device encoder $(elapsed) s"
left=$((570 - $(elapsed)))
timeout "$left" python3 benchmarks/peers.py --workload 17f_480x272 --methods native flextensor \
  flextensor_diffusers flextensor_diffusers_lossless --budgets 2800000000 --flextensor-budget 2800000000 \
  --timeout 200 --deadline $((left - 15)) --out "$out/peers_setup_h200.json" > "$out/peers_setup_h200.log" 2>&1
echo "peers $(elapsed) s"
