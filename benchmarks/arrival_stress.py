"""Stress the set-up that does not wait for its payloads (`StoragePlan.may_read_payloads_later`, and with
``--background-encoding`` the one that encodes while the model runs) on the CPU: random timings and faults around
the payloads' arrival, looking for an output that is not bitwise equal to native.

Every round offloads the same block stack (`tests.models.Stack`, bf16) with compression and its payload file, and
runs a few forwards, each compared bitwise with the native model's (the same edits made to both). A round's
scenario is drawn from its seed: ``clean`` (the payloads arrive, read from the file or, with
``--background-encoding`` and no file, encoded between forwards; are proven at their first decoded load, then
decoded by planned loads), ``edit`` (a block is edited at a random forward, while the payloads arrive or after),
``stale`` (a weight changed where the file's key does not sample it: found at the first decoded load, the file
deleted), ``damaged`` (a payload byte flipped on disk: its checksum refuses the file), ``remove`` (the handle
removed at a random forward, while the payloads may still arrive). Random sleeps are put into each payload's read
or encoding and between forwards. Plans come from fixed, compute-bound figures (`tests.test_compression`), so
loads decode on any machine. After removal every tensor must equal the native model's. ``--unproven`` is the
positive control: it takes every payload for proven without comparing it, so the stale rounds must fail.

    python benchmarks/arrival_stress.py --rounds 200 --seed 1 --out /tmp/arrival_stress.json
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' helpers
import flextensor_diffusers as ft
from flextensor_diffusers.storage import arrivals, device_copies
from tests.models import Stack
from tests.test_compression import planned_from_fixed_figures
from tests.test_payload_arrival import offload_cached

SCENARIOS = ("clean", "edit", "stale", "damaged", "remove")


def make() -> tuple[Stack, torch.Tensor]:
    """The same stack and input every round (so the payload file's key matches from round to round)."""
    torch.manual_seed(0)
    model = Stack(dim=256, depth=5, dtype=torch.bfloat16).eval().requires_grad_(False)
    return model, torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))


def flip_a_payload_byte(folder: Path, rng: random.Random) -> bool:
    files = list(folder.glob("*.payloads"))
    if not files:
        return False
    path = files[0]
    with path.open("r+b") as f:
        f.seek(rng.randrange(path.stat().st_size // 2, path.stat().st_size))
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    return True


def edit(model: Stack, handle: ft.OffloadHandle | None, block: int) -> None:
    """Halve one block's first feed-forward weight (through ``editing()`` when offloaded)."""
    weight = model.blocks[block].ff[0].weight
    if handle is None:
        with torch.no_grad():
            weight.mul_(0.5)
        return
    with handle.editing(), torch.no_grad():
        weight.mul_(0.5)


def one_round(seed: int, folder: Path, most_sleep: float, background: bool) -> dict[str, Any]:
    rng = random.Random(seed)
    scenario = rng.choice(SCENARIOS)
    model, x = make()
    native, _ = make()
    if scenario == "stale":  # both changed where the key does not sample: the file's payloads are stale
        for m in (model, native):
            weight = max(m.blocks[0].parameters(), key=lambda p: p.numel())
            with torch.no_grad():
                weight.view(-1)[weight.numel() // 3] += 1
    damaged = scenario == "damaged" and flip_a_payload_byte(folder, rng)
    had_file = bool(list(folder.glob("*.payloads")))
    forwards = rng.randrange(3, 14)
    at = rng.randrange(0, forwards)  # the forward before which an edit or the removal comes
    handle = offload_cached(model, folder, background_encoding=background)
    arriving_at_set_up = handle.host.compressed.arriving
    failures: list[str] = []
    proven_decodes = False
    removed = False
    for step in range(forwards):
        if step == at and scenario == "edit":
            block = rng.randrange(len(model.blocks))
            edit(model, handle, block)
            edit(native, None, block)
        if step == at and scenario == "remove":
            handle.remove()
            removed = True
        with torch.inference_mode():
            out, ref = model(x), native(x)
        if not torch.equal(out, ref):
            failures.append(f"forward {step}: not bitwise")
        if not removed and handle.plan is not None and handle.device_copies.decoding:
            proven_decodes = True
        time.sleep(rng.uniform(0, most_sleep))
    if not removed:
        handle.remove()
    for (name, a), (_, b) in zip(model.state_dict().items(), native.state_dict().items(), strict=True):
        if not torch.equal(a, b):
            failures.append(f"after removal: {name} differs")
    return {
        "seed": seed,
        "scenario": scenario,
        "encoded_in_background": background and not had_file,
        "had_file": had_file,
        "damaged": damaged,
        "arriving_at_set_up": arriving_at_set_up,
        "forwards": forwards,
        "decoded": proven_decodes,
        "failures": failures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--read-sleep", type=float, default=0.02, help="most seconds slept in each payload read")
    parser.add_argument("--forward-sleep", type=float, default=0.01, help="most seconds slept between forwards")
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--unproven", action="store_true", help="positive control: payloads proven unchecked")
    parser.add_argument(
        "--background-encoding", action="store_true", help="a round with no payload file encodes while it runs"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    patch = pytest.MonkeyPatch()
    planned_from_fixed_figures(patch, compute_ms=10.0)
    sleeps = random.Random(args.seed)
    real_read = arrivals.PayloadArrival._read
    real_encode = arrivals.EncodingBetweenForwards._on_host

    def slow_read(self: Any, index: int) -> Any:
        time.sleep(sleeps.uniform(0, args.read_sleep))
        return real_read(self, index)

    def slow_encode(batch: Any) -> Any:
        time.sleep(sleeps.uniform(0, args.read_sleep) * len(batch))
        return real_encode(batch)

    patch.setattr(arrivals.PayloadArrival, "_read", slow_read)
    patch.setattr(arrivals.EncodingBetweenForwards, "_on_host", staticmethod(slow_encode))
    if args.unproven:
        patch.setattr(device_copies.DeviceCopies, "prove", lambda self, index, slot: self.host.compressed.prove(index))
    folder = Path(tempfile.mkdtemp(prefix="arrival_stress_"))
    start = time.perf_counter()
    rounds = []
    for n in range(args.rounds):
        if time.perf_counter() - start > args.max_seconds:
            break
        rounds.append(one_round(args.seed * 100_000 + n, folder, args.forward_sleep, args.background_encoding))
        if rounds[-1]["failures"]:
            print(f"round {n} ({rounds[-1]['scenario']}): {rounds[-1]['failures']}")
    failed = [r for r in rounds if r["failures"]]
    by_scenario = collections.Counter(r["scenario"] for r in rounds)
    summary = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "rounds": len(rounds),
        "failed": len(failed),
        "by_scenario": dict(by_scenario),
        "arriving_at_set_up": sum(r["arriving_at_set_up"] for r in rounds),
        "encoded_in_background": sum(r["encoded_in_background"] for r in rounds),
        "decoded": sum(r["decoded"] for r in rounds),
        "wall_s": round(time.perf_counter() - start, 1),
        "failures": failed,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}))
    args.out.write_text(json.dumps({**summary, "rounds_detail": rounds}, indent=1))
    patch.undo()


if __name__ == "__main__":
    main()
