"""Streaming offload for a whole diffusers pipeline, one budget for all components.

Every component with weights gets an `OffloadHandle` with the whole budget; only one component is
*active* (holds device memory) at a time. When a component starts computing, the one before it
releases its device memory and the new one takes its base weights, its resident units and its
slots, priming the first loads at once. Diffusers is told where inputs belong through the same
``_hf_hook.execution_device`` attribute accelerate's hooks expose, since weights of an inactive
component sit in host memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..engine import (
    CUDA_ALLOCATION_GRANULE,
    NO_COMPRESSION,
    BudgetError,
    FlexTensorError,
    HandleHooks,
    OffloadConfig,
    OffloadHandle,
    OffloadStateError,
    Phase,
    UnitDone,
    UnitLayout,
    UnsupportedTensorError,
    cache_folder,
    find_units,
    format_bytes,
    is_auto,
    is_offloaded,
    max_memory_allocated,
    offload_shared,
    plan_layout,
    refuse_whole_model_compile,
    resolve_budget,
    resolve_device,
    smallest_budget,
)
from ..storage import (
    AvailableMemory,
    HostCopiesSize,
    HostOverhead,
    HostRamDecision,
    HostTier,
    HostTierPlan,
    LastForwardForecast,
    MachineFacts,
    PayloadsOnlyHome,
    RawCacheFile,
    StoragePlan,
    StorageRequest,
    WeightFilesHome,
    anonymous_bytes,
    check_host_budget,
    component_folders,
    format_host_tier,
    kept_in_ram_bytes,
    least_compressed_bytes,
    offload_order,
    pipeline_folder,
    resolve_storage,
)
from ..storage import host_budget as budgets
from .patterns import patterns_for
from .sharing import OWNERS, EnableCall, SharedOffload, refuse_unshareable

logger = logging.getLogger(__name__)

#: Below this budget VAE tiling is switched on by ``vae_tiling=None`` (decode activations of a
#: 81-frame 832x480 Wan video do not fit comfortably in a 24 GB card without it).
VAE_TILING_BELOW = 40 * 2**30
#: Entry points of components whose work is not done by ``forward``: each is a planned workload.
ENTRY_METHODS = ("encode", "decode")
#: Methods of diffusers models that change weights in place; they run inside ``handle.editing()``
#: so that the change reaches the host copies (a LoRA fused while its component is active is kept).
EDIT_METHODS = (
    "load_state_dict",
    "fuse_lora",
    "unfuse_lora",
    "load_lora_adapter",
    "add_adapter",
    "delete_adapters",
    "unload_lora",
)
#: Called by diffusers pipelines at the end of every generation: where shortfalls are reported.
END_OF_GENERATION = "maybe_free_model_hooks"
#: Refused while offload is enabled: it would move weights whose host copies and device slots offload owns.
MOVE = "to"
#: Pipeline methods that write the weights of the components they are given themselves, not through those
#: components' edit methods (diffusers' ``unfuse_lora`` unmerges each adapter layer, ``weight.data -= ...``, which no
#: version counter sees; ``fuse_lora`` merges a text encoder's so): run per component inside its ``editing()``.
PIPELINE_EDIT_METHODS = ("fuse_lora", "unfuse_lora")


class _ExecutionDevice:
    """Answers diffusers' ``component._hf_hook.execution_device`` question, as accelerate's hooks do."""

    def __init__(self, device: torch.device) -> None:
        self.execution_device = device


@dataclass
class PipelineOffload:
    """The handles of one pipeline, and what must be undone when offload is disabled."""

    pipeline: Any
    device: torch.device
    budget_bytes: int
    handles: dict[str, OffloadHandle] = field(default_factory=dict)
    vae_tiling: bool = False
    moved: dict[str, torch.device] = field(default_factory=dict)  # components not handled, moved whole
    switches: int = 0
    host_tier: HostTier | None = None
    last_forward: LastForwardForecast | None = None  # with a host tier, for a pipeline with two experts
    host_ram: HostRamDecision | None = None  # the RAM available at enable, and what the host budget kept in RAM
    storage: StoragePlan | None = None  # how the host copies are kept, and what the plan chose for options left to it
    call: EnableCall = field(default_factory=EnableCall)  # what `enable` was asked: a pipeline asking the same joins
    joined: list[Any] = field(default_factory=list)  # pipelines made from the same components, sharing this offload

    def forward_begins(self, handle: OffloadHandle, on_plan: bool) -> UnitDone | None:
        """Each forward of a component: the host tier hands its RAM over when the forward is expected to be its
        last before the other expert's (`LastForwardForecast`; every forward is counted)."""
        if self.last_forward is None:
            return None
        name = next(n for n, h in self.handles.items() if h is handle)
        if not self.last_forward.is_last(name) or not on_plan or self.host_tier is None:
            return None
        return self.host_tier.hand_over(handle)

    def activate(self, handle: OffloadHandle) -> None:
        """Called before ``handle`` takes device memory: every other component gives its memory back."""
        for other in self.handles.values():
            if other is not handle and other.active:
                other.release()
                self.switches += 1
        if self.host_tier is not None:
            self.host_tier.bring_in(handle)

    def __repr__(self) -> str:
        """One line (the generated repr printed the pipeline and every handle, ~40 lines in a REPL)."""
        names = ", ".join(self.handles) or "none: disabled"
        return (
            f"<flextensor offload of {type(self.pipeline).__name__} on {self.device}, budget "
            f"{format_bytes(self.budget_bytes)}, components: {names}; pipe.flextensor_report(as_text=True) for more>"
        )

    def components(self) -> dict[str, nn.Module]:
        """Every component with weights: those offloaded, and those moved to the device whole."""
        return {
            **{name: h.model for name, h in self.handles.items()},
            **{n: getattr(self.pipeline, n) for n in self.moved},
        }

    def join(self, pipeline: Any, call: EnableCall) -> None:
        """``pipeline``, made from this offload's components and asking the same options, shares it (see
        `sharing`); refused otherwise, before anything changes."""
        SharedOffload(self, _weighted_components(pipeline), call).check()
        _guard(pipeline, self)
        self.joined.append(pipeline)
        pipeline._flextensor = self
        logger.info("%s shares the offload of %s's components", type(pipeline).__name__, type(self.pipeline).__name__)

    def smallest_budget(self) -> int:
        """The least budget every component can run in: the largest of their minimums (measured
        activations where profiled, else weights outside units + 2 slots)."""
        return max((h.smallest_budget() for h in self.handles.values()), default=0)

    def budget_error(self) -> BudgetError | None:
        """One `BudgetError` for every component whose profiled workload exceeds the budget, naming the smallest
        budget for the whole pipeline (measured activations where profiled, set-up minimums elsewhere); None when
        none does.

        Every component asks it as each of its workload calls begins (`HandleHooks.budget_refusal`), so a
        shortfall measured by a component's profiling forward, inside the generation the user asked for, refuses
        the very next forward of any component: the generation stops in the step that measured it, not at its end,
        and the model is left as it was (offload enabled; disable restores every weight). It is asked at the end
        of every generation too (`_at_end_of_generation`), for a component profiled by its last forward."""
        short = {name: h.shortfall for name, h in self.handles.items() if h.shortfall is not None}
        if not short:
            return None
        needs = {name: exc.required_bytes or 0 for name, exc in short.items()}
        need = max(*needs.values(), self.smallest_budget())
        return pipeline_budget_error(
            self.budget_bytes, need, needs, "weights outside blocks + 2 slots + measured activations", workload=True
        )

    def check_budget(self) -> None:
        """Raise `budget_error`, if any."""
        error = self.budget_error()
        if error is not None:
            raise error

    def check_loads(self) -> None:
        """With ``verify_loads``: raise `LoadCheckError` when a component computed with bytes that are not its
        weights (waits for the comparisons enqueued so far; see `load_checks`)."""
        for handle in self.handles.values():
            if handle.load_checks is not None:
                handle.load_checks.raise_faults(type(handle.model).__name__, wait=True)

    def report(self) -> dict[str, Any]:
        components = {}
        for name, handle in self.handles.items():
            stats, places = handle.stats(), handle.host.where()
            streamed = [u for u in stats.units if u.placement.startswith("slot")]
            components[name] = {
                "class": type(handle.model).__name__,
                "patterns": handle.config.include_patterns,
                "phase": stats.phase,
                "units": len(stats.units),
                "resident_weight_bytes": stats.resident_weight_bytes
                + sum(u.nbytes for u in stats.units if u.placement == "resident"),
                "streamed_units": len(streamed),
                "streamed_unit_bytes": sum(u.nbytes for u in streamed),
                "bytes_streamed": stats.bytes_streamed,
                "stall_ms": round(stats.stall_ms, 3),
                "copy_ms": round(stats.copy_ms, 3),
                "decode_ms": round(stats.decode_ms, 3),
                "between_units_ms": round(stats.between_units_ms, 3),
                "overlap_pct": None if stats.overlap_pct is None else round(stats.overlap_pct, 2),
                "forwards": stats.forwards,
                "plan": stats.plan,
                "host": places.label,
                "host_places": dataclasses.asdict(places),  # RAM raw / compressed, disk, arriving
                "unit_bytes": stats.unit_bytes,
                "transfer_unit_bytes": stats.transfer_unit_bytes,
                "payload_cache": stats.payload_cache,  # compression_cache: read, written or refused, and where
                # with compression: per unit, its payload's ratio, or raw and why (quantized bytes are not coded)
                "unit_compression": {u.name: u.compression for u in stats.units if u.compression is not None} or None,
                # host copies in RAM now (raw copies, and compressed copies where kept)
                "host_ram_bytes": handle.host.host_ram_bytes,
                "load_checks": _load_checks_record(handle),  # verify_loads: comparisons made, faults found
            }
        cuda = self.device.type == "cuda"
        return {
            "device": str(self.device),
            "budget_bytes": self.budget_bytes,
            # the true peak: the profiling forwards' resets of torch's counter folded in (`engine.peaks`)
            "peak_allocated_bytes": max_memory_allocated(self.device) if cuda else None,
            "vae_tiling": self.vae_tiling,
            "component_switches": self.switches,
            # what the process holds in host RAM now, anonymous and page-locked (what a host budget bounds)
            "process_host_bytes": anonymous_bytes(),
            "host_ram": self.host_ram.as_dict() if self.host_ram is not None else None,
            "storage": self.storage.as_dict() if self.storage is not None else None,
            "host_tier": self.host_tier.report() if self.host_tier is not None else None,
            "components": components,
        }

    def disable(self) -> None:
        """Remove every handle (weights bit-exact, back where they were) and undo the wrappers."""
        if self.host_tier is not None:
            self.host_tier.stop()  # no read ahead while handles go
        for pipeline in [self.pipeline, *self.joined]:
            for name in (END_OF_GENERATION, MOVE, *PIPELINE_EDIT_METHODS):
                if name in vars(pipeline):
                    delattr(pipeline, name)
        for name, handle in self.handles.items():
            module = handle.model
            if isinstance(getattr(module, "_hf_hook", None), _ExecutionDevice):
                del module._hf_hook
            if handle.phase is not Phase.REMOVED:
                handle.remove()
            logger.debug("removed offload of %s", name)
        for name, origin in self.moved.items():
            getattr(self.pipeline, name).to(origin)
        if self.vae_tiling and hasattr(self.pipeline, "vae") and hasattr(self.pipeline.vae, "disable_tiling"):
            self.pipeline.vae.disable_tiling()
        self.handles = {}
        if self.host_tier is not None:
            self.host_tier.close()
        for pipeline in [self.pipeline, *self.joined]:  # offload is disabled for every pipeline that shared it
            if getattr(pipeline, "_flextensor", None) is self:
                pipeline._flextensor = None
        self.joined = []
        OWNERS.release(self)


COMPONENT_LEGEND = (
    "units: blocks streamed / blocks found (0/0: no repeated blocks, the component moves whole)\n"
    "overlap: share of copy time hidden behind compute (blank: nothing was streamed)\n"
    "host RAM: host copies in RAM now (raw ones unless they wait on disk, and compressed ones where kept)\n"
    "waits: where the host copies are: RAM, or disk (being read back: arriving); +z: compressed copies in RAM too;\n"
    "  ' z': compressed copies only, the raw ones wait in the weight files, or nowhere (the compressed copy is the\n"
    "  host copy, raw_copies='none'), or in a cache file (raw_copies='disk')\n"
    "link: bytes compressed loads of the blocks move / the blocks' bytes (1.00: not compressed; the plan may\n"
    "  load some raw when that is faster or fits the budget better)\n"
    "switches: times the active component changed (the previous one gives its GPU memory back)"
)


def format_report(report: dict[str, Any]) -> str:
    """The offload report as an aligned table (columns as wide as their longest cell) with a legend."""
    peak = report["peak_allocated_bytes"]
    head = ("component", "class", "resident", "streamed", "units", "host RAM", "waits", "link", "stall ms")
    head += ("overlap", "phase")
    rows = [head]
    for name, c in report["components"].items():
        overlap = "" if c["overlap_pct"] is None else f"{c['overlap_pct']:.1f}%"
        rows.append(
            (
                name,
                c["class"],
                format_bytes(c["resident_weight_bytes"]),
                format_bytes(c["streamed_unit_bytes"]),
                f"{c['streamed_units']}/{c['units']}",
                format_bytes(c["host_ram_bytes"]),
                _waits(c["host_places"]),
                f"{c['transfer_unit_bytes'] / c['unit_bytes']:.2f}" if c["unit_bytes"] else "",
                f"{c['stall_ms']:.1f}",
                overlap,
                c["phase"],
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    left = {0, 1, len(head) - 1}  # names left-aligned, numbers right-aligned
    lines = [
        f"device {report['device']}  budget {format_bytes(report['budget_bytes'])}  "
        f"peak allocated {format_bytes(peak) if peak is not None else 'n/a'}  "
        f"VAE tiling {'on' if report['vae_tiling'] else 'off'}  switches {report['component_switches']}  "
        f"process host memory {format_bytes(report['process_host_bytes'])}"
    ]
    if report.get("host_ram"):
        lines.append(
            f"RAM available at enable {format_bytes(report['host_ram']['ram_available']['bytes'])}: "
            + report["host_ram"]["described"]
        )
    chosen = (report.get("storage") or {}).get("chosen")
    if chosen:  # options left to the storage plan, set by it (e.g. by a host budget), and why
        lines.append("storage plan chose: " + "; ".join(chosen))
    tier = report.get("host_tier")
    if tier:
        lines += format_host_tier(tier)
    for row in rows:
        cells = [
            cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    verified = {name: c["load_checks"] for name, c in report["components"].items() if c.get("load_checks")}
    if verified:  # verify_loads: how many calls' bytes were compared, and any fault (which raised already)
        said = [f"{name} {v['checks']} compared, {len(v['faults']) or 'no'} fault(s)" for name, v in verified.items()]
        lines.append("verified loads: " + "; ".join(said))
    lines.append(COMPONENT_LEGEND)
    return "\n".join(lines)


def _waits(places: dict[str, Any]) -> str:
    """Where a component's host copies are, in a word (`HostPlaces`)."""
    where = "arriving" if places["arriving"] else "disk" if places["disk_bytes"] else "RAM"
    if places.get("raw_disk_bytes") or places.get("payloads_only_bytes"):
        return where + " z"
    return where + ("+z" if places["ram_compressed_bytes"] else "")


def _weighted_components(pipeline: Any) -> dict[str, nn.Module]:
    return {
        name: module
        for name, module in pipeline.components.items()
        if isinstance(module, nn.Module) and any(True for _ in module.parameters())
    }


def resolve_vae_tiling(vae_tiling: bool | None, budget_bytes: int) -> bool:
    """Whether a run under ``budget_bytes`` uses diffusers' VAE tiling: as asked, else on below 40 GiB.

    A native run that is compared with an offloaded one must make the same choice: tiled and
    untiled VAE passes give different pixels (and different latents where the VAE encodes inputs).
    """
    return bool(vae_tiling) if vae_tiling is not None else budget_bytes < VAE_TILING_BELOW


def enable(
    pipeline: Any,
    budget: int | str = "auto",
    profile_dir: str | Path | None = None,
    device: str | torch.device | None = None,
    components: list[str] | None = None,
    patterns: dict[str, list[str]] | None = None,
    vae_tiling: bool | None = None,
    shared_host: str | None = None,
    shared_host_root: str | Path = "/dev/shm",
    host_budget: int | str | None = "auto",
    cache_dir: str | Path | None = None,
    compression: str = NO_COMPRESSION,
    raw_copies: str | None = None,
    compression_cache: bool | None = None,
    progressive_packing: bool | None = None,
    background_encoding: bool | None = None,
    verify_loads: bool | None = None,
    **config: Any,
) -> PipelineOffload:
    """Stream every component of ``pipeline`` from host memory under one GPU ``budget`` (bytes, ``"24GiB"`` or
    ``"auto"``; it bounds peak allocated memory).

    ``profile_dir``: per-component profiles, reused by a later run with the same model, device and shapes.
    ``device``: default CUDA when available, else the CPU. ``components``: those to wrap (default: all with
    weights; the others move to the device whole); ``patterns``: per-component include patterns overriding the
    built-in ones. ``vae_tiling``: ``None`` turns it on below 40 GiB of budget. ``shared_host``: a namespace:
    every process of a ``torch.distributed`` job on this host streams from one host copy in ``shared_host_root``
    (`offload_shared`; ranks that attach build their pipeline on the meta device). ``cache_dir``: where cache files
    go (default: this user's cache folder, made 0700; refused when a link, another user's or writable by others).
    ``host_budget`` and the storage options (``compression`` to ``verify_loads``; ``None``: the plan's choice) are
    documented in `storage.plan.StorageRequest` and resolved once (`resolve_storage`); what the plan chose is logged
    and in the report. ``**config``: the engine's tuning fields of `OffloadConfig`, passed to every component as
    given (``max_slots``, ``profiling_runs``, ``pin_memory``, ``exclude_patterns``, ``activation_margin``...).

    Everything is checked before anything is packed; a failure after that undoes all of it, leaving the pipeline
    as it was. A pipeline made from another offloaded one's components shares its offload when it asks the same.
    """
    asked = StorageRequest(
        compression=compression,
        raw_copies=raw_copies,
        compression_cache=compression_cache,
        progressive_packing=progressive_packing,
        background_encoding=background_encoding,
        verify_loads=verify_loads,
        shared_host=shared_host is not None,
        host_budget=host_budget,
    )
    paths = {"profile_dir": profile_dir, "shared_host_root": shared_host_root, "cache_dir": cache_dir}
    where = dict(budget=budget, host_budget=host_budget, device=device, components=components, patterns=patterns)
    call = EnableCall.of(**where, **paths, vae_tiling=vae_tiling, shared_host=shared_host, **asked.keywords(), **config)
    joined = _join_an_offload(pipeline, call)
    if joined is not None:
        return joined
    ram = budgets.available_ram()  # read once: every decision and message from RAM below takes this figure
    request = OffloadRequest.resolve(pipeline, where, paths, shared_host, config, asked, ram)
    state = _pipeline_offload(request, ram, call)
    _offload_components(state, request, vae_tiling)
    return state


def _machine_facts(
    device: torch.device, ram: AvailableMemory, packed: dict[str, int], available: dict[str, nn.Module]
) -> MachineFacts:
    """What the storage plan decides from, measured now, before anything is packed: the device, the RAM available
    (``ram``), the process's anonymous memory and what packing every host copy (``packed``) into RAM would take."""
    modules = [available[name] for name in packed]
    copies = HostCopiesSize(sum(packed.values()), budgets.new_host_bytes(packed, modules))
    return MachineFacts(device.type, ram=ram, held_bytes=budgets.anonymous_bytes(), host_copies=copies)


def _pipeline_offload(request: OffloadRequest, ram: AvailableMemory, call: EnableCall) -> PipelineOffload:
    """The pipeline's offload state before any component is packed: the host tier the storage plan asks for
    (refused here when under the smallest workable one), what the host budget kept in RAM, and the choices the
    plan made for options left to it, logged."""
    plan = request.storage
    for choice in plan.choices:
        logger.info("storage plan: %s", choice.line())
    for warning in plan.warnings:
        logger.warning(warning)
    tier = _host_tier(request, plan.host_tier, ram) if plan.host_tier is not None else None
    state = PipelineOffload(
        pipeline=request.pipeline,
        device=request.device,
        budget_bytes=request.budget_bytes,
        host_tier=tier,
        call=call,
        storage=plan,
    )
    state.host_ram = _host_ram_decision(request, ram, tier)
    if tier is not None and LastForwardForecast.applies_to(request.pipeline):
        state.last_forward = LastForwardForecast(request.pipeline)
    return state


def _offload_components(state: PipelineOffload, request: OffloadRequest, vae_tiling: bool | None) -> None:
    """Pack every chosen component (under a host tier in the order that leaves in RAM what runs first), move the
    others whole, then VAE tiling and the guards; any failure undoes all of it, leaving the pipeline as it was."""
    pipeline, tier = request.pipeline, state.host_tier
    try:
        for name in packing_order(request.chosen, offload_order(pipeline) if tier is not None else []):
            _offload_component(state, request, name)
        if tier is not None:
            tier.check_fits()
        _move_the_rest(state, request)
        _finish(state, vae_tiling)
    except BaseException:
        state.disable()
        raise
    pipeline._flextensor = state
    for module in state.components().values():
        OWNERS.claim(module, state)


def _join_an_offload(pipeline: Any, call: EnableCall) -> PipelineOffload | None:
    """The offload of another pipeline that ``pipeline``'s components belong to, joined (see `sharing`); None when
    they belong to none, or when offload is enabled on ``pipeline`` already (refused by `OffloadRequest.resolve`)."""
    if getattr(pipeline, "_flextensor", None) is not None:
        return None
    weighted = _weighted_components(pipeline)
    owners = OWNERS.owners(weighted)
    refuse_unshareable(owners, weighted)
    if not owners:
        return None
    owners[0].join(pipeline, call)
    return owners[0]


def packing_order(chosen: list[str], declared: list[str]) -> list[str]:
    """The components in the order to pack them: those the pipeline declares it runs last (``declared``, its
    ``model_cpu_offload_seq``) first. Under a host tier, what does not fit is moved out least recently packed first,
    so that the component a generation runs first is packed last and is still in RAM when it runs (packed in the
    order given, Wan2.2's first expert was moved out for the second and read back at the first step). Components
    not declared come before all others; without ``declared``, the order given."""
    rank = {name: i for i, name in enumerate(declared)}
    return sorted(chosen, key=lambda name: -rank.get(name, len(declared)))


def packed_bytes(layouts: dict[str, UnitLayout]) -> dict[str, int]:
    """Each component's packed host bytes (its base and its units), by name."""
    return {name: layout.base.nbytes + sum(u.nbytes for u in layout.units) for name, layout in layouts.items()}


@dataclass(frozen=True)
class OffloadRequest:
    """What `enable` was asked, resolved and checked before anything is packed: the components to wrap
    (``chosen``, among every component with weights, ``available``), their include patterns and packed host
    bytes, the device and the GPU budget in bytes, the storage plan, and the engine's further `OffloadConfig`
    fields each component takes."""

    pipeline: Any
    available: dict[str, nn.Module]
    chosen: list[str]
    includes: dict[str, list[str]]
    layouts: dict[str, UnitLayout]  # each chosen component's units, laid out once here and handed to its handle
    device: torch.device
    budget_bytes: int
    profile_dir: str | Path | None
    cache_dir: str | Path | None
    shared_host: str | None
    shared_host_root: str | Path
    storage: StoragePlan  # how the host copies are kept, and the host tier (`storage.plan.resolve_storage`)
    config: dict[str, Any]  # further `OffloadConfig` fields, the engine's tuning

    @property
    def packed(self) -> dict[str, int]:
        """Each chosen component's packed host bytes: what the host tier makes room for."""
        return packed_bytes(self.layouts)

    @classmethod
    def resolve(
        cls,
        pipeline: Any,
        where: dict[str, Any],
        paths: dict[str, Any],
        shared_host: str | None,
        config: dict[str, Any],
        asked: StorageRequest,
        ram: AvailableMemory,
    ) -> OffloadRequest:
        """Refuse a pipeline already offloaded, unknown component names, a budget under any component's set-up
        minimum (from the architecture alone) and storage options that cannot be combined, before anything is
        packed or moved. ``where``: `enable`'s budget, device, components and patterns; ``paths``: its folders."""
        if getattr(pipeline, "_flextensor", None) is not None:
            raise OffloadStateError("flextensor offload is already enabled on this pipeline: disable it first")
        available = _weighted_components(pipeline)
        components, patterns = where["components"], where["patterns"] or {}
        chosen = list(available) if components is None else list(components)
        unknown = [c for c in chosen + list(patterns) if c not in available]
        if unknown:
            raise FlexTensorError(
                f"unknown component(s) {', '.join(map(repr, unknown))}; this {type(pipeline).__name__} has "
                f"{', '.join(available)}"
            )
        offloaded = [name for name in chosen if is_offloaded(available[name])]
        if offloaded:  # its tensors view host copies: laid out again, they would look like one shared storage
            raise OffloadStateError(
                f"component(s) {', '.join(map(repr, offloaded))} are offloaded already, with a handle of their own: "
                "call remove() on that handle first"
            )
        device = resolve_device(where["device"])
        budget_bytes = resolve_budget(where["budget"], device)
        includes = _includes(available, chosen, patterns)
        shared = shared_host is not None  # processes that attach build their pipeline on the meta device
        excludes = list(config.get("exclude_patterns", []))
        layouts = _check_setup_budgets(
            available, includes, budget_bytes, device, canonical=shared, meta_ok=shared, excludes=excludes
        )
        storage = resolve_storage(asked, _machine_facts(device, ram, packed_bytes(layouts), available))
        return cls(
            pipeline=pipeline,
            available=available,
            chosen=chosen,
            includes=includes,
            layouts=layouts,
            device=device,
            budget_bytes=budget_bytes,
            shared_host=shared_host,
            storage=storage,
            config=config,
            **paths,
        )

    def component_config(self, name: str) -> OffloadConfig:
        """``name``'s `OffloadConfig`: its patterns, the whole budget, its own profile folder, the entry and
        edit methods its module has, the storage plan's options; nothing on the device until the component runs."""
        module = self.available[name]
        return OffloadConfig(
            include_patterns=self.includes[name],
            gpu_budget=self.budget_bytes,
            device=self.device,
            profile_dir=Path(self.profile_dir) / name if self.profile_dir is not None else None,
            entry_methods=[m for m in ENTRY_METHODS if callable(getattr(module, m, None))],
            edit_methods=[m for m in EDIT_METHODS if callable(getattr(module, m, None))],
            cache_dir=self.cache_dir,
            active_after_setup=False,  # nothing on the device until the component runs
            **self.storage.config_options(),
            **self.config,
        )


def _host_ram_decision(request: OffloadRequest, ram: AvailableMemory, tier: HostTier | None) -> HostRamDecision:
    """What the report says of the RAM available and of what the host budget kept in RAM; logged where
    ``"auto"`` turned the host tier on (the process asks for no more than that RAM, and runs slower)."""
    plan = request.storage
    decision = HostRamDecision(
        ram=ram,
        asked=repr("auto") if is_auto(plan.host_budget) else repr(plan.host_budget),
        packed_bytes=sum(request.packed.values()),
        tier_budget_bytes=None if tier is None else tier.budget,
        tier_weights_bytes=None if tier is None else tier.weights_budget,
    )
    if plan.host_tier is not None and plan.host_tier.auto:
        logger.info("%s", decision.describe())
    return decision


def _host_tier(request: OffloadRequest, plan: HostTierPlan, ram: AvailableMemory) -> HostTier:
    """The host tier the storage plan asks for, refused before anything is packed when it is under the smallest
    workable one (naming ``ram``, the RAM available, where ``"auto"`` made it). The process's own memory is
    measured now, before packing turns weights into host copies."""
    root = pipeline_folder(request.pipeline)
    packed, available = request.packed, request.available
    overhead = HostOverhead.measure(available[n] for n in packed)  # before packing: the process's own memory
    kept = {n: kept_in_ram_bytes(n, available[n], root) for n in packed}
    compressed = request.storage.compressed
    if compressed:  # sizes known once encoded: the least they can be
        packed = {n: least_compressed_bytes(layout) for n, layout in request.layouts.items()}
    check_host_budget(plan.budget_bytes, packed, overhead, kept, compressed, ram if plan.auto else None)
    pin = request.device.type == "cuda" and request.config.get("pin_memory", True)
    return HostTier(
        budget=plan.budget_bytes,
        folder=cache_folder(request.cache_dir),
        pin=pin,
        overhead=overhead,
        weights_root=root,
        order=offload_order(request.pipeline),
    )


def _offload_component(state: PipelineOffload, request: OffloadRequest, name: str) -> None:
    """Pack ``name`` into its handle (the host tier first makes room for its host copies) and route its
    activation through ``state``, so that only one component holds device memory at a time."""
    module = request.available[name]
    cfg = request.component_config(name)
    tier = state.host_tier
    if tier is not None:
        tier.room_for_packing(request.packed[name])
    on_forward = state.forward_begins if state.last_forward is not None else None
    # any component over budget refuses every component's next call
    room = tier.encoding_room if tier is not None else None  # payloads made between forwards: within the budget
    hooks = HandleHooks(
        on_activate=state.activate, on_forward=on_forward, budget_refusal=state.budget_error, encoding_room=room
    )
    try:
        if request.shared_host is None:
            home = _raw_home(name, module, request) if cfg.compressed_only else None
            handle = OffloadHandle(module, cfg, request.layouts[name], home, hooks)  # laid out when checked
        else:
            root = request.shared_host_root
            handle = offload_shared(module, cfg, f"{request.shared_host}-{name}", root=root, hooks=hooks)
    except BudgetError as exc:
        raise BudgetError(f"component {name!r}: {exc}", required_bytes=exc.required_bytes) from exc
    state.handles[name] = handle
    if tier is not None:
        tier.add(name, handle)
    module._hf_hook = _ExecutionDevice(request.device)


def _raw_home(name: str, module: nn.Module, request: OffloadRequest) -> WeightFilesHome | None:
    """Where ``name``'s raw bytes wait when RAM keeps compressed copies only: the weight files it was loaded
    from, units they do not hold keeping their payload only (``raw_copies="none"``) or going to a cache file
    (``"disk"``); None for a component with no local folder (the engine then does the same with all of them)."""
    folders = component_folders(name, module, pipeline_folder(request.pipeline))
    if not folders:
        return None
    if request.storage.raw_copies == "none":
        return WeightFilesHome(name, folders, PayloadsOnlyHome())
    layout = request.layouts[name]
    path = cache_folder(request.cache_dir) / f"{name}-{os.getpid()}-{id(module):x}.raw"
    return WeightFilesHome(name, folders, RawCacheFile(path, [layout.base, *layout.units]))


def _move_the_rest(state: PipelineOffload, request: OffloadRequest) -> None:
    """Components with weights that are not wrapped move to the device whole (moved back on disable)."""
    for name, module in request.available.items():
        if name not in state.handles:
            state.moved[name] = next(module.parameters()).device
            module.to(request.device)


def _finish(state: PipelineOffload, vae_tiling: bool | None) -> None:
    """VAE tiling as asked (else by budget), shortfalls checked at the end of every generation, and
    ``pipe.to`` refused while offload is enabled; `PipelineOffload.disable` undoes each."""
    pipeline = state.pipeline
    vae = getattr(pipeline, "vae", None)
    state.vae_tiling = resolve_vae_tiling(vae_tiling, state.budget_bytes)
    if state.vae_tiling and vae is not None and hasattr(vae, "enable_tiling"):
        vae.enable_tiling()
        logger.info("VAE tiling on (budget %s)", format_bytes(state.budget_bytes))
    else:
        state.vae_tiling = False
    _guard(pipeline, state)


def _guard(pipeline: Any, state: PipelineOffload) -> None:
    """Shortfalls checked (and the host tier told) at the end of every generation of ``pipeline``, ``pipeline.to``
    refused, and its LoRA fuse and unfuse run inside the components' ``editing()``."""
    if callable(getattr(pipeline, END_OF_GENERATION, None)):
        setattr(pipeline, END_OF_GENERATION, _at_end_of_generation(getattr(pipeline, END_OF_GENERATION), state))
    setattr(pipeline, MOVE, _refuse_move)
    for name in PIPELINE_EDIT_METHODS:
        if callable(getattr(pipeline, name, None)):
            setattr(pipeline, name, _editing_each(getattr(pipeline, name), state))


def _editing_each(method: Any, state: PipelineOffload) -> Any:
    """A pipeline edit method (`PIPELINE_EDIT_METHODS`) called once per component it is given, each call inside that
    component's ``editing()``: the edit reaches its host copies and every copy made from them (outside it, with
    compression, the payloads kept the weights as they were before the edit: outputs silently wrong), and, with
    payloads only, one component at a time has its weights decoded into RAM."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        components = list(bound.arguments.get("components") or [])
        if not components:
            return method(*args, **kwargs)  # diffusers' own refusal
        for name in components:
            bound.arguments["components"] = [name]
            handle = state.handles.get(name)
            with handle.editing() if handle is not None else contextlib.nullcontext():
                result = method(*bound.args, **bound.kwargs)
        return result

    return call


def _includes(
    available: dict[str, nn.Module], chosen: list[str], patterns: dict[str, list[str]]
) -> dict[str, list[str]]:
    return {name: patterns[name] if name in patterns else patterns_for(name, available[name]) for name in chosen}


def check_setup_budget(
    pipeline: Any, budget_bytes: int, device: torch.device, patterns: dict[str, list[str]] | None = None
) -> None:
    """Refuse ``budget_bytes`` when a component cannot stream in it on ``device``, from the architecture alone:
    ``pipeline`` may be built on the meta device, so a command line can check before loading weights."""
    available = _weighted_components(pipeline)
    _check_setup_budgets(available, _includes(available, list(available), patterns or {}), budget_bytes, device)


def _check_setup_budgets(
    components: dict[str, nn.Module],
    includes: dict[str, list[str]],
    budget: int,
    device: torch.device,
    canonical: bool = False,
    meta_ok: bool = True,
    excludes: list[str] | None = None,
) -> dict[str, UnitLayout]:
    """Refuse a budget under any component's set-up minimum before anything is packed, naming the
    smallest budget for the whole pipeline (every component gets the whole budget). Returns each
    component's unit layout for ``device``, as `OffloadHandle` makes it (``canonical``: for shared host
    memory; ``meta_ok``: weights on the meta device allowed, as when only the architecture is checked).

    Whole-model compilation is refused here for every component before any is offloaded, so that a refusal
    never leaves a half-offloaded pipeline (`OffloadHandle` refuses it too, for direct users)."""
    needs, layouts = {}, {}
    granule = CUDA_ALLOCATION_GRANULE if device.type == "cuda" else 1
    for name, patterns in includes.items():
        module = components[name]
        refuse_whole_model_compile(module)
        units = find_units(module, patterns, excludes or [])
        try:
            layout = plan_layout(module, units, device, meta_ok=meta_ok, canonical=canonical)
        except UnsupportedTensorError as exc:  # a weight it cannot stream: the others can go without this one
            others = [other for other in includes if other != name]
            raise UnsupportedTensorError(f"{name}: {exc}; or offload the others only: components={others!r}") from exc
        needs[name] = smallest_budget(layout.resident_bytes, [u.nbytes for u in layout.units], granule=granule)
        layouts[name] = layout
    short = {name: need for name, need in needs.items() if need > budget}
    if short:
        raise pipeline_budget_error(budget, max(needs.values()), short, "weights outside blocks + 2 slots")
    return layouts


def pipeline_budget_error(
    budget: int, need: int, short: dict[str, int], rule: str, workload: bool = False
) -> BudgetError:
    """One error for every component ``short`` of ``budget``, naming the whole pipeline's smallest budget."""
    parts = ", ".join(f"{name} {format_bytes(n)}" for name, n in short.items())
    fix = ", or shrink the workload (fewer frames, smaller resolution, VAE tiling)" if workload else ""
    return BudgetError(
        f"budget {format_bytes(budget)} is too small: the smallest workable budget for the whole pipeline is "
        f"{format_bytes(need)} ({rule}; short: {parts}). Raise the budget to at least {format_bytes(need)}{fix}",
        required_bytes=need,
    )


def _refuse_move(*args: Any, **kwargs: Any) -> Any:
    """``pipe.to(...)`` while offload is enabled: refused, naming the fix (`PipelineOffload.disable` removes this)."""
    raise OffloadStateError(
        "pipe.to(...) while flextensor offload is enabled would move weights that offload keeps in host memory and "
        "streams to the device: call pipe.disable_flextensor_offload() first, then move the pipeline"
    )


def _load_checks_record(handle: OffloadHandle) -> dict[str, Any] | None:
    """``verify_loads``: how many comparisons were made and the faults found (None when not verifying)."""
    if handle.load_checks is None:
        return None
    summary = handle.load_checks.summary()
    return {"checks": summary.checks, "faults": [fault.line() for fault in summary.faults]}


def _at_end_of_generation(end_of_generation: Any, state: PipelineOffload) -> Any:
    """Diffusers' end-of-generation call, followed by the host tier's `HostTier.generation_ended`,
    `PipelineOffload.check_loads` (a wrong load refuses the output) and `PipelineOffload.check_budget`."""

    @functools.wraps(end_of_generation)
    def call(*args: Any, **kwargs: Any) -> Any:
        result = end_of_generation(*args, **kwargs)
        if state.host_tier is not None:
            state.host_tier.generation_ended()
        state.check_loads()
        state.check_budget()
        return result

    return call


class FlexTensorPipelineMixin:
    """Adds streaming offload to a diffusers pipeline class (also attached to ``DiffusionPipeline``)."""

    enable_flextensor_offload = enable

    def flextensor_report(self, as_text: bool = False) -> dict[str, Any] | str:
        """Per component: resident and streamed bytes, stalls, overlap, plan; pipeline peak memory."""
        state = getattr(self, "_flextensor", None)
        if state is None:
            raise OffloadStateError("flextensor offload is not enabled on this pipeline")
        report = state.report()
        return format_report(report) if as_text else report

    def disable_flextensor_offload(self) -> None:
        """Undo `enable_flextensor_offload`: every weight back, bit-exact, where it was."""
        state = getattr(self, "_flextensor", None)
        if state is None:
            raise OffloadStateError("flextensor offload is not enabled on this pipeline")
        state.disable()
        self._flextensor = None


def pipeline_offload(pipeline: Any) -> PipelineOffload | None:
    """The offload state of ``pipeline`` (its handles, host tier and report), or None when offload is not
    enabled: the public way to look at what `enable` set up (it returns the same object)."""
    return getattr(pipeline, "_flextensor", None)


def attach_to_diffusers() -> bool:
    """Give ``diffusers.DiffusionPipeline`` the mixin's methods; pipelines that never call them are unchanged."""
    try:
        from diffusers import DiffusionPipeline
    except ImportError:  # pragma: no cover - diffusers is a dependency
        return False
    for name in ("enable_flextensor_offload", "flextensor_report", "disable_flextensor_offload"):
        if not hasattr(DiffusionPipeline, name):
            setattr(DiffusionPipeline, name, getattr(FlexTensorPipelineMixin, name))
    return True
