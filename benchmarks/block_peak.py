"""Issue 47: the activation peak of a Wan2.2-A14B transformer forward, stage by stage, without a GPU or the FLOPs.

A one-block ``WanTransformer3DModel`` at the published sizes (dim 5120, ffn 13824, 40 heads; ``--random-weights
full``'s dtypes) is built on the meta device and run once at 81 frames 832x480 (21x30x52 = 32 760 tokens, batch 1:
the pipeline runs the two CFG branches as separate forwards) under `LiveBytes`, which counts every storage an op
makes from that op until the storage is freed: the bytes a GPU's allocator would hold for those tensors, as Python
frees them. What is there before the forward (weights, latents, text embeddings) is not counted, as the package's
activation peak does not count it. Attention is modelled as flash attention (``Flash``: its output and its fp32
log-sum-exp; meta has no flash kernel), since the math path would hold the 32 760^2 score matrix.

Rows: diffusers' own block forward (``native``), then `flextensor_diffusers.chunk_feed_forward` at each count of
``--chunks``; each for each ``--weights`` form: ``bf16``, ``fp8`` (diffusers' layerwise casting, as the quantized
benchmark's fp8: each linear's weight is cast up to bf16 for its call and a new fp8 copy made after it, held until
the block's call ends, where the package points the block back at its slot) and ``int8`` (torchao weight-only: each
linear casts its int8 weight to bf16 and holds its product twice, before and after the scale). Each row: the peak
over the forward, and the peak during each stage of the block (``self_attention``: modulation, norm1, attn1 and its
gated residual; ``cross_attention``: norm2, attn2 and its residual; ``feed_forward``: norm3, the MLP and the gated
fp32 residual, all chunks). Not counted: kernels' own workspaces (cuBLAS', flash attention's), a few MiB.

``floor_estimate_bytes``: the transformer's smallest budget by the package's rule with this peak as its activations:
weights outside units + two slots of the largest unit + the peak and 5 %, the weights counted as the package packs
them (inner tensors of torchao's; alignment padding aside: for fp8 this gives 521 578 624 and 703 075 328 bytes
where call F, quantized_card_fp8_callF_h100.json, measured 521 579 008 and 703 075 328).

    python benchmarks/block_peak.py --out benchmarks/results/block_peak_cpu.json
"""

from __future__ import annotations

import argparse
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import bench_common as bc
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import flextensor_diffusers as ft
from flextensor_diffusers.recipes.models import load_config

ACTIVATION_MARGIN = 0.05
CARD_BYTES = 5_000_000_000
STAGES = {"norm1": "self_attention", "norm2": "cross_attention", "norm3": "feed_forward"}


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


def rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    found = []
    for weights in args.weights.split(","):
        model = build_transformer(weights)
        parts = weight_bytes(model)
        counts: list[int | None] = [None, *(int(c) for c in args.chunks.split(","))]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--chunks", default="1,2,4,8")
    parser.add_argument("--weights", default="bf16,fp8,int8", help="of bf16, fp8 (layerwise casting), int8 (torchao)")
    parser.add_argument("--card-bytes", type=int, default=CARD_BYTES)
    args = parser.parse_args()
    started = time.perf_counter()
    print("GB:   forward            chunks     peak self-att cross-at feed-fwd    floor  fits")
    result: dict[str, Any] = {"issue": 47, "device": "meta (CPU, no FLOPs)", "torch": torch.__version__}
    result |= {"frames": args.frames, "height": args.height, "width": args.width, "card_bytes": args.card_bytes}
    result |= {"activation_margin": ACTIVATION_MARGIN, "rows": rows(args), **bc.provenance()}
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    bc.write_json(args.out, result)


if __name__ == "__main__":
    main()
