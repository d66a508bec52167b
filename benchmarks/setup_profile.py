"""Where compressed set-up's time goes on the block stack `peers.py` measures, and what changes it.

``peers_pretouched_17f_h200.json`` (c164c25): compressed set-up 7.07 s against 2.34 s raw (the issue asks
for at most 2x), ``compress`` 6.97 s, while the device encoder alone takes 88.6 ms a unit
(``device_encoder_beside_h200.json``: 3.5 s for 40 units) and beside packing (copies and page-locking on
set-up's threads) 136 ms a unit. This runs the package's own set-up (``ft.offload`` with
``compression="lossless"``) on the same model, built as `peers.py` builds it, once per variant:

* ``raw``: no compression (the reference the target divides by);
* ``as is``: units compressed as they are packed (``Runtime._set_up``);
* ``after packing``: packing finished before the encoder starts (no packing thread copies or page-locks
  while the encoder's main thread issues its ~1200 CUDA calls a unit);
* ``switch 0.1 ms``: as is, with Python's thread switch interval at 0.1 ms instead of 5 ms (the encoder's
  main thread waits for the GIL behind the packing and payload threads after each CUDA call);
* ``raw, sources kept``: no compression, and each weight's original storage is kept alive until set-up has
  returned (freed outside the timing). Packing frees each original as it is copied, and returning ~28 GB of
  4 KiB pages to the system (``munmap``, under the process's memory-map lock, which the other threads' page
  faults on their new buffers also need) may be what makes the package's packing 2.3-2.8 s where
  ``setup_bench.py`` copies and locks the same bytes, sources kept, in 1.24 s.

Per variant: wall time, ``setup_ms``, and the encoder's main-thread calls (`DeviceEncoder._encode`, the
next unit's upload, which waits while that unit is packed, the staging copy) summed over units.

    python benchmarks/setup_profile.py --out $OUT/setup_profile_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_bench as eb
from codec_bench import save
from device_encoder_bench import time_the_encoder

import flextensor_diffusers as ft
from flextensor_diffusers.engine import residency as residency_module
from flextensor_diffusers.engine.residency import Residency

VARIANTS = ("raw", "as is", "after packing", "switch 0.1 ms", "raw, sources kept")
#: "as is" again last: a variant that gains only by running later (memory touched before) shows up.
DEFAULT = [*VARIANTS, "as is"]


@contextlib.contextmanager
def packing_first() -> Iterator[None]:
    """`Residency.start_packing` returns only once every unit is packed (the encoder then has the machine)."""
    original = Residency.start_packing

    def start_packing(self: Residency, *args: object, **kwargs: object) -> object:
        packing = original(self, *args, **kwargs)
        seconds = packing.finish()
        packing.finish = lambda: seconds  # type: ignore[method-assign]
        return packing

    Residency.start_packing = start_packing  # type: ignore[method-assign]
    try:
        yield
    finally:
        Residency.start_packing = original  # type: ignore[method-assign]


@contextlib.contextmanager
def sources_kept(kept: list[torch.Tensor]) -> Iterator[None]:
    """Packing appends each tensor's original data to ``kept`` before it is replaced by its view."""
    original = residency_module.pack_unit

    def pack_unit(unit: object, *args: object, **kwargs: object) -> None:
        kept.extend(packed.tensor.data for packed in unit.tensors)  # type: ignore[attr-defined]
        original(unit, *args, **kwargs)

    residency_module.pack_unit = pack_unit
    try:
        yield
    finally:
        residency_module.pack_unit = original


@contextlib.contextmanager
def switch_interval(seconds: float) -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def run(model: torch.nn.Module, variant: str, budget: int, device: str) -> dict:
    spent: dict[str, float] = defaultdict(float)
    undo = time_the_encoder(spent)
    kept: list[torch.Tensor] = []
    scope = {
        "after packing": packing_first,
        "switch 0.1 ms": lambda: switch_interval(1e-4),
        "raw, sources kept": lambda: sources_kept(kept),
    }.get(variant, contextlib.nullcontext)
    config = ft.OffloadConfig(
        include_patterns=["blocks.*"],
        gpu_budget=budget,
        device=device,
        compression="none" if variant.startswith("raw") else "lossless",
    )
    try:
        with scope():
            start = time.perf_counter()
            handle = ft.offload(model, config)
            seconds = time.perf_counter() - start
    finally:
        for fn in undo:
            fn()
    kept.clear()
    row = {
        "variant": variant,
        "setup_s": round(seconds, 3),
        "setup_ms": handle.stats().setup_ms,
        "encoder_ms": {k: round(v, 1) for k, v in spent.items()},
    }
    handle.remove()
    gc.collect()
    print(f"{variant:>14}: {row['setup_s']:.3f} s {row['setup_ms']} {row['encoder_ms']}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--dim", type=int, default=5120)
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--ffn", type=int, default=13824)
    parser.add_argument("--budget", type=int, default=2_800_000_000)
    parser.add_argument("--variants", nargs="+", default=DEFAULT, choices=VARIANTS)
    parser.add_argument("--device", default="cuda", help="cpu: a quick check of this script (no device encoder)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = eb.build(args, torch.device(args.device)).to("cpu")  # as `peers.py` builds it
    if args.device == "cuda":
        torch.cuda.empty_cache()
    result: dict = {"command": " ".join(sys.argv), "torch": torch.__version__, "blocks": args.blocks, "runs": []}
    for variant in args.variants:
        result["runs"].append(run(model, variant, args.budget, args.device))
        if args.out:  # after each variant, so that a cut-off run keeps what it has
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    save(result, args.out)


if __name__ == "__main__":
    main()
