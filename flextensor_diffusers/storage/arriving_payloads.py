"""`ArrivingPayloads`: a set-up that does not wait for its payloads, and their adoption once all are here.

The model streams raw meanwhile. The payloads are read from the payload file on threads (`arrivals.PayloadArrival`,
begun once packing is over) or encoded between the model's forwards on its device (`arrivals.EncodingBetweenForwards`),
and kept all at once while the model is inactive (`adopt`), each unproven until its first decoded load compared it
with the weights (`PayloadRecords.unproven`). An edit before then cancels them: they are of the old weights.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from .arrivals import EncodingBetweenForwards, PayloadArrival
from .payload_cache import PayloadCache
from .payload_records import PayloadLocks, PayloadRecords
from .set_up_payloads import SetUpPayloads
from .waiting_payloads import WaitingPayloads

logger = logging.getLogger(__name__)


class ArrivingPayloads:
    """The payloads read or made since set-up and not kept yet (``current``: None when there are none), kept into
    ``records`` once all arrived. The file is ``disk``'s; ``set_up`` checks its header and makes the encoder's jobs.

    Each `start_*` expects no payload kept (`CompressedCopies` drops them first)."""

    def __init__(
        self, records: PayloadRecords, locks: PayloadLocks, disk: WaitingPayloads, set_up: SetUpPayloads
    ) -> None:
        self._records = records
        self._locks = locks
        self._disk = disk
        self._set_up = set_up
        self.current: PayloadArrival | EncodingBetweenForwards | None = None
        #: An edit while units are encoded between forwards begins the encoding again (`cancel`), instead of leaving
        #: the model raw for good: its raw copies wait on disk, where raw loads are slow (`start_encoding`).
        self._restart_on_edit = False

    def start_reading(self, cache: PayloadCache, pin: bool) -> bool:
        """Read the payload file without waiting for it: its header is checked here, and its payloads are read on
        threads from `begin` on. False, nothing started, when the file is missing or refused."""
        records = self._set_up.usable_records(cache)
        if not records:
            return False
        self._disk.file, self._locks.pin = cache, pin
        self.current = PayloadArrival(cache, records, pin)
        cache.mark_reading()
        return True

    def start_reading_else_encoding(self, cache: PayloadCache, pin: bool) -> None:
        """As `start_reading`, with nothing of the file read here, not even its header (on the H100 a set-up that
        checked it took 1.14× raw's, call V): it is checked as the reads begin, and a missing or refused file is
        found then (`found_no_file`)."""
        self._disk.file, self._locks.pin = cache, pin
        self.current = PayloadArrival(cache, functools.partial(self._set_up.usable_records, cache), pin)
        cache.mark_opening()

    def begin(self) -> None:
        """Begin reading the payload file (nothing when none is to be read, or already begun)."""
        if isinstance(self.current, PayloadArrival):
            self.current.begin()

    def start_encoding(self, cache: PayloadCache | None, pin: bool, restart_on_edit: bool = False) -> None:
        """Encode the units between the model's forwards (`encode_for`), on its device within the set-up's
        ``budget_bytes``; once all are made and kept, they are written to ``cache``'s file. ``restart_on_edit``: an
        edit meanwhile begins the encoding again instead of ending it (the raw copies wait on disk)."""
        self._disk.file, self._locks.pin = cache, pin
        set_up = self._set_up
        self.current = EncodingBetweenForwards(set_up.encode_jobs(), self._records.device, pin, set_up.budget_bytes)
        self._restart_on_edit = restart_on_edit
        if cache is not None:
            cache.mark_encoding()

    @property
    def arriving_bytes(self) -> int:
        """Host RAM of the payloads made between forwards and not kept yet (those read from the file are counted
        once kept)."""
        return self.current.made_bytes if isinstance(self.current, EncodingBetweenForwards) else 0

    def restart(self, why: str) -> bool:
        """Drop the payloads made between forwards so far and encode again from the first unit (``why`` logged);
        False when no encoding between forwards is under way."""
        if not isinstance(self.current, EncodingBetweenForwards):
            return False
        logger.info("%s: the weights are compressed again from the first block, between forwards", why)
        self.current.restart()
        return True

    @property
    def found_no_file(self) -> bool:
        """The payload file checked as its reads began (`start_reading_else_encoding`) was missing or refused."""
        arrival = self.current
        return isinstance(arrival, PayloadArrival) and arrival.found_no_file

    @property
    def encoding_between_forwards(self) -> bool:
        """Units are left to encode between the model's forwards (`start_encoding`)."""
        return isinstance(self.current, EncodingBetweenForwards) and not self.current.done

    def encode_for(self, seconds: float, now: Callable[[], float], limit: int | None = None) -> None:
        """After a forward, the model's device memory given back: encode the next units (at most ``limit``) for about
        ``seconds`` by the clock ``now`` (`EncodingBetweenForwards.encode_for`)."""
        assert isinstance(self.current, EncodingBetweenForwards)
        self.current.encode_for(seconds, now, limit)

    @property
    def arrived(self) -> bool:
        """The payloads read or made since set-up are all here (or one failed): `adopt` takes them."""
        return self.current is not None and self.current.done

    def adopt(self, refusal: Callable[[int], str | None] | None = None) -> bool:
        """Keep the payloads read or made since set-up (the model inactive), every one unproven; True when kept. A
        read that failed keeps none: the file is refused and deleted (the next set-up encodes again), the model
        streams raw; so does a failed encoding, with a warning. Payloads made here are then written to the file.
        ``refusal(largest payload's bytes)``: why the payloads cannot be kept (the budget cannot hold the staging
        room their loads need), None when they can; a refusal keeps none and is warned of."""
        arrival = self.current
        assert arrival is not None
        payloads, failure = arrival.take()
        refused = refusal(max(m.encoded.payload.numel() for m in payloads.values())) if refusal and payloads else None
        if failure is None and refused is not None:
            self.current = None
            logger.warning("the compressed copies made or read while the model ran are not kept: %s", refused)
            return False
        if failure is not None:
            self.current = None
            if arrival.in_file:
                self._disk.forget(failure, then="this run streams raw, and the next set-up encodes again")
            else:
                logger.warning("compressing the weights while the model ran failed (%s): it streams them raw", failure)
            return False
        records = self._records
        for index in sorted(payloads):
            if payloads[index].locked:
                self._locks.mark_locked(payloads[index].encoded.payload)
        # one assignment, then the arrival goes: a host tier counting RAM on another thread sees them all, once or
        # (for a moment) twice, never none
        records.encoded = {**records.encoded, **{index: payloads[index].encoded for index in sorted(payloads)}}
        records.unproven = set(payloads)
        self.current = None
        file = self._disk.file
        if arrival.in_file:
            assert file is not None
            self._disk.mark_holds_all()
            file.mark_read()
        elif file is not None:  # for the next run, or a spill (which waits for it)
            self._disk.write_in_background(file)
        return True

    def cancel(self, why: str | None) -> None:
        """Stop reading the payload file, keeping none of its payloads: an edit made them stale (``why`` says so, in
        the file's status and a warning), or the copies are dropped (None). An edit while units are encoded between
        forwards with the raw copies on disk begins the encoding again instead (`start_encoding`)."""
        if why is not None and self._restart_on_edit and self.restart(why):
            return
        arrival, self.current = self.current, None
        if arrival is not None:
            usable = not isinstance(arrival, PayloadArrival) or arrival.usable
            arrival.abandon()
            file = self._disk.file
            if why is not None and not usable:  # the file not checked yet, or found missing or refused
                logger.warning("%s came before any payload was read or made: the model streams raw", why)
            elif why is not None and arrival.in_file and file is not None:
                file.refuse(f"{why} came while it was being read", then="the model streams raw")
            elif why is not None:
                logger.warning("%s came while the weights were being compressed: the model streams them raw", why)
