"""How ``tiers_h200.json`` (fourteenth session) was made from two files of one H200 machine, code e0e043c.

Call AA (``tiers_callAA_h200.json``) holds the four pipeline configurations (``ram_raw`` and ``host32_compressed``
resumed from call Z) and the set-up block's raw and FlexTensor runs; call Y (``tiers_setup_callY_h200.json``) the
set-up runs in turns: raw and from the payload file four times each, and the first compressed run. The merged set-up
block takes call Y's runs for the raw and cached medians, and call AA's FlexTensor run; call AA's raw run is kept as
``raw_in_call_AA``, out of the raw median (another call, after the pipeline runs), and gives
``raw_vs_flextensor_in_call_AA``. The figures are recomputed by `tiers_bench.setup_summary`, as a call would.

Usage (no GPU): ``python benchmarks/results/tiers_h200_merge.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench_common import StackShape  # noqa: E402
from tiers_bench import setup_summary  # noqa: E402


def main() -> None:
    merged = json.loads((HERE / "tiers_callAA_h200.json").read_text())
    call_y = json.loads((HERE / "tiers_setup_callY_h200.json").read_text())
    runs = dict(call_y["setup"]["runs"])
    for name, record in merged["setup"]["runs"].items():
        new = "raw_in_call_AA" if name == "raw" else name
        runs[new] = {**record, "run": new}
    setup = {"runs": runs, "page_cache_drop": merged["setup"].get("page_cache_drop")}
    shape = StackShape(**{key: call_y["config"][key] for key in ("blocks", "dim", "heads", "ffn", "small")})
    setup_summary(setup, argparse.Namespace(stack=shape, setup_budget_bytes=call_y["config"]["setup_budget_bytes"]))
    setup["raw_vs_flextensor_in_call_AA"] = round(runs["raw_in_call_AA"]["setup_s"] / runs["flextensor"]["setup_s"], 3)
    setup["merged_from"] = (
        "runs raw..compressed_cached#4 (the raw and cached medians): tiers_setup_callY_h200.json; flextensor and "
        "raw_in_call_AA (the raw run beside it, kept out of the raw median; raw_vs_flextensor_in_call_AA): "
        "tiers_callAA_h200.json; both on one H200 machine, code e0e043c, calls Y and AA of the fourteenth session"
    )
    merged["setup"] = setup
    (HERE / "tiers_h200.json").write_text(json.dumps(merged, indent=1))
    summary = {key: value for key, value in setup.items() if key.endswith(("_s", "_raw", "_flextensor", "_AA"))}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
