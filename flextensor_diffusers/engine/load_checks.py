"""`LoadChecks` (``verify_loads=True``): every unit call checks, on the device, that the bytes it computes with are
its weights.

Why: the one rule is bitwise or refused, and a load that goes wrong breaks it without a word. A slot written
by one stream while another still reads it, a payload decoded into a slot before its copy landed, a buffer
freed while a copy still reads it: the model then computes with other bytes and its output is simply
different. Copies and decodes on a CPU are synchronous, so tests there cannot meet such faults; a run on a
GPU can, and this is how it finds them (one run of the compressed host tier on the H200 was not bitwise, and
nothing in its log said why: see benchmarks/results/README.md, issue 25).

**What is compared.** A unit's *fingerprint*: for each run of its tensors' bytes (tensors that follow each
other without a gap, at a boundary on an 8-byte step of the unit's layout, form one run), the sum of its 64-bit
words, plus its few bytes before the first and after the last 8-byte step of the layout, modulo 2**64. Integer
sums with wrap-around are exact in any order, so a fingerprint taken on the device equals one taken on the host
bit for bit, and one run's sum is the sum of its tensors' (their shared ends are on the steps). The words are
summed in their own type: a sum into a wider type than its input makes PyTorch convert the whole input first,
a copy twice the unit's size per check (what calls I and J measured: the plans' forwards 3-3.5 % slower, with
fewer units resident). Bytes between tensors (alignment padding, which a decode leaves as it found it) are not
part of it. The host side is taken from the unit's host copy, the weights' truth, tensor by tensor: as each unit
is packed at set-up, on the packing thread (`note_packed`), and again from its host copy after an edit (a
stand-in of the weight files gives the tensors without gathering the unit).

**When.** Right before each unit call, once the unit's tensors view the device buffer they compute with
(resident copy or slot, whichever load filled it), and right after the call, before the slot is handed on
(so a write into the slot during the call is caught too). Each comparison is a few reductions enqueued on the
compute stream, counted into a per-unit device counter: nothing synchronises while the model runs. After
each forward the counters are copied to page-locked memory behind an event; `LoadChecks.raise_faults` reads
them (waiting when asked) and raises one line naming the first unit that computed with wrong bytes and how it
had been loaded. A pipeline calls it at the end of every generation, before the output is returned; a
standalone handle at the start of the next forward and in ``handle.check_loads()``.

**Cost.** Two reads of every unit's bytes per call on the device (memory bandwidth, no copy, no new memory),
a few small tensors per call, and one host pass over each unit's bytes as it is packed (and after each edit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from ..storage.host_bytes import Flat
from .errors import FlexTensorError
from .units import Unit

#: The step of the unit's layout on which its words start: a run's sum is its 64-bit words', taken in their own
#: type (no conversion, see the module's docstring), plus its bytes off the steps at either end.
WORD = 8


@dataclass(frozen=True)
class ByteRun:
    """Bytes ``[start, stop)`` of a unit's flat buffer, all of them tensor bytes (the tensors' ``spans``, which
    follow each other without a gap, meeting on a `WORD` step), so that the run's sum is its spans' sums."""

    start: int
    stop: int
    spans: tuple[tuple[int, int], ...]


def tensor_runs(unit: Unit) -> list[ByteRun]:
    """The unit's tensor bytes as runs: tensors that follow each other with no gap, at a `WORD` step, share one."""
    spans = sorted((p.offset, p.offset + p.nbytes) for p in unit.tensors if p.nbytes)
    grouped: list[list[tuple[int, int]]] = []
    for span in spans:
        if grouped and span[0] == grouped[-1][-1][1] and span[0] % WORD == 0:
            grouped[-1].append(span)
        else:
            grouped.append([span])
    return [ByteRun(group[0][0], group[-1][1], tuple(group)) for group in grouped]


def span_sum(data: torch.Tensor, start: int) -> torch.Tensor:
    """The sum (int64, modulo 2**64) of ``data``, the uint8 bytes at ``[start, start + len)`` of a unit's layout:
    its 64-bit words on the layout's `WORD` steps, and each byte before the first step and after the last."""
    stop = start + data.numel()
    body_start, body_stop = min(-(-start // WORD) * WORD, stop), max(stop // WORD * WORD, start)
    if body_stop <= body_start:
        return data.sum(dtype=torch.int64)
    head, body, tail = data.split([body_start - start, body_stop - body_start, stop - body_stop])
    if body.storage_offset() % WORD:  # a view of a weight file, off a word boundary: words need one
        body = body.clone()
    total = body.view(torch.int64).sum()
    if head.numel() or tail.numel():
        total = total + head.sum(dtype=torch.int64) + tail.sum(dtype=torch.int64)
    return total


def fingerprint(flat: torch.Tensor, runs: list[ByteRun]) -> torch.Tensor:
    """One int64 per run: `span_sum` of its bytes in ``flat`` (a uint8 buffer laid out like the unit's), on
    ``flat``'s device. Enqueued on the current stream; no synchronisation, no memory the size of the unit."""
    if not runs:
        return torch.zeros(0, dtype=torch.int64, device=flat.device)
    return torch.stack([span_sum(flat[r.start : r.stop], r.start) for r in runs])


def host_fingerprint(host: Flat, runs: list[ByteRun]) -> torch.Tensor:
    """`fingerprint` of a unit's host copy, tensor by tensor: ``host`` is its flat buffer or a stand-in for it
    (which gives bytes only when sliced at a tensor's range, e.g. views of the weight files), so nothing of the
    unit is gathered into new memory."""
    sums = [torch.stack([span_sum(host[a:b], a) for a, b in r.spans]).sum() for r in runs]
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


class CheckPoint(Enum):
    """Where in a unit call its bytes were compared."""

    BEFORE = "before its call"
    AFTER = "after its call"


@dataclass(frozen=True)
class LoadFault:
    """A unit that computed with bytes other than its weights: where it was found and how it had been loaded."""

    unit: str
    found: CheckPoint
    how: str
    count: int

    def line(self) -> str:
        return f"{self.unit} ({self.how}; found {self.found.value}, {self.count} time(s))"


@dataclass(frozen=True)
class LoadCheckSummary:
    """For a report: the comparisons made so far and the faults among them (`LoadChecks.summary` waits for them)."""

    checks: int
    faults: list[LoadFault]


class LoadChecks:
    """The host fingerprints of a model's units, the device counters of mismatches, and reading them back.

    ``host_of(unit)`` gives the unit's host copy: its flat buffer or a stand-in for it (`HostCopies.host_of`)."""

    def __init__(self, units: list[Unit], device: torch.device, host_of: Callable[[Unit], Flat]) -> None:
        self.units = units
        self.device = device
        self.cuda = device.type == "cuda"
        self._host_of = host_of
        self._runs = [tensor_runs(unit) for unit in units]
        self._expected: dict[int, torch.Tensor] = {}  # on the device, by unit index
        self._packed: dict[int, torch.Tensor] = {}  # host fingerprints taken as units were packed (`note_packed`)
        #: Mismatches per unit and check point: row 0 before the call, row 1 after it.
        self._mismatches = torch.zeros(2, len(units), dtype=torch.int32, device=device)
        self._read_back = torch.zeros(2, len(units), dtype=torch.int32, pin_memory=self.cuda)
        self._read_event: torch.cuda.Event | None = None
        self._how = [""] * len(units)  # how each unit's bytes were loaded when it was last checked
        self.checks = 0

    # ------------------------------------------------------------------------------------ comparing

    def before_call(self, unit: Unit, flat: torch.Tensor, how: str) -> None:
        """Compare ``flat`` (the device buffer ``unit``'s tensors view for this call) with its weights."""
        self._how[unit.index] = how
        self._compare(unit, flat, CheckPoint.BEFORE)

    def after_call(self, unit: Unit, flat: torch.Tensor) -> None:
        """Compare again once the call is enqueued, before the buffer can be handed to another unit."""
        self._compare(unit, flat, CheckPoint.AFTER)

    def _compare(self, unit: Unit, flat: torch.Tensor, point: CheckPoint) -> None:
        runs = self._runs[unit.index]
        if not runs:
            return
        expected = self._expected_of(unit)
        with torch.no_grad(), torch.inference_mode(False):
            differs = (fingerprint(flat, runs) != expected).any()
            row = 0 if point is CheckPoint.BEFORE else 1
            self._mismatches[row, unit.index : unit.index + 1].add_(differs.to(torch.int32))
        self.checks += 1

    def note_packed(self, unit: Unit, host: torch.Tensor) -> None:
        """Take ``unit``'s host fingerprint from the bytes just packed for it (on the packing thread): its first
        check then reads nothing from its host copy, which may wait on disk by then (compressed only), and the
        first forward does no host pass over the weights."""
        if unit.index >= 0:
            with torch.no_grad(), torch.inference_mode(False):
                self._packed[unit.index] = host_fingerprint(host, self._runs[unit.index])

    def _expected_of(self, unit: Unit) -> torch.Tensor:
        expected = self._expected.get(unit.index)
        if expected is None:
            with torch.no_grad(), torch.inference_mode(False):
                host = self._packed.pop(unit.index, None)
                if host is None:
                    host = host_fingerprint(self._host_of(unit), self._runs[unit.index])
                expected = host.to(self.device)
            self._expected[unit.index] = expected
        return expected

    def forget(self, unit: Unit | None = None) -> None:
        """The host copy of ``unit`` (None: of every unit) was edited: its fingerprint is taken again from it at
        its next check."""
        if unit is None:
            self._expected.clear()
            self._packed.clear()
        elif unit.index >= 0:
            self._expected.pop(unit.index, None)
            self._packed.pop(unit.index, None)

    # ------------------------------------------------------------------------------------ reading back

    def end_of_forward(self) -> None:
        """Copy the counters towards the host behind an event (no synchronisation)."""
        if self.cuda:
            self._read_back.copy_(self._mismatches, non_blocking=True)
            self._read_event = torch.cuda.Event()
            self._read_event.record(torch.cuda.current_stream(self.device))

    def faults(self, wait: bool) -> list[LoadFault]:
        """The faults found so far: with ``wait``, every comparison enqueued until now is counted (one
        synchronisation); else only those already read back."""
        if not self.cuda:
            counts = self._mismatches.clone()
        else:
            if wait:
                self.end_of_forward()
            event = self._read_event
            if event is None:
                return []
            if wait:
                event.synchronize()
            elif not event.query():
                return []
            counts = self._read_back.clone()
        found = []
        for row, point in enumerate(CheckPoint):
            for index in torch.nonzero(counts[row]).flatten().tolist():
                found.append(LoadFault(self.units[index].name, point, self._how[index], int(counts[row, index])))
        return found

    def raise_faults(self, model: str, wait: bool) -> None:
        """Raise `LoadCheckError` when a unit of ``model`` computed with wrong bytes (see `faults`)."""
        found = self.faults(wait)
        if found:
            raise LoadCheckError(model, found)

    def summary(self) -> LoadCheckSummary:
        return LoadCheckSummary(self.checks, self.faults(wait=True))


class LoadCheckError(FlexTensorError):
    """A unit computed with bytes that are not its weights: the outputs since are wrong. Never expected: it
    is a fault of the offloading itself, which ``verify_loads=True`` caught instead of returning them."""

    def __init__(self, model: str, faults: list[LoadFault]) -> None:
        self.faults = faults
        more = f" and {len(faults) - 1} more" if len(faults) > 1 else ""
        super().__init__(
            f"verify_loads: a unit of {model} computed with bytes that are not its weights, so this output is "
            f"wrong: {faults[0].line()}{more}. Please report it with flextensor_report(); compression='none' "
            "(--compression none) and host_budget=None (--host-budget none) take other load paths"
        )
