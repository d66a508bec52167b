"""Host memory while packing progressively (issue 48): set-up returns at once and the host peak stays at the
weights plus one unit, for every model of the process together.

Host memory is read as the kernel counts it, RssAnon + RssShmem of this process (`resident_bytes`), at a state that
does not depend on timing (every model set up and the packing line idle, one unit copied ahead) and as the
highest of samples taken every millisecond meanwhile (`PeakSampler`): a sample can only miss a peak, never see a
higher one, so a busy machine can make the test weaker but never make it fail.

The bound is the RSS before set-up plus what packing adds for good (each packed buffer's room beyond its tensors'
bytes), one unit (the largest), and `OVERHEAD`. Units are larger than `OVERHEAD`, so a second unit held twice
(a window of units packed ahead, a second model's window) fails the test.
"""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import flextensor_diffusers as ft
from flextensor_diffusers.storage import packing, packing_line
from flextensor_diffusers.storage.host_memory import return_freed_heap

#: What the process holds beyond the weights and one unit while packing: the copying thread's stack and malloc
#: arena, its OpenMP team's stacks, the copies' Python objects, the sampler's own reads (5 MB measured here).
#: Below one unit of `WanLikeBlock` (42 MB), so that one more unit held twice fails.
OVERHEAD = 24 << 20

STATUS = Path("/proc/self/status")
pytestmark = pytest.mark.skipif(not STATUS.exists(), reason="reads resident memory from /proc")


def resident_bytes() -> int:
    """RssAnon + RssShmem of this process: anonymous and shared memory resident now (packed copies are either)."""
    total = 0
    for line in STATUS.read_text().splitlines():
        if line.startswith(("RssAnon:", "RssShmem:")):
            total += int(line.split()[1]) * 1024
    return total


class PeakSampler:
    """The highest `resident_bytes` seen, sampled every millisecond on a thread of its own while in use."""

    def __init__(self) -> None:
        self.peak = resident_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, resident_bytes())

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())


class WanLikeBlock(nn.Module):
    """Attention projections and a feed-forward pair, as a video transformer block: 42 MB in BF16."""

    def __init__(self, dim: int = 1024, ffn: int = 8192) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.up, self.down = nn.Linear(dim, ffn), nn.Linear(ffn, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.o(self.q(h) * self.k(h).sigmoid() + self.v(h))
        return x + self.down(nn.functional.gelu(self.up(x)))


class WanLike(nn.Module):
    def __init__(self, depth: int = 4, dim: int = 1024) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(WanLikeBlock(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def build(seed: int) -> WanLike:
    """Built in FP32 and cast to BF16, as `recipes.models` builds random weights: the BF16 tensors then sit on the C
    heap where the FP32 ones were freed (`host_memory.return_freed_heap`)."""
    torch.manual_seed(seed)
    model = WanLike()
    for t in model.parameters():
        t.data = t.data.to(torch.bfloat16)
    return model.eval().requires_grad_(False)


def weight_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.parameters())


@pytest.fixture
def line(monkeypatch: pytest.MonkeyPatch) -> packing_line.PackingLine:
    """A packing line for this test's models alone; eight locking threads, as on a GPU machine."""
    line = packing_line.PackingLine()
    monkeypatch.setattr(packing_line, "LINE", line)
    monkeypatch.setattr(packing, "PACK_THREADS", 8)
    return line


def offload(model: WanLike, **config: object) -> ft.OffloadHandle:
    """Offloaded to the CPU under its smallest budget, two slots and the base: its units stream (under a budget
    the whole model fits, activation makes every unit resident, packed before set-up returns)."""
    return ft.offload(model, include_patterns=["blocks.*"], gpu_budget=90 << 20, device="cpu", **config)


def wait_until_idle(line: packing_line.PackingLine) -> None:
    """Until the line holds a copied unit and copies nothing: it copies no more before that unit is adopted."""
    with line._cond:
        assert line._cond.wait_for(lambda: line._held is not None and line._copying is None, timeout=120)


def settled_resident_bytes() -> int:
    """`resident_bytes` once garbage is collected and the C heap's free pages are given back: what earlier tests
    freed onto the heap (models restored, then dropped) would otherwise go back during this one."""
    gc.collect()
    return_freed_heap()
    return resident_bytes()


def test_two_models_set_up_at_once_hold_at_most_one_unit_twice(line: packing_line.PackingLine) -> None:
    """Two models set up and not used yet (a pipeline's components), then packed to the end: at no time does the
    process hold more than one unit twice."""
    models = [build(seed) for seed in range(2)]
    before = settled_resident_bytes()
    with PeakSampler() as sampler:
        handles = [offload(m, active_after_setup=False) for m in models]  # no device copies (RAM on the CPU)
        assert all(h.host._progressive is not None for h in handles)  # set-up returned with packing under way
        wait_until_idle(line)
        idle = resident_bytes()
        for handle in handles:
            handle.wait_until_packed()
    after = resident_bytes()
    weights = sum(weight_bytes(m) for m in models)
    packed = sum(h.host.packed_bytes for h in handles)
    unit = max(u.nbytes for h in handles for u in h.host.positions)
    assert unit > OVERHEAD
    bound = before + (packed - weights) + unit + OVERHEAD
    mb = 1e6
    report = f"before {before / mb:.1f} MB, unit {unit / mb:.1f} MB, bound {bound / mb:.1f} MB"
    assert idle <= bound, f"set up and idle: {idle / mb:.1f} MB; {report}"
    assert sampler.peak <= bound, f"peak while packing: {sampler.peak / mb:.1f} MB; {report}"
    assert after <= before + (packed - weights) + OVERHEAD, f"packed: {after / mb:.1f} MB; {report}"
    for handle in handles:
        handle.remove()


def test_packing_driven_by_the_first_forwards_holds_at_most_one_unit_twice(line: packing_line.PackingLine) -> None:
    """Units packed as the first forwards reach them (on the CPU the device copies are in host memory too: they are
    made at the first forward and kept, so they are in the RSS at the end). The originals freed between the
    forwards' own allocations go back to the system (`host_memory.return_freed_heap`)."""
    model = build(0)
    x = torch.randn(1, 16, 1024, dtype=torch.bfloat16)
    before = settled_resident_bytes()
    with PeakSampler() as sampler:
        handle = offload(model)
        with torch.inference_mode():
            for _ in range(3):
                model(x)
        handle.wait_until_packed()
        gc.collect()
    after = resident_bytes()
    unit = max(u.nbytes for u in handle.host.positions)
    mb = 1e6
    assert after - before < 2 * weight_bytes(model)  # the originals went back (the device copies stay)
    assert sampler.peak <= after + unit + OVERHEAD, (
        f"peak {sampler.peak / mb:.1f} MB against {after / mb:.1f} MB packed, one unit {unit / mb:.1f} MB"
    )
    handle.remove()
