"""The storage plan: which storage options combine, decided once.

`resolve_storage` turns what a caller asked (`StorageRequest`: compression, where the raw copies wait, the payload
file, progressive packing, background encoding, shared host memory, a host budget, load checks) and the machine's
facts (`MachineFacts`: the device's kind, the RAM available, what keeping every host copy in RAM would take) into a
frozen `StoragePlan` that says what set-up will do, or refuses with a `StorageOptionError` whose one line names the
fix. It reads nothing and changes nothing (the facts are measured by its callers), so every combination is a row of
a table (`tests/test_storage_plan.py` checks the guide's, docs/guide.md "Storage options combined").

Its consumers only read the plan: `enable_flextensor_offload` (the host tier, each component's `OffloadConfig`),
`OffloadConfig` (its validation), the recipes' option checks (the same refusals in flag words, by `Rule`) and
`SetUp` (what it packs, encodes and reads, and when). A choice the plan makes for an option the caller left to it
under a host budget is stated in the plan (`StoragePlan.choices`), logged and shown in the offload report, never
made silently.

Defaults, stated here once: ``compression="none"``; every other option ``None``, the plan's choice: raw copies in
RAM, no payload file, progressive packing, no load checks and background encoding on CUDA where the encoder's room
fits the budget; under a host tier with compression, compressed copies only with their payload file and no raw copy
written (``raw_copies="none"``), packed before set-up returns (the raw bytes of each unit handed to its weight files,
or with ``raw_copies="disk"`` a cache file, as it is packed), encoded between forwards like raw copies in RAM are (on
CUDA where the encoder's room fits; with ``raw_copies="none"`` only a component whose weight files hold every unit,
else at set-up) and, on CUDA, every load verified.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..engine.config import COMPRESSION_MODES, NO_COMPRESSION, format_bytes, is_auto, parse_bytes
from ..engine.errors import FlexTensorError, HostBudgetError
from .host_budget import AUTO_HOST_SHARE, HOST_RESERVE_BYTES
from .machine_memory import AvailableMemory

#: Where the raw host copies may wait (``raw_copies``): in RAM, on disk (the weight files, else a cache file), or
#: nowhere but the weight files (a unit they do not hold keeps its payload only).
RAW_PLACES = ("ram", "disk", "none")
#: The places that keep compressed copies only in RAM.
COMPRESSED_ONLY_PLACES = ("none", "disk")

#: Said when a host tier with compression is set up on a GPU with ``verify_loads=False`` (see the README and
#: benchmarks/results/README.md, issue 25, fifth and sixth sessions): the one rule is bitwise or refused, and one
#: run of four was neither.
UNTRUSTED_COMPRESSED_TIER = (
    "a host budget with compression and verify_loads=False is not to be trusted yet on a GPU: one of four runs of "
    "the Wan2.2 pipeline gave latents not bitwise equal to native, cause unknown; drop verify_loads=False (every "
    "load is then checked on the device, a wrong one raising instead of giving a wrong output), or pass "
    "compression='none' (--compression none) for a host tier that was bitwise in every run"
)


class Rule(Enum):
    """Why a combination is refused: the recipes word each in their flags (`recipes.options`)."""

    COMPRESSION_MODE = "compression_mode"
    RAW_PLACE = "raw_place"
    RAW_DISK_WITHOUT_COMPRESSION = "raw_disk_without_compression"
    CACHE_WITHOUT_COMPRESSION = "cache_without_compression"
    BACKGROUND_WITHOUT_RAW_STREAM = "background_without_raw_stream"
    COMPRESSION_WITH_SHARED_HOST = "compression_with_shared_host"
    HOST_BUDGET_WITH_SHARED_HOST = "host_budget_with_shared_host"
    TIER_KEEPS_COMPRESSED_ONLY = "tier_keeps_compressed_only"
    TIER_HOLDS_NO_SECOND_COPY = "tier_holds_no_second_copy"


class StorageOptionError(FlexTensorError, ValueError):
    """Storage options that cannot be combined; the message names the fix, ``rule`` says which combination."""

    def __init__(self, message: str, rule: Rule, option: str | None = None) -> None:
        super().__init__(message)
        self.rule = rule
        self.option = option  # the option the message names to drop, where there are several alike


class Encoding(Enum):
    """When the compressed copies are made (`SetUp.run`)."""

    NONE = "none"  # no compression
    AT_SET_UP = "at set-up"  # before set-up returns (or read from the payload file)
    BETWEEN_FORWARDS = "between forwards"  # while the model streams raw (`arrivals`)
    WHERE_ROOM = "between forwards where the encoder fits"  # the default on CUDA: as set-up finds the encoder's room
    #: ``raw_copies="none"``: as above for a model whose weight files hold every unit (loaded from its folder, not
    #: edited), decided at set-up where the raw homes are known; any other model is encoded at set-up, since a unit
    #: the files do not hold keeps its payload as its only host copy and has no raw bytes to stream meanwhile.
    FILES = "between forwards where the weight files hold every unit, else at set-up"
    WHERE_ROOM_AND_FILES = (
        "between forwards where the encoder fits and the weight files hold every unit, else at set-up"
    )


@dataclass(frozen=True)
class StorageRequest:
    """What the caller asked, as typed (`enable_flextensor_offload`'s and `OffloadConfig`'s keywords); ``None``: the
    plan's choice (see the module docstring).

    Attributes:
        compression: ``"lossless"``: units that stream faster compressed keep a compressed copy in host memory
            too; a load moves it and decodes it on the device into the slot, bit-exact (`codec`). ``"none"``: raw
            copies only.
        raw_copies: with compression, where the raw host copies (the weights' truth) live: ``"ram"``; ``"disk"``:
            in the weight files a pipeline was loaded from, else in a mapped cache file in ``cache_dir``, so host RAM
            holds the compressed copies only; ``"none"``: in the weight files where they hold a unit byte for byte,
            else nowhere: its lossless payload is its host copy (`payloads_only`), nothing raw is written, and its
            weights refuse reads between its calls (`read_guard`). Compressed only, loads always decode, so the
            budget must hold each slot's staging room. ``"none"`` is the default under a host tier with
            compression.
        compression_cache: with compression, write the compressed copies to a file in ``cache_dir`` the first
            time and read them back on later set-ups of the same weights instead of encoding (`payload_cache`);
            every payload read is decoded and compared with the weights first. On under a host tier with
            compression, where the compressed copies wait on disk in it.
        progressive_packing: without compression or shared weights, set-up returns while the raw host copies are
            still packed on threads, and the first forward waits only for the units it reaches (`packing_line`:
            the host peak is the weights plus one unit). False packs every unit before set-up returns; a host
            tier does (it holds host memory to a budget), and refuses True.
        background_encoding: with compression, a set-up that finds no payload file to read returns with nothing
            encoded and the units are encoded between the model's forwards (`arrivals`) while it streams its raw
            copies (from RAM, packed progressively; or compressed only, and under a host tier, from where they wait
            on disk, each unit's raw bytes handed there as set-up packs it), proven at their first decoded load, then
            written to the payload file. False encodes before set-up returns. None: on CUDA where it can be and the
            encoder's room for the largest unit fits the budget (`Encoding.WHERE_ROOM`); on the CPU the encoder would
            share the cores with the forwards. With ``raw_copies="none"`` only a model whose weight files hold every
            unit is encoded between forwards; set-up encodes any other one first, and logs it (`Encoding.FILES`).
        verify_loads: check on the device, before and after every unit call, that the bytes the unit computes with
            are its weights (`load_checks`): a wrong load raises instead of giving a wrong output. Costs two reads
            of each unit's bytes on the device per call. On under a host tier with compression on CUDA (one
            full-size run of it was not bitwise, cause unknown); False there is kept, with a warning.
        shared_host: the processes of the host share one raw host copy (`shared_host`): packed before set-up
            returns, all in RAM; compression and a sized host budget are refused with it.
        host_budget: a pipeline's host memory for the process (anonymous and page-locked): its own memory and a 1
            GiB reserve come off the top, the host copies get the rest; components that do not fit wait on disk
            (their weight files, else cache files) and are read back unit by unit (`host_tier`). ``"auto"`` (a
            pipeline's default): every host copy in RAM when they fit in `AUTO_HOST_SHARE` of the RAM available
            (the least of the host's, its cgroups' room and its rlimits: `machine_memory`), else a tier under what
            the process holds plus that share. ``None``: every host copy in RAM, refused when they cannot fit. A
            single model's set-up (`OffloadConfig`) has none and passes None with no RAM facts.
    """

    compression: str = NO_COMPRESSION
    raw_copies: str | None = None
    compression_cache: bool | None = None
    progressive_packing: bool | None = None
    background_encoding: bool | None = None
    verify_loads: bool | None = None
    shared_host: bool = False
    host_budget: int | str | None = None

    @property
    def compressed(self) -> bool:
        return self.compression != NO_COMPRESSION

    def keywords(self) -> dict[str, Any]:
        """The options `enable_flextensor_offload` and `OffloadConfig` take as keywords, as asked."""
        return {
            "compression": self.compression,
            "raw_copies": self.raw_copies,
            "compression_cache": self.compression_cache,
            "progressive_packing": self.progressive_packing,
            "background_encoding": self.background_encoding,
            "verify_loads": self.verify_loads,
        }

    @property
    def sized_host_budget(self) -> bool:
        return self.host_budget is not None and not is_auto(self.host_budget)


@dataclass(frozen=True)
class HostCopiesSize:
    """What the components' host copies take: their packed bytes, and the new host memory packing them takes
    (the packed bytes less the weights already in anonymous memory, which packing turns into host copies)."""

    packed_bytes: int
    new_bytes: int


@dataclass(frozen=True)
class MachineFacts:
    """What the plan needs to know of the machine, measured by the caller: the compute device's kind (``"cuda"``,
    ``"cpu"``), and for a pipeline the RAM available when offload is enabled, the process's anonymous memory then
    (``held_bytes``) and the host copies' sizes. Without ``ram`` (a single model, a command line before loading)
    ``host_budget="auto"`` keeps every host copy in RAM and nothing is checked against RAM."""

    device_kind: str
    ram: AvailableMemory | None = None
    held_bytes: int = 0
    host_copies: HostCopiesSize | None = None


@dataclass(frozen=True)
class StorageChoice:
    """An option the plan set to other than its plain default, and why (shown by the report and logged)."""

    option: str
    value: Any
    why: str

    def line(self) -> str:
        return f"{self.option}={self.value!r} ({self.why})"


@dataclass(frozen=True)
class HostTierPlan:
    """A host tier under ``budget_bytes``; ``auto``: turned on by ``host_budget="auto"`` because the host copies do
    not fit in the RAM available (which its refusals name)."""

    budget_bytes: int
    auto: bool


@dataclass(frozen=True)
class StoragePlan:
    """What set-up does with the host bytes: every option resolved, the host tier, and what was chosen and why."""

    compression: str
    raw_copies: str
    compression_cache: bool
    progressive_packing: bool
    encoding: Encoding
    shared_host: bool
    verify_loads: bool
    host_budget: int | str | None = None  # as asked
    host_tier: HostTierPlan | None = None
    choices: tuple[StorageChoice, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def compressed(self) -> bool:
        return self.compression != NO_COMPRESSION

    @property
    def compressed_only(self) -> bool:
        """Host RAM keeps compressed copies only: the raw ones wait outside it, or nowhere (``raw_copies="disk"``,
        ``"none"``)."""
        return self.compressed and self.raw_copies in COMPRESSED_ONLY_PLACES

    @property
    def writes_cache_files(self) -> bool:
        """Set-up may write files in ``cache_dir``: the payload file, or the raw cache file (``raw_copies="disk"``;
        ``"none"`` writes no raw copy); the folder is then checked before anything is packed (`SetUp.run`)."""
        return self.compressed and (self.compression_cache or self.raw_copies == "disk")

    @property
    def packs_progressively(self) -> bool:
        """Set-up leaves packing to go on while the model is in use (`HostCopies.start_progressive_packing`): when
        asked and nothing at set-up reads the packed bytes. The encoder reads every unit, and weights shared
        between processes are published once packed, so those pack before set-up returns."""
        return self.progressive_packing and not self.compressed and not self.shared_host

    @property
    def may_read_payloads_later(self) -> bool:
        """Set-up may leave the payload file to be read while the model already runs raw, once progressive packing
        is over (`CompressedCopies.start_arrival`): with the payload file, raw copies in RAM (a raw load is then
        always possible), progressive packing and no shared weights. Set-up still encodes, and waits, when the
        file is missing or refused."""
        return (
            self.progressive_packing
            and self.compressed
            and self.compression_cache
            and not self.compressed_only
            and not self.shared_host
        )

    def encodes_between_forwards(self, encoder_fits: bool) -> bool:
        """Whether a set-up that finds no payload file to read encodes between forwards; ``encoder_fits``: the
        device encoder's room for the largest unit fits the budget (what `Encoding.WHERE_ROOM` waits on)."""
        if self.encoding in (Encoding.WHERE_ROOM, Encoding.WHERE_ROOM_AND_FILES):
            return encoder_fits
        return self.encoding in (Encoding.BETWEEN_FORWARDS, Encoding.FILES)

    @property
    def between_forwards_needs_weight_files(self) -> bool:
        """Encoding between forwards holds only for a model whose every unit waits in its weight files (`SetUp`
        checks it, and encodes any other one before set-up returns): ``raw_copies="none"``."""
        return self.encoding in (Encoding.FILES, Encoding.WHERE_ROOM_AND_FILES)

    def config_options(self) -> dict[str, Any]:
        """The resolved options as `OffloadConfig` keywords (a pipeline's components take them)."""
        background = {Encoding.BETWEEN_FORWARDS: True, Encoding.FILES: True, Encoding.AT_SET_UP: False}.get(
            self.encoding
        )
        return {
            "compression": self.compression,
            "raw_copies": self.raw_copies,
            "compression_cache": self.compression_cache,
            "progressive_packing": self.progressive_packing,
            "background_encoding": background,
            "verify_loads": self.verify_loads,
        }

    def as_dict(self) -> dict[str, Any]:
        """For reports and JSON summaries."""
        tier = self.host_tier
        return {
            "compression": self.compression,
            "raw_copies": self.raw_copies,
            "compression_cache": self.compression_cache,
            "progressive_packing": self.progressive_packing,
            "encoding": self.encoding.value,
            "shared_host": self.shared_host,
            "verify_loads": self.verify_loads,
            "host_budget": self.host_budget,
            "host_tier_bytes": None if tier is None else tier.budget_bytes,
            "chosen": [choice.line() for choice in self.choices],
        }


def resolve_storage(request: StorageRequest, machine: MachineFacts) -> StoragePlan:
    """The plan for ``request`` on ``machine``, or a `StorageOptionError` (`HostBudgetError` where every host copy
    in RAM cannot fit) naming the fix. The options are checked first, then the host budget (`_resolve_tier`)."""
    _refuse_values(request)
    _refuse_combinations(request)
    tier = _resolve_tier(request, machine)
    if tier is None:
        return _plain(request, machine)
    return _under_a_tier(request, machine, tier)


def _refuse_values(request: StorageRequest) -> None:
    if request.compression not in COMPRESSION_MODES:
        raise StorageOptionError(
            f"compression={request.compression!r} is not one of {', '.join(COMPRESSION_MODES)}: "
            "pass 'lossless' or 'none'",
            Rule.COMPRESSION_MODE,
        )
    if request.raw_copies is not None and request.raw_copies not in RAW_PLACES:
        raise StorageOptionError(f"raw_copies={request.raw_copies!r} is not 'ram', 'disk' or 'none'", Rule.RAW_PLACE)


def _refuse_combinations(request: StorageRequest) -> None:
    """Combinations that cannot work whatever the machine."""
    if request.raw_copies in COMPRESSED_ONLY_PLACES and not request.compressed:
        raise StorageOptionError(
            f"raw_copies={request.raw_copies!r} keeps only compressed copies in RAM, and there are none: pass "
            "compression='lossless'",
            Rule.RAW_DISK_WITHOUT_COMPRESSION,
        )
    if request.compression_cache and not request.compressed:
        raise StorageOptionError(
            "compression_cache=True caches compressed copies, and there are none: pass compression='lossless'",
            Rule.CACHE_WITHOUT_COMPRESSION,
        )
    if request.background_encoding and not (
        request.compressed and (request.raw_copies != "ram" or request.progressive_packing is not False)
    ):
        _refuse_background_without_raw_stream()
    if request.compressed and request.shared_host:
        raise StorageOptionError(
            "compression and shared_host cannot be combined yet: pass one of them", Rule.COMPRESSION_WITH_SHARED_HOST
        )
    if request.sized_host_budget and request.shared_host:
        raise StorageOptionError(
            "host_budget cannot be combined with shared_host yet (the processes' one shared host copy is all in "
            'RAM): drop host_budget (its default, "auto", keeps the shared copy in RAM)',
            Rule.HOST_BUDGET_WITH_SHARED_HOST,
        )


def _refuse_background_without_raw_stream() -> None:
    raise StorageOptionError(
        "background_encoding=True encodes while the model streams its raw copies (from RAM, packed as it runs, or from "
        "where they wait on disk): it needs compression='lossless', and with raw_copies='ram' progressive_packing=True",
        Rule.BACKGROUND_WITHOUT_RAW_STREAM,
    )


def _ram_needed(request: StorageRequest, copies: HostCopiesSize) -> int:
    """The RAM keeping every host copy in RAM takes: the new memory packing takes plus `HOST_RESERVE_BYTES`. With
    compression and raw copies in RAM the compressed copies come on top, of sizes not known before encoding:
    counted as large as the raw ones (what they never exceed), so that auto never keeps in RAM what may not fit."""
    need = copies.new_bytes + HOST_RESERVE_BYTES
    if request.compressed and request.raw_copies not in COMPRESSED_ONLY_PLACES:
        need += copies.packed_bytes
    return need


def _resolve_tier(request: StorageRequest, machine: MachineFacts) -> HostTierPlan | None:
    """The host tier for the host budget, or None: every host copy in RAM (``None``; ``"auto"`` where they fit in
    `AUTO_HOST_SHARE` of the RAM available, or where the processes share one host copy, or where no RAM facts were
    given). ``None`` is refused when the new memory the host copies take is more than the RAM available (the kernel
    would kill the process halfway through the set-up); with compression the compressed copies are not counted,
    so the check never refuses what would fit."""
    ram, copies, asked = machine.ram, machine.host_copies, request.host_budget
    if asked is not None and not is_auto(asked):
        return HostTierPlan(parse_bytes(asked), auto=False)
    if ram is None or copies is None or request.shared_host:
        return None
    if asked is None:
        if request.raw_copies not in COMPRESSED_ONLY_PLACES and copies.new_bytes > ram.nbytes:
            raise HostBudgetError(
                f"the host copies need {format_bytes(copies.new_bytes)} of new host RAM but "
                f'{format_bytes(ram.nbytes)} is available ({ram.describe()}): leave host_budget at "auto" '
                "(--host-budget auto), the default, so that the components that do not fit wait on disk, or free "
                "host memory" + (" or raise that limit" if ram.limited else "")
            )
        return None
    if _ram_needed(request, copies) <= ram.nbytes * AUTO_HOST_SHARE:
        return None
    return HostTierPlan(machine.held_bytes + int(ram.nbytes * AUTO_HOST_SHARE), auto=True)


def _plain(request: StorageRequest, machine: MachineFacts) -> StoragePlan:
    """No host tier: every option as asked, its default where not."""
    progressive = request.progressive_packing is not False
    raw = request.raw_copies or "ram"
    if request.background_encoding and raw == "ram" and not progressive:
        _refuse_background_without_raw_stream()
    return StoragePlan(
        compression=request.compression,
        raw_copies=raw,
        compression_cache=bool(request.compression_cache),
        progressive_packing=progressive,
        encoding=_encoding(request, machine, raw, progressive),
        shared_host=request.shared_host,
        verify_loads=bool(request.verify_loads),
        host_budget=request.host_budget,
    )


def _encoding(request: StorageRequest, machine: MachineFacts, raw: str, progressive: bool) -> Encoding:
    """As asked; by default (None) between forwards on CUDA wherever it can be (compression with the raw copies in
    RAM packed progressively, or waiting on disk; no shared weights) and the encoder's room fits (known at set-up).
    On the CPU the encoder would share the cores with the forwards for minutes, so there it encodes before set-up
    returns. With ``raw_copies="none"`` only a model whose every unit waits in its weight files can stream raw while
    it is encoded (`Encoding.FILES`); set-up encodes any other one first (its units' payloads are their only copy).
    """
    if not request.compressed:
        return Encoding.NONE
    if request.background_encoding is False:
        return Encoding.AT_SET_UP
    can = (raw in COMPRESSED_ONLY_PLACES or progressive) and not request.shared_host
    if request.background_encoding is None and not (can and machine.device_kind == "cuda"):
        return Encoding.AT_SET_UP
    if raw == "none":  # a unit the weight files do not hold has no raw bytes to stream: `SetUp` decides per model
        return Encoding.FILES if request.background_encoding else Encoding.WHERE_ROOM_AND_FILES
    return Encoding.BETWEEN_FORWARDS if request.background_encoding else Encoding.WHERE_ROOM


def _under_a_tier(request: StorageRequest, machine: MachineFacts, tier: HostTierPlan) -> StoragePlan:
    """A host tier holds host memory to its budget: packed before set-up returns; with compression, compressed
    copies only, waiting on disk in their payload file, encoded as without a tier with the raw copies on disk (by
    default between forwards on CUDA where the encoder fits: `_encoding`), and on CUDA every load verified. Options
    asked otherwise are refused, naming the fix; those left to the plan are chosen and stated."""
    _refuse_under_a_tier(request, tier)
    why_tier = (
        'host_budget="auto" turned the host tier on (the host copies do not all fit in the RAM available)'
        if tier.auto
        else "a host budget"
    )
    choices = []
    if request.progressive_packing is None:
        choices.append(StorageChoice("progressive_packing", False, f"{why_tier} packs before set-up returns"))
    verify, warnings = bool(request.verify_loads), ()
    if request.compressed:
        choices += [
            StorageChoice(option, value, f"{why_tier} with compression keeps {kept}")
            for option, value, kept in (
                ("raw_copies", "none", "compressed copies only in RAM and writes no raw copy"),
                ("compression_cache", True, "the compressed copies in their payload file while on disk"),
            )
            if getattr(request, option) is None
        ]
        verify, warnings, verified = _verified_under_a_compressed_tier(request, machine)
        choices += [verified] if verified is not None else []
    raw = (request.raw_copies or "none") if request.compressed else (request.raw_copies or "ram")
    return StoragePlan(
        compression=request.compression,
        raw_copies=raw,
        compression_cache=request.compressed,
        progressive_packing=False,
        encoding=_encoding(request, machine, raw, progressive=False),
        shared_host=request.shared_host,
        verify_loads=verify,
        host_budget=request.host_budget,
        host_tier=tier,
        choices=tuple(choices),
        warnings=warnings,
    )


def _refuse_under_a_tier(request: StorageRequest, tier: HostTierPlan) -> None:
    if request.compressed:
        for option, needed in (("raw_copies", COMPRESSED_ONLY_PLACES), ("compression_cache", (True,))):
            asked = getattr(request, option)
            if asked is not None and asked not in needed:
                why = (
                    'the host copies do not all fit in the RAM available, so host_budget="auto" keeps them under a '
                    "host budget, which with compression"
                    if tier.auto
                    else "host_budget with compression"
                )
                raise StorageOptionError(
                    f"{why} keeps the compressed copies only and waits on disk in their file: drop "
                    f"{option}={asked!r} (it needs {option}={' or '.join(map(repr, needed))})",
                    Rule.TIER_KEEPS_COMPRESSED_ONLY,
                    option,
                )
    if request.progressive_packing:
        raise StorageOptionError(
            "progressive_packing=True cannot hold host memory to a host budget (it keeps a few units twice until they "
            "are used): drop progressive_packing, or pass host_budget=None (--host-budget none)",
            Rule.TIER_HOLDS_NO_SECOND_COPY,
            "progressive_packing",
        )


def _verified_under_a_compressed_tier(
    request: StorageRequest, machine: MachineFacts
) -> tuple[bool, tuple[str, ...], StorageChoice | None]:
    """A host tier with compression on a GPU verifies every load by default (see `engine.load_checks`): one
    full-size run of it was not bitwise and its cause is not found, so its outputs are checked instead of trusted.
    ``verify_loads=False`` given is kept, with a warning. On the CPU copies and decodes are synchronous, and it
    stays as asked (off by default)."""
    if machine.device_kind != "cuda":
        return bool(request.verify_loads), (), None
    if request.verify_loads is False:
        return False, (UNTRUSTED_COMPRESSED_TIER,), None
    if request.verify_loads:
        return True, (), None
    why = "a host tier with compression on a GPU checks every load on the device (one run of four was not bitwise)"
    return True, (), StorageChoice("verify_loads", True, why)
