"""Issue 47: quantized weights streamed under a budget, bitwise equal to the same weights run natively.

``stack``: the 40 Wan2.2-A14B blocks of `bench_common.build_stack` at 17 frames 480x272 under a 2.8 GB budget, one
row per form of the weights (``--rows``; `REPRESENTATIONS`), against native with the same form. The weights are made
on the GPU (seed 0) and converted there; native forwards run there (median of ``--reps`` after one warm-up); then
the same module moves to the CPU, is offloaded (the package packs from host memory), warmed up through discovery
and profiling, and timed alike. ``step_s`` is one forward of the stack; outputs are compared with ``torch.equal``;
the peak covers set-up to the last forward (`bench_common.PeakWatch`: the engine's resets folded in).

``smallest_card``: the whole Wan2.2-T2V-A14B pipeline (two experts, UMT5, Wan VAE; published sizes, random weights)
with int8 transformers, 81 frames 832x480 with CFG, 2 steps and a tiled VAE decode (no mp4), on an emulated 5 GB
card (``set_per_process_memory_fraction``; ``mem_get_info`` does not see it, so the budget is passed as the cap):
whether it completed, its peak, and the floor, the smallest budget the package accepts for this workload (the
largest of the components' minimums, with the activations they measured), its parts by the package's own rule,
and the package's refusal of one byte less. Where it completed, the same generation then runs natively on the
uncapped device, the same model, and its frames are compared bitwise (``native``; ``--skip-card-native``: not).
The JSON is written after each row: a run cut off keeps its rows.

``--ffn-chunks N``: `flextensor_diffusers.chunk_feed_forward` on every Wan transformer built here (the stack's
blocks, both experts) before anything runs, so that the native reference computes the same thing as the offloaded
run: a chunked feed-forward lowers the 81-frame activations (``--trace-block``). On a CUDA device the card path runs
with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless it is set (``alloc_conf`` in the record): under a
5 GB cap the caching allocator's fragmentation alone refused call E's first forward (2.83 GiB allocated, 1.46 GiB
reserved but free, no block for 640 MiB).

    bash benchmarks/gpu_proof.sh quantized                             # on one H100/H200
    CARD_WEIGHTS=fp8 FFN_CHUNKS=4 bash benchmarks/gpu_proof.sh quantized_card
    python benchmarks/quantized_bench.py --small --out /tmp/q.json     # tiny shapes, on the CPU
    python benchmarks/quantized_bench.py --trace-block --out benchmarks/results/block_peak_cpu.json  # the CPU

``--trace-block``: the activation peak of a Wan2.2-A14B transformer forward, stage by stage, without a GPU or the
FLOPs (no stack or card rows then). A one-block ``WanTransformer3DModel`` at the published sizes (dim 5120, ffn
13824, 40 heads; ``--random-weights full``'s dtypes) is built on the meta device and run once at 81 frames 832x480
(21x30x52 = 32 760 tokens, batch 1: the pipeline runs the two CFG branches as separate forwards) under `LiveBytes`,
which counts every storage an op makes from that op until the storage is freed: the bytes a GPU's allocator would
hold for those tensors, as Python frees them. What is there before the forward (weights, latents, text embeddings)
is not counted, as the package's activation peak does not count it. Attention is modelled as flash attention
(``Flash``: its output and its fp32 log-sum-exp; meta has no flash kernel), since the math path would hold the 32
760^2 score matrix.

Rows: diffusers' own block forward (``native``), then `flextensor_diffusers.chunk_feed_forward` at each count of
``--trace-chunks``; each for each ``--trace-weights`` form: ``bf16``, ``fp8`` (diffusers' layerwise casting, as the
quantized benchmark's fp8: each linear's weight is cast up to bf16 for its call and a new fp8 copy made after it,
held until the block's call ends, where the package points the block back at its slot) and ``int8`` (torchao
weight-only: each linear casts its int8 weight to bf16 and holds its product twice, before and after the scale).
Each row: the peak over the forward, and the peak during each stage of the block (``self_attention``: modulation,
norm1, attn1 and its gated residual; ``cross_attention``: norm2, attn2 and its residual; ``feed_forward``: norm3,
the MLP and the gated fp32 residual, all chunks). Not counted: kernels' own workspaces (cuBLAS', flash attention's),
a few MiB.

``floor_estimate_bytes``: the transformer's smallest budget by the package's rule with this peak as its activations:
weights outside units + two slots of the largest unit + the peak and 5 %, the weights counted as the package packs
them (inner tensors of torchao's; alignment padding aside: for fp8 this gives 521 578 624 and 703 075 328 bytes
where call F, quantized_card_fp8_callF_h100.json, measured 521 579 008 and 703 075 328).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

if "--skip-smallest-card" not in sys.argv:  # before CUDA starts (see the module docstring)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import bench_common as bc
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import flextensor_diffusers as ft
from flextensor_diffusers.engine.errors import first_line
from flextensor_diffusers.engine.planner import smallest_budget
from flextensor_diffusers.recipes.models import load_config
from flextensor_diffusers.reports.compare import _free, cap_device_memory

WORKLOAD = "17f_480x272"
STACK_BUDGET = 2_800_000_000
CARD_BYTES = 5_000_000_000
CARD_STEPS = 2
#: The package's activation margin (its default, not restated here), for `--trace-block`'s floor estimates.
ACTIVATION_MARGIN = ft.OffloadConfig(include_patterns=["blocks.*"]).activation_margin
STAGES = {"norm1": "self_attention", "norm2": "cross_attention", "norm3": "feed_forward"}
#: ``--small``: eight blocks of dim 256 and a budget of about two of their bf16 blocks, so that every form streams.
SMALL_SHAPE = bc.StackShape(blocks=8, dim=256, heads=4, ffn=512, small=True)
SMALL_STACK_BUDGET = 3_500_000
SMALL_CARD_BYTES = 2_000_000


@dataclass(frozen=True)
class Representation:
    """One form of the weights: the row's name for it, what was done, and how to do it to a module in place."""

    label: str
    how: str
    apply: Callable[[nn.Module], None]


def _torchao(config: str) -> Callable[[nn.Module], None]:
    def apply(module: nn.Module) -> None:
        import torchao.quantization as quantization

        quantization.quantize_(module, getattr(quantization, config)())

    return apply


def _fp8_layerwise(module: nn.Module) -> None:
    """A diffusers model's own ``enable_layerwise_casting`` (which also skips its fp32 modules), else the hook it
    applies, with diffusers' default skip patterns (norms, proj_in/proj_out)."""
    storage, compute = torch.float8_e4m3fn, torch.bfloat16
    if hasattr(module, "enable_layerwise_casting"):
        module.enable_layerwise_casting(storage_dtype=storage, compute_dtype=compute)
    else:
        from diffusers.hooks import apply_layerwise_casting

        apply_layerwise_casting(module, storage, compute)


#: ``--rows`` names. ``fp8`` is diffusers' layerwise casting, the fp8 its memory guide offers for Wan (plain float8
#: tensors, cast per layer); ``fp8_torchao`` (a float8 tensor subclass, sm89+) runs when asked for.
REPRESENTATIONS = {
    "bf16": Representation("bf16", "bf16 weights as built (fp32 where Wan keeps them)", lambda module: None),
    "int8": Representation("int8", "torchao quantize_(m, Int8WeightOnlyConfig())", _torchao("Int8WeightOnlyConfig")),
    "fp8": Representation(
        "fp8_layerwise", "diffusers layerwise casting: fp8 e4m3 storage, bf16 compute", _fp8_layerwise
    ),
    "fp8_torchao": Representation(
        "fp8_torchao", "torchao quantize_(module, Float8WeightOnlyConfig())", _torchao("Float8WeightOnlyConfig")
    ),
}


# ---------------------------------------------------------------------------------------- the stack


def native_forwards(model: nn.Module, shape: bc.StackShape, reps: int, device: torch.device) -> dict[str, Any]:
    """Median forward of ``model`` where it is (after one warm-up), its output on the CPU, and its peak."""
    x = bc.stack_inputs(shape, WORKLOAD, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        model(*x)
        timed = bc.time_forwards(model, x, reps, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"step_s": timed.ms / 1e3, "out": timed.out.cpu(), "peak_allocated_bytes": peak}


def offloaded_forwards(
    model: nn.Module, shape: bc.StackShape, budget: int, reps: int, device: torch.device
) -> dict[str, Any]:
    """Offload ``model`` (on the CPU) at ``budget``, warm up until planned, time ``reps`` forwards, remove. The
    inputs are made after set-up, as a pipeline makes its latents; the peak covers set-up to the last forward."""
    with bc.PeakWatch(device) as watch:
        start = time.perf_counter()
        handle = ft.offload(model, bc.stack_config(budget, device))
        setup_s = time.perf_counter() - start
        try:
            with torch.inference_mode():
                x = bc.stack_inputs(shape, WORKLOAD, device)
                bc.warm_up(handle, model, x)
                streamed_before = handle.stats().bytes_streamed
                timed = bc.time_forwards(model, x, reps, device)
                stats = handle.stats()
            peak = watch.peak
        finally:
            handle.remove()
    run = {"step_s": timed.ms / 1e3, "out": timed.out.cpu(), "peak_allocated_bytes": peak, "setup_s": round(setup_s, 3)}
    run |= {"package_peak_allocated_bytes": stats.peak_allocated_bytes, "plan": stats.plan}
    run["streamed_bytes_per_step"] = round((stats.bytes_streamed - streamed_before) / reps)
    return run | {"unit_bytes": stats.unit_bytes, "resident_weight_bytes": stats.resident_weight_bytes}


def stack_row(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """One representation of the stack, native then offloaded at the budget (see the module docstring)."""
    rep, shape = REPRESENTATIONS[name], SMALL_SHAPE if args.small else bc.StackShape()
    model = bc.build_stack(shape, device)
    rep.apply(model)
    if args.ffn_chunks is not None:
        ft.chunk_feed_forward(model, args.ffn_chunks)
    native = native_forwards(model, shape, args.reps, device)
    model.to("cpu")
    _free(device)
    offloaded = offloaded_forwards(model, shape, args.budget, args.reps, device)
    native_out, out = native.pop("out"), offloaded.pop("out")
    same_shape = native_out.shape == out.shape
    row = {"weights": rep.label, "weights_how": rep.how, "workload": WORKLOAD, "frames": 17, "blocks": shape.blocks}
    row |= bc.check_budget(f"{rep.label} stack", args.budget, offloaded.pop("peak_allocated_bytes"), bc.WHOLE_RUN)
    row |= {"step_s": round(offloaded.pop("step_s"), 5), "native_step_s": round(native["step_s"], 5)}
    row |= {"bitwise_equal": bool(torch.equal(native_out, out)), "small": args.small, "ffn_chunks": args.ffn_chunks}
    row["max_abs_diff"] = (native_out.float() - out.float()).abs().max().item() if same_shape else None
    return row | {"native_peak_allocated_bytes": native["peak_allocated_bytes"], **offloaded}


# ---------------------------------------------------------------------------------------- the smallest card


def quantize_on(module: nn.Module, rep: Representation, device: torch.device) -> None:
    """Apply ``rep`` to a module on the CPU where it is quick (``device``), and move it back to the CPU."""
    module.to(device)
    rep.apply(module)
    module.to("cpu")
    _free(device)


def floor_parts(handle: Any, need: int) -> dict[str, Any]:
    """One component's smallest budget term by term, by the package's own rule."""
    granule, margin = handle.device_copies.allocation_granule, handle.config.activation_margin
    activations = handle.profile.activation_peak_bytes if handle.profile is not None else 0
    parts = {
        "weights_outside_units": smallest_budget(handle.resident_weight_bytes, [], granule=granule),
        "two_slots_of_largest_unit": smallest_budget(0, [u.nbytes for u in handle.units], granule=granule),
        "activations_with_margin": smallest_budget(0, [], activations, margin, granule=granule),
        "activation_peak_bytes": activations,
        "activation_margin": margin,
    }
    terms = ("weights_outside_units", "two_slots_of_largest_unit", "activations_with_margin")
    return parts | {"sum_equals_floor": sum(parts[k] for k in terms) == need}


def floor_record(state: Any) -> dict[str, Any]:
    """The smallest budget every component accepts for the workload it measured, the parts of the binding one
    (the package's own rule, term by term), and the package's refusal of one byte less."""
    needs = {name: h.smallest_budget() for name, h in state.handles.items()}
    profiled = {name: h.profile is not None for name, h in state.handles.items()}
    binding = max(needs, key=needs.get)
    handle = state.handles[binding]
    parts = floor_parts(handle, needs[binding]) | {"component": binding}
    try:
        handle.set_budget(needs[binding] - 1)
        refusal: dict[str, Any] = {"refused": False}
    except ft.BudgetError as exc:
        refusal = {"refused": True, "required_bytes": exc.required_bytes, "message": first_line(exc)}
    return {
        "floor_bytes": max(needs.values()),
        "floor_parts": parts,
        "floor_by_component": {
            name: {"bytes": needs[name], "activations_measured": profiled[name]}
            | floor_parts(state.handles[name], needs[name])
            for name in needs
        },
        "floor_refusal_one_byte_less": refusal,
    }


def card_options(args: argparse.Namespace, cap: int) -> Any:
    from flextensor_diffusers.recipes import wan22_t2v

    argv = ["--random-weights", "tiny" if args.small else "full", "--steps", str(CARD_STEPS), "--budget", str(cap)]
    argv += ["--vae-tiling", "on", "-q"]
    if args.ffn_chunks is not None:  # wan22_t2v.load chunks both experts
        argv += ["--ffn-chunks", str(args.ffn_chunks)]
    if not args.small:
        argv += ["--frames", "81", "--height", "480", "--width", "832"]
    return wan22_t2v.parse_args(argv)


def smallest_card(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The whole pipeline on an emulated card of ``cap`` bytes, budget = cap (see the module docstring)."""
    from flextensor_diffusers.recipes import common, wan22_t2v

    rep, cap = REPRESENTATIONS[args.card_weights], args.card_bytes
    options = card_options(args, cap)
    start = time.perf_counter()
    pipe = wan22_t2v.load(options, device)  # random weights made on the GPU (full size), then on the CPU
    for name in ("transformer", "transformer_2"):
        quantize_on(getattr(pipe, name), rep, device)
    record: dict[str, Any] = {"weights": rep.label, "weights_how": f"{rep.how}, both transformers", "cap_bytes": cap}
    record |= {"frames": options.frames, "height": options.height, "width": options.width, "cfg": options.guidance > 1}
    record |= {"steps": CARD_STEPS, "vae_tiling": True, "small": args.small, "ffn_chunks": options.ffn_chunks}
    record["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") if device.type == "cuda" else None
    record["build_s"] = round(time.perf_counter() - start, 1)
    _free(device)
    cap_device_memory(device, str(cap))
    try:
        with bc.PeakWatch(device) as watch:
            start = time.perf_counter()
            try:
                common.enable_offload(pipe, options, device)
                video = wan22_t2v.generate(pipe, options, device, CARD_STEPS, "np")
                record |= {"completed": True, "video_shape": list(video.shape)}
            except Exception as exc:  # a refusal (BudgetError: its required_bytes) or a failure, recorded
                traceback.print_exc()
                record |= {"completed": False, "error": f"{type(exc).__name__}: {first_line(exc)}"}
                record["floor_bytes"] = getattr(exc, "required_bytes", None)  # a refusal's; the state's below if any
            record["generation_s"] = round(time.perf_counter() - start, 1)
            record |= bc.check_budget("smallest card", cap, watch.peak, bc.WHOLE_RUN)
            state = ft.pipeline_offload(pipe)
            if state is not None and state.handles:
                record["package_peak_allocated_bytes"] = state.report()["peak_allocated_bytes"]
                record |= floor_record(state)
                pipe.disable_flextensor_offload()
    finally:
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
    record.setdefault("floor_parts", {})
    if record["completed"] and not args.skip_card_native:
        record["native"] = native_reference(pipe, options, device, video)
    if not record["completed"] and args.floor_cap:
        record["floor_at_larger_cap"] = floor_at(pipe, args, args.floor_cap, device)
    return record


def native_reference(pipe: Any, options: Any, device: torch.device, video: np.ndarray) -> dict[str, Any]:
    """The card's generation natively on the uncapped device (the same model: chunked alike, same VAE tiling, same
    seed), its frames compared bitwise with the card's; the pipeline back on the CPU after."""
    from flextensor_diffusers.recipes import common, wan22_t2v

    record: dict[str, Any] = {"ffn_chunks": options.ffn_chunks}
    try:
        with bc.PeakWatch(device) as watch:
            start = time.perf_counter()
            common.place_natively(pipe, options, device)
            native = wan22_t2v.generate(pipe, options, device, CARD_STEPS, "np")
            record |= {"completed": True, "generation_s": round(time.perf_counter() - start, 1)}
            record["peak_allocated_bytes"] = watch.peak
        record["frames_bitwise_equal"] = bool(np.array_equal(native, video))
        record["frames_max_abs_diff"] = float(np.abs(native.astype(np.float64) - video).max())
    except Exception as exc:
        traceback.print_exc()
        record |= {"completed": False, "error": f"{type(exc).__name__}: {first_line(exc)}"}
    finally:
        pipe.to("cpu")
        _free(device)
    return record


def floor_at(pipe: Any, args: argparse.Namespace, cap: int, device: torch.device) -> dict[str, Any]:
    """Where the card was too small, the floor with its parts measured under a larger emulated card ``cap`` (one
    step: every component measures its activations), so that the shortfall is known term by term."""
    from flextensor_diffusers.recipes import common, wan22_t2v

    if ft.pipeline_offload(pipe) is not None:
        pipe.disable_flextensor_offload()
    _free(device)
    options = card_options(args, cap)
    cap_device_memory(device, str(cap))
    record: dict[str, Any] = {"cap_bytes": cap, "steps": 1}
    try:
        with bc.PeakWatch(device) as watch:
            common.enable_offload(pipe, options, device)
            wan22_t2v.generate(pipe, options, device, 1, "np")
            record |= {"completed": True} | bc.check_budget("floor probe", cap, watch.peak, bc.WHOLE_RUN)
            record |= floor_record(ft.pipeline_offload(pipe))
    except Exception as exc:
        traceback.print_exc()
        record |= {"completed": False, "error": f"{type(exc).__name__}: {first_line(exc)}"}
    finally:
        if ft.pipeline_offload(pipe) is not None:
            pipe.disable_flextensor_offload()
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
    return record


# ---------------------------------------------------------------------------------------- the run


# ------------------------------------------------------------------ --trace-block: a block's peak on the meta device


def storages(tensors: Iterable[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    """The storages of ``tensors`` and, for tensor subclasses (torchao's), of the plain tensors inside them."""
    found: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if hasattr(t, "__tensor_flatten__"):
            found |= storages(getattr(t, name) for name in t.__tensor_flatten__()[0])
        else:
            found[t.untyped_storage()._cdata] = t.untyped_storage()
    return found


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages made by ops inside it and not yet freed, and their peak, overall and per stage.

    A storage is counted once, when an op first returns a tensor on it, and uncounted when it is freed (a weak
    reference to the storage: views keep it alive, as they keep an allocator's block). Storages in ``existing``
    (the weights, the inputs) are never counted, though ops return views of them (a weight's transpose); they are
    held, so that no new storage takes the address of one that layerwise casting replaced (the slot holds it)."""

    def __init__(self, existing: dict[int, torch.UntypedStorage]) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.stage = "outside"
        self.stage_peaks: dict[str, int] = {}
        self._existing = existing
        self._refs: dict[int, weakref.ref] = {}

    def enter_stage(self, stage: str) -> None:
        self.stage = stage
        self.stage_peaks[stage] = max(self.stage_peaks.get(stage, 0), self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key, size = storage._cdata, storage.nbytes()
        if key in self._refs or key in self._existing:
            return

        def freed(_: weakref.ref, key: int = key, size: int = size) -> None:
            self._refs.pop(key, None)
            self.live -= size

        self._refs[key] = weakref.ref(storage, freed)
        self.live += size
        self.peak = max(self.peak, self.live)
        self.stage_peaks[self.stage] = max(self.stage_peaks.get(self.stage, 0), self.live)


class Flash(TorchFunctionMode):
    """``scaled_dot_product_attention`` as flash attention allocates: its output and its fp32 log-sum-exp."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query = args[0] if args else kwargs["query"]
        logsumexp = torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device)  # noqa: F841
        return torch.empty_like(query)


def build_transformer(weights: str) -> nn.Module:
    """One full-size Wan2.2-A14B block in its transformer, on the meta device, in ``--random-weights full``'s dtypes
    (bf16; fp32 where diffusers keeps it), with ``weights`` applied as the quantized benchmark applies it."""
    from diffusers import WanTransformer3DModel

    config = load_config("wan22_t2v", "full")["transformer"] | {"num_layers": 1}
    with torch.device("meta"):
        model = WanTransformer3DModel(**config)
    keep = model._keep_in_fp32_modules or []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point():
            t.data = t.data.to(torch.float32 if any(k in name.split(".") for k in keep) else torch.bfloat16)
    model.eval().requires_grad_(False)
    if weights == "fp8":
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    elif weights == "int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(model.blocks, Int8WeightOnlyConfig())
    return model


def mark_stages(model: nn.Module, tracker: LiveBytes) -> list[Any]:
    """Hooks that tell ``tracker`` which stage of the block runs (each stage starts at its norm's call)."""
    block = model.blocks[0]
    hooks = [block.register_forward_pre_hook(lambda *_: tracker.enter_stage("self_attention"))]
    for name, stage in STAGES.items():
        if name != "norm1":
            hooks.append(getattr(block, name).register_forward_pre_hook(lambda *_, s=stage: tracker.enter_stage(s)))
    hooks.append(block.register_forward_hook(lambda *_: tracker.enter_stage("outside")))
    return hooks


def trace(model: nn.Module, frames: int, height: int, width: int) -> dict[str, Any]:
    """The peaks of one forward (see the module docstring)."""
    latent = (1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)
    with torch.device("meta"):
        inputs = dict(
            hidden_states=torch.empty(latent, dtype=torch.bfloat16),
            timestep=torch.empty(1, dtype=torch.int64),
            encoder_hidden_states=torch.empty(1, 512, 4096, dtype=torch.bfloat16),
        )
    tracker = LiveBytes(storages([*model.parameters(), *model.buffers(), *inputs.values()]))
    hooks = mark_stages(model, tracker)
    try:
        with torch.inference_mode(), Flash(), tracker:
            out = model(**inputs, return_dict=False)[0]
    finally:
        for hook in hooks:
            hook.remove()
    tokens = latent[2] * (latent[3] // 2) * (latent[4] // 2)
    return {
        "tokens": tokens,
        "peak_bytes": tracker.peak,
        "stage_peak_bytes": {s: tracker.stage_peaks.get(s) for s in (*STAGES.values(), "outside")},
        "output_bytes": out.untyped_storage().nbytes(),
    }


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """The model's weights outside its one unit (the block), and two slots of the block, as the package packs them."""
    block = sum(s.nbytes() for s in storages([*model.blocks[0].parameters(), *model.blocks[0].buffers()]).values())
    every = sum(s.nbytes() for s in storages([*model.parameters(), *model.buffers()]).values())
    return {"weights_outside_units": every - block, "two_slots_of_largest_unit": 2 * block}


def floor_estimate(peak: int, weights: dict[str, int]) -> int:
    return sum(weights.values()) + round(peak * (1 + ACTIVATION_MARGIN))


def trace_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    found = []
    for weights in args.trace_weights.split(","):
        model = build_transformer(weights)
        parts = weight_bytes(model)
        counts: list[int | None] = [None, *(int(c) for c in args.trace_chunks.split(","))]
        for chunks in counts:
            if chunks is None:
                ft.unchunk_feed_forward(model)
            else:
                ft.chunk_feed_forward(model, chunks)
            row = {"weights": weights, "forward": "native" if chunks is None else "chunk_feed_forward"}
            row |= {"chunks": chunks} | trace(model, args.frames, args.height, args.width)
            floor = floor_estimate(row["peak_bytes"], parts)
            row |= {"floor_estimate_bytes": floor, **parts, "fits_card": floor <= args.card_bytes}
            found.append(row)
            print_row(row)
    return found


def print_row(row: dict[str, Any]) -> None:
    gb: Callable[[int | None], str] = lambda n: "-" if n is None else f"{n / 1e9:.3f}"  # noqa: E731
    stages = row["stage_peak_bytes"]
    print(
        f"{row['weights']:<5} {row['forward']:<18} {row['chunks']!s:>6} {gb(row['peak_bytes']):>8} "
        f"{gb(stages['self_attention']):>8} {gb(stages['cross_attention']):>8} {gb(stages['feed_forward']):>8} "
        f"{gb(row['floor_estimate_bytes']):>8} {row['fits_card']!s:>5}",
        flush=True,
    )


def trace_block(args: argparse.Namespace) -> None:
    """``--trace-block``: every row of `trace_rows`, printed and written to ``--out``."""
    started = time.perf_counter()
    print("GB:   forward            chunks     peak self-att cross-at feed-fwd    floor  fits")
    result: dict[str, Any] = {"issue": 47, "device": "meta (CPU, no FLOPs)", "torch": torch.__version__}
    result |= {"frames": args.frames, "height": args.height, "width": args.width, "card_bytes": args.card_bytes}
    result |= {"activation_margin": ACTIVATION_MARGIN, "rows": trace_rows(args), **bc.provenance()}
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    bc.write_json(args.out, result)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="bf16,int8,fp8", help=f"stack rows, of {', '.join(REPRESENTATIONS)}")
    parser.add_argument("--skip-smallest-card", action="store_true")
    parser.add_argument("--small", action="store_true", help="tiny shapes (a quick check on the CPU)")
    parser.add_argument("--time-limit", type=float, help="seconds after which no new row is started")
    parser.add_argument("--reps", type=int, help="timed forwards of the stack, each way (default 5; --small 2)")
    parser.add_argument("--budget", type=int, help=f"stack budget, bytes (default {STACK_BUDGET})")
    parser.add_argument("--card-bytes", type=int, help=f"emulated card and its budget (default {CARD_BYTES})")
    parser.add_argument("--card-weights", default="int8", choices=sorted(REPRESENTATIONS))
    parser.add_argument(
        "--floor-cap", type=int, help="where the card fails: measure the floor's parts under this larger card, bytes"
    )
    parser.add_argument(
        "--ffn-chunks", type=int, help="chunk_feed_forward(N) on every Wan transformer built here, native and offloaded"
    )
    parser.add_argument(
        "--trace-block", action="store_true", help="only the block's activation peak, on the meta device"
    )
    parser.add_argument("--frames", type=int, default=81, help="--trace-block's workload")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--trace-chunks", default="1,2,4,8", help="--trace-block's chunk_feed_forward counts")
    parser.add_argument(
        "--trace-weights", default="bf16,fp8,int8", help="of bf16, fp8 (layerwise casting), int8 (torchao)"
    )
    parser.add_argument("--skip-card-native", action="store_true", help="no native reference of a completed card")
    return parser


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{'weights':<14} {'step s':>8} {'native s':>8} {'equal':>5} {'peak GiB':>8} {'GiB/step':>8}")
    for row in result["stack"]:
        if "error" in row:
            print(f"{row['weights']:<14} {row['error']}")
            continue
        peak = row["peak_allocated_bytes"] / 2**30 if row["peak_allocated_bytes"] is not None else float("nan")
        print(
            f"{row['weights']:<14} {row['step_s']:>8.4f} {row['native_step_s']:>8.4f} {row['bitwise_equal']!s:>5} "
            f"{peak:>8.2f} {row['streamed_bytes_per_step'] / 2**30:>8.2f}"
        )
    if card := result["smallest_card"]:
        said = {k: card.get(k) for k in ("weights", "cap_bytes", "ffn_chunks", "steps", "completed")}
        said["peak_allocated_bytes"] = card.get("peak_allocated_bytes")
        print(f"smallest card: {said}, floor {card.get('floor_bytes')} {card.get('error', '')}")
        if native := card.get("native"):
            equal = native.get("frames_bitwise_equal")
            print(f"native reference: frames bitwise equal {equal} {native.get('error', '')}")
    for skipped in result["skipped"]:
        print(f"skipped (time limit): {skipped}")


def guarded(failed: dict[str, Any], job: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``job``'s row, or ``failed`` with the error when it raised (a row that fails is recorded; the next one runs);
    either with the command and the commit."""
    try:
        row = job()
    except Exception as exc:
        traceback.print_exc()
        row = failed | {"error": f"{type(exc).__name__}: {first_line(exc)}"}
    return row | bc.provenance()


def installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def main() -> None:
    args = parser().parse_args()
    args.budget = args.budget or (SMALL_STACK_BUDGET if args.small else STACK_BUDGET)
    args.card_bytes = args.card_bytes or (SMALL_CARD_BYTES if args.small else CARD_BYTES)
    args.reps = args.reps or (2 if args.small else 5)
    if args.ffn_chunks is not None and args.ffn_chunks < 1:
        parser().error(f"--ffn-chunks {args.ffn_chunks}: pass a whole number of 1 or more")
    if args.trace_block:
        trace_block(args)
        return
    started = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = [n for n in args.rows.split(",") if n]
    if any(n not in REPRESENTATIONS for n in names):
        parser().error(f"--rows {args.rows}: use some of {', '.join(REPRESENTATIONS)}")
    versions = {name: installed(name) for name in ("torch", "diffusers", "torchao")}
    result: dict[str, Any] = {"issue": 47, "device": bc.device_name(device), **versions, **bc.provenance()}
    result |= {"alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "ffn_chunks": args.ffn_chunks}
    result |= {"stack": [], "smallest_card": None, "skipped": []}
    print(f"device {result['device']}, torch {result['torch']}, torchao {result['torchao']}", flush=True)

    def may_start(label: str) -> bool:
        if args.time_limit is not None and time.perf_counter() - started > args.time_limit:
            result["skipped"].append(label)
            return False
        print(f"[{time.perf_counter() - started:7.1f} s] {label}", flush=True)
        return True

    for name in names:
        if may_start(f"stack {name}"):
            failed = {"weights": REPRESENTATIONS[name].label, "small": args.small}
            result["stack"].append(guarded(failed, lambda name=name: stack_row(name, args, device)))
            _free(device)
            bc.write_json(args.out, result)
    if not args.skip_smallest_card and may_start("smallest card"):
        failed = {"weights": REPRESENTATIONS[args.card_weights].label, "completed": False, "steps": CARD_STEPS}
        failed["cap_bytes"] = args.card_bytes
        result["smallest_card"] = guarded(failed, lambda: smallest_card(args, device))
        _free(device)
    bc.write_json(args.out, result)
    print_table(result)


if __name__ == "__main__":
    main()
