"""Supported pipelines built from the configs in ``assets/``, with random weights, or loaded from disk.

Nothing here downloads anything. ``tiny`` variants run on a CPU in seconds (tests, the README
demo); ``full`` variants have the published architecture sizes, for GPU benchmarks. Real weights
come from a local diffusers folder (`load_pipeline`), loaded on the CPU first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..engine.errors import FlexTensorError

ASSETS = Path(__file__).resolve().parents[1] / "assets"
SIZES = ("tiny", "full")


def asset_path(*parts: str) -> Path:
    """A file under the packaged ``assets/`` folder."""
    path = ASSETS.joinpath(*parts)
    if not path.exists():
        raise FlexTensorError(f"asset {path} is missing: reinstall flextensor-diffusers")
    return path


def load_config(model: str, size: str) -> dict[str, Any]:
    if size not in SIZES:
        raise FlexTensorError(f"unknown size {size!r}: use one of {', '.join(SIZES)}")
    path = ASSETS / model / f"{size}.json"
    if not path.exists():
        shipped = sorted(p.stem for p in (ASSETS / model).glob("*.json"))
        raise FlexTensorError(f"no {size!r} config for {model} is shipped (have: {', '.join(shipped) or 'none'})")
    return json.loads(path.read_text())


def tokenizer() -> Any:
    """The small offline tokenizer (T5 special tokens) shipped in assets/tokenizer."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(asset_path("tokenizer")), local_files_only=True)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _random(build: Any, init_device: str | torch.device, dtype: torch.dtype, seed: int) -> Any:
    """Construct a module with its default random init on ``init_device``, then move it to the CPU.

    Initialising on the GPU makes full-size models quick to build; the weights then live on the
    CPU, as after a CPU-first load.
    """
    torch.manual_seed(seed)
    with torch.device(init_device):
        module = build()
    keep = getattr(module, "_keep_in_fp32_modules", None) or []
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.is_floating_point():  # fp32 where from_pretrained(dtype=...) would keep it
            t.data = t.data.to(torch.float32 if any(k in name.split(".") for k in keep) else dtype)
    if torch.device(init_device).type not in ("cpu", "meta"):  # meta: shapes only, to attach to shared weights
        module = module.to("cpu")
    return module.eval().requires_grad_(False)


def build_wan22_t2v(size: str = "tiny", seed: int = 0, init_device: str | torch.device = "cpu") -> Any:
    """A `WanPipeline` with Wan2.2 T2V A14B's structure (two experts, UMT5, Wan VAE), random weights."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    cfg = load_config("wan22_t2v", size)
    dtype, vae_dtype = _dtype(cfg["dtype"]), _dtype(cfg["vae_dtype"])
    transformer = _random(lambda: WanTransformer3DModel(**cfg["transformer"]), init_device, dtype, seed)
    transformer_2 = _random(lambda: WanTransformer3DModel(**cfg["transformer_2"]), init_device, dtype, seed + 1)
    text_encoder = _random(lambda: UMT5EncoderModel(UMT5Config(**cfg["text_encoder"])), init_device, dtype, seed + 2)
    vae = _random(lambda: AutoencoderKLWan(**cfg["vae"]), init_device, vae_dtype, seed + 3)
    scheduler = UniPCMultistepScheduler(**{k: v for k, v in cfg["scheduler"].items() if not k.startswith("_")})
    return WanPipeline(
        tokenizer=tokenizer(),
        text_encoder=text_encoder,
        transformer=transformer,
        transformer_2=transformer_2,
        vae=vae,
        scheduler=scheduler,
        boundary_ratio=cfg["boundary_ratio"],
    )


def build_ltx2_condition(size: str = "tiny", seed: int = 0, init_device: str | torch.device = "cpu") -> Any:
    """An `LTX2ConditionPipeline` (video + audio transformer, Gemma3, connectors, VAEs, vocoder), random weights."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2ConditionPipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    cfg = load_config("ltx2", size)
    dtype = _dtype(cfg["dtype"])
    gemma = _random(
        lambda: Gemma3ForConditionalGeneration(Gemma3Config(**cfg["text_encoder"])), init_device, dtype, seed
    )
    vae = _random(lambda: AutoencoderKLLTX2Video(**cfg["vae"]), init_device, dtype, seed + 1)
    vae.use_framewise_encoding = vae.use_framewise_decoding = cfg["vae_framewise"]
    return LTX2ConditionPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        audio_vae=_random(lambda: AutoencoderKLLTX2Audio(**cfg["audio_vae"]), init_device, dtype, seed + 2),
        text_encoder=gemma,
        tokenizer=tokenizer(),
        connectors=_random(lambda: LTX2TextConnectors(**cfg["connectors"]), init_device, dtype, seed + 3),
        transformer=_random(lambda: LTX2VideoTransformer3DModel(**cfg["transformer"]), init_device, dtype, seed + 4),
        vocoder=_random(lambda: LTX2Vocoder(**cfg["vocoder"]), init_device, dtype, seed + 5),
        audio_scheduler=None,
    )


#: A Qwen-style chat template for the offline tokenizer: Cosmos builds its prompt as a conversation.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}<|im_end|>\n{% endfor %}"
)


def build_cosmos_transfer25(
    size: str = "tiny", seed: int = 0, init_device: str | torch.device = "cpu", safety_checker: Any = None
) -> Any:
    """A `Cosmos2_5_TransferPipeline` (transformer, edge ControlNet, Wan VAE, Qwen2.5-VL), random weights.

    ``safety_checker`` is required by the pipeline (it refuses to run without one); the recipe
    passes Cosmos Guardrail when its package is installed, or says which checks it skipped.
    """
    from diffusers import (
        AutoencoderKLWan,
        Cosmos2_5_TransferPipeline,
        CosmosControlNetModel,
        CosmosTransformer3DModel,
        UniPCMultistepScheduler,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    if safety_checker is None:
        raise FlexTensorError("Cosmos2_5_TransferPipeline needs a safety_checker (see recipes/cosmos_transfer25.py)")
    cfg = load_config("cosmos_transfer25", size)
    dtype, vae_dtype = _dtype(cfg["dtype"]), _dtype(cfg["vae_dtype"])
    qwen = Qwen2_5_VLConfig(**cfg["text_encoder"])
    chat = tokenizer()
    chat.chat_template = CHAT_TEMPLATE
    return Cosmos2_5_TransferPipeline(
        text_encoder=_random(lambda: Qwen2_5_VLForConditionalGeneration(qwen), init_device, dtype, seed),
        tokenizer=chat,
        transformer=_random(lambda: CosmosTransformer3DModel(**cfg["transformer"]), init_device, dtype, seed + 1),
        vae=_random(lambda: AutoencoderKLWan(**cfg["vae"]), init_device, vae_dtype, seed + 2),
        scheduler=UniPCMultistepScheduler(**cfg["scheduler"]),
        controlnet=_random(lambda: CosmosControlNetModel(**cfg["controlnet"]), init_device, dtype, seed + 3),
        safety_checker=safety_checker,
    )


BUILDERS = {
    "wan22_t2v": build_wan22_t2v,
    "ltx2_condition": build_ltx2_condition,
    "cosmos_transfer25": build_cosmos_transfer25,
}


def build_pipeline(
    model: str, size: str = "tiny", seed: int = 0, init_device: str | torch.device = "cpu", **options: Any
) -> Any:
    """Build a supported pipeline (``wan22_t2v``, ...) with random weights from ``assets/``.

    ``options`` go to the model's builder (e.g. ``safety_checker=`` for Cosmos).
    """
    if model not in BUILDERS:
        raise FlexTensorError(f"unknown model {model!r}: supported are {', '.join(sorted(BUILDERS))}")
    return BUILDERS[model](size=size, seed=seed, init_device=init_device, **options)


def load_pipeline(path: str | Path, pipeline_class: Any, dtype: torch.dtype = torch.bfloat16, **kwargs: Any) -> Any:
    """Load a local diffusers folder on the CPU, memory-mapped, without a hub.

    safetensors files are memory-mapped and each tensor is materialised once, so host RAM stays
    near one copy of the weights; offloading then packs them unit by unit.
    """
    path = Path(path)
    if not (path / "model_index.json").exists():
        raise FlexTensorError(
            f"{path} is not a diffusers model folder (no model_index.json). Download the weights there first, "
            "or run with --random-weights tiny|full to use the built-in architectures with random weights"
        )
    return pipeline_class.from_pretrained(
        str(path), dtype=dtype, local_files_only=True, low_cpu_mem_usage=True, **kwargs
    )
