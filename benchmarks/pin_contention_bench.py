"""Does page-locking on a side thread slow the GPU work the main thread issues meanwhile?

The compressed host tier page-locks each payload it reads (``cudaHostRegister``, ~17 ms for a 488 MB Wan2.2-A14B
block payload on the H200: ``host_pin_h200.json``) and, during an expert's last forward, unlocks each one it hands
over (``cudaHostUnregister``, ~9 ms), on threads beside the forwards. On an H100 (call M) the steps that did both ran
9.4 % slower than the all-in-RAM reference's with the engine waiting on no copy (14 ms of stalls in 4 forwards);
on the H200 (call K), whose steps only read ahead, 1.3 %. If those driver calls hold the main thread's kernel
launches back, the GPU idles whenever its queue drains: this measures that, apart from any model.

The main thread runs the same stream of work in every pattern: ``--units`` rounds of a matmul chain on the
default stream, each with an H2D copy of a page-locked buffer on a side stream that the next round waits for (as
a streamed unit's load), timed end to end with the device synchronised; once with the thread at most
``--ahead`` rounds ahead of the device (a thread that keeps little queued: whatever holds it back idles the
device), once with no bound (a deep queue hides short holds). A side thread meanwhile does, per
pattern: nothing (``idle``); copy one unit-sized buffer into another, as much memory traffic as a read and no
driver call (``host_copy``, the control); lock then unlock unit-sized buffers in turns (``lock_unlock``); and the
same in pieces of ``--piece-bytes`` (``lock_unlock_pieces``: each driver call shorter). Each pattern runs
``--repeats`` times; the side thread stops when the main loop does. Prints and saves per pattern the median wall
time, its ratio to ``idle`` and how many driver calls the side thread made.

Usage (GPU machine): ``python3 benchmarks/pin_contention_bench.py --out $OUT/pin_contention_<card>.json``
(~1 min).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from flextensor_diffusers.engine.host_memory import host_buffer, pin_in_place, unpin_in_place

PATTERNS = ("idle", "host_copy", "lock_unlock", "lock_unlock_pieces")


@dataclass(frozen=True)
class PatternResult:
    """One side-thread pattern with the main thread at most ``ahead`` rounds ahead of the device: the main loop's
    wall times (s), their median over ``idle``'s at the same ``ahead``, and the side thread's driver calls over all
    repeats."""

    pattern: str
    ahead: int
    loop_s: list[float]
    median_s: float
    vs_idle: float | None
    driver_calls: int


class SideThread:
    """Runs ``step`` (one driver call or a few; returns how many) over and over until stopped."""

    def __init__(self, step: Callable[[], int]) -> None:
        self._step = step
        self._stop = threading.Event()
        self.calls = 0
        self._thread = threading.Thread(target=self._run, name="pin-contention", daemon=True)

    def __enter__(self) -> SideThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.calls += self._step()


def buffers(count: int, nbytes: int) -> list[torch.Tensor]:
    """``count`` host buffers of ``nbytes``, their pages present (as after a read)."""
    made = [host_buffer(nbytes) for _ in range(count)]
    for buffer in made:
        buffer.fill_(1)
    return made


def side_step(pattern: str, pool: list[torch.Tensor], piece_bytes: int) -> Callable[[], int] | None:
    """The side thread's repeated step for ``pattern`` over the buffers of ``pool`` in turns (None: ``idle``);
    each step returns the driver calls it made, and leaves no buffer locked."""
    if pattern == "idle":
        return None
    turn = iter(range(1 << 62))

    def next_buffer() -> torch.Tensor:
        return pool[next(turn) % len(pool)]

    def lock_unlock() -> int:
        buffer = next_buffer()
        if pin_in_place(buffer):
            unpin_in_place(buffer)
        return 2

    def lock_unlock_pieces() -> int:
        buffer = next_buffer()
        pieces = [buffer[start : start + piece_bytes] for start in range(0, buffer.numel(), piece_bytes)]
        locked = [piece for piece in pieces if pin_in_place(piece)]
        for piece in locked:
            unpin_in_place(piece)
        return len(pieces) + len(locked)

    def host_copy() -> int:
        pool[0].copy_(pool[1])  # as much memory traffic as a read, no driver call
        return 0

    return {"lock_unlock": lock_unlock, "lock_unlock_pieces": lock_unlock_pieces, "host_copy": host_copy}[pattern]


def main_loop(
    units: int, ahead: int, weight: torch.Tensor, x: torch.Tensor, source: torch.Tensor, slot: torch.Tensor
) -> float:
    """``units`` rounds of compute on the default stream, each with a copy on a side stream that the next waits
    for, the thread never more than ``ahead`` rounds ahead of the device (0: no bound); the wall time in seconds,
    device synchronised."""
    copy_stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    start = time.perf_counter()
    y = x
    ends: list[torch.cuda.Event] = []
    for round_ in range(units):
        if ahead and round_ >= ahead:
            ends[round_ - ahead].synchronize()
        with torch.cuda.stream(copy_stream):
            slot.copy_(source, non_blocking=True)
        done = torch.cuda.Event()
        done.record(copy_stream)
        for _ in range(8):
            y = torch.tanh(y @ weight)
        torch.cuda.current_stream().wait_event(done)
        ends.append(torch.cuda.Event())
        ends[-1].record()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=40, help="rounds of the main loop")
    parser.add_argument("--dim", type=int, default=8192, help="the matmuls' size")
    parser.add_argument("--unit-bytes", type=int, default=488_220_000, help="a side-thread buffer's size")
    parser.add_argument("--buffers", type=int, default=4, help="side-thread buffers, used in turns")
    parser.add_argument("--copy-bytes", type=int, default=256 << 20, help="the main loop's H2D copy per round")
    parser.add_argument("--piece-bytes", type=int, default=32 << 20, help="lock_unlock_pieces' piece size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--ahead",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[2, 0],
        help="rounds the main thread may run ahead of the device, each a set of runs (0: no bound; default 2,0)",
    )
    parser.add_argument("--patterns", default=",".join(PATTERNS), help=f"comma list of {', '.join(PATTERNS)}")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    patterns = [p for p in args.patterns.split(",") if p]
    unknown = [p for p in patterns if p not in PATTERNS]
    if unknown:
        parser.error(f"unknown --patterns {', '.join(unknown)}; of {', '.join(PATTERNS)}")
    if not torch.cuda.is_available():
        raise SystemExit("pin_contention_bench.py measures a CUDA device: run it on the GPU machine")
    weight = torch.randn(args.dim, args.dim, device="cuda", dtype=torch.bfloat16) / args.dim**0.5
    x = torch.randn(args.dim, args.dim, device="cuda", dtype=torch.bfloat16)
    source = torch.empty(args.copy_bytes, dtype=torch.uint8, pin_memory=True)
    slot = torch.empty(args.copy_bytes, dtype=torch.uint8, device="cuda")
    pool = buffers(args.buffers, args.unit_bytes)
    main_loop(4, 0, weight, x, source, slot)  # warm-up: kernels chosen, the allocator primed
    results: list[PatternResult] = []
    for ahead in args.ahead:
        idle_s: float | None = None
        for pattern in patterns:
            times, calls = [], 0
            for _ in range(args.repeats):
                step = side_step(pattern, pool, args.piece_bytes)
                if step is None:
                    times.append(main_loop(args.units, ahead, weight, x, source, slot))
                    continue
                with SideThread(step) as side:
                    times.append(main_loop(args.units, ahead, weight, x, source, slot))
                calls += side.calls
            median = statistics.median(times)
            idle_s = median if pattern == "idle" else idle_s
            result = PatternResult(
                pattern=pattern,
                ahead=ahead,
                loop_s=[round(t, 4) for t in times],
                median_s=round(median, 4),
                vs_idle=round(median / idle_s, 4) if idle_s else None,
                driver_calls=calls,
            )
            results.append(result)
            print(json.dumps(asdict(result)), flush=True)
    out = {
        "benchmark": "page-locking on a side thread against the main thread's GPU work",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "config": vars(args),
        "patterns": [asdict(r) for r in results],
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
