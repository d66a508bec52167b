"""Quantized transformers for a recipe: ``--quantize int8|fp8`` (torchao, after loading) and ``--gguf`` (diffusers'
GGUF loading of local files).

Both happen before offload is enabled, so the offload packs and streams the quantized tensors themselves (tensor
subclasses, bitwise as natively). Everything that can be checked without the weights is checked when the options are
parsed: the optional package, the file's name and header, the tensors a Wan checkpoint has.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .options import OptionsError, check_local_file, require_package

#: ``--quantize`` values and torchao's weight-only config for each (weights quantized, activations as they are).
QUANTIZE_CONFIGS = {"int8": "Int8WeightOnlyConfig", "fp8": "Float8WeightOnlyConfig"}
QUANTIZE_INSTALL = 'pip install -e ".[quantize]"'
GGUF_INSTALL = 'pip install -e ".[gguf]"'
GGUF_SUFFIX = ".gguf"
#: Tensor names of which one marks a Wan transformer checkpoint: the original format's, with or without ComfyUI's
#: prefix (what diffusers' single-file loader detects), or diffusers' own.
WAN_MARKERS = ("head.modulation", "model.diffusion_model.head.modulation", "scale_shift_table")
#: The experts of Wan2.2, in the order ``--gguf HIGH.gguf,LOW.gguf`` names their files.
EXPERTS = ("transformer", "transformer_2")


def check_quantize(kind: str | None) -> None:
    """``--quantize`` needs torchao, which is optional."""
    if kind is not None:
        require_package("torchao", f"--quantize {kind}", QUANTIZE_INSTALL)


def quantize_experts(pipe: Any, kind: str) -> None:
    """Quantize the linears of each transformer's blocks in place (torchao, weight-only). LoRA layers already
    loaded (peft's ``lora_A``/``lora_B``) stay in full precision; only the base layers they wrap are quantized, as
    peft computes ``base(x) + scale * B(A(x))`` with whatever tensor the base layer holds."""
    from torchao import quantization

    config = getattr(quantization, QUANTIZE_CONFIGS[kind])()
    for expert in EXPERTS:
        transformer = getattr(pipe, expert, None)
        if transformer is not None:
            quantization.quantize_(transformer.blocks, config, filter_fn=_base_linear)


def _base_linear(module: torch.nn.Module, name: str) -> bool:
    """A linear layer of the model, not one of a LoRA adapter's."""
    return isinstance(module, torch.nn.Linear) and ".lora_" not in f".{name}"


@dataclass(frozen=True)
class GgufFiles:
    """``--gguf``: a GGUF file for the first expert (``transformer``, high noise), and optionally one for the
    second (``transformer_2``, low noise); an expert without a file is loaded from ``--model``'s folder."""

    transformer: Path
    transformer_2: Path | None = None

    def by_expert(self) -> dict[str, Path]:
        return {e: p for e, p in zip(EXPERTS, (self.transformer, self.transformer_2), strict=True) if p is not None}


def gguf_files(text: str) -> GgufFiles:
    """``--gguf HIGH.gguf[,LOW.gguf]`` checked before anything loads: the gguf package, at most two files, each an
    existing ``.gguf`` file whose header reads and which holds a Wan transformer."""
    require_package("gguf", "--gguf", GGUF_INSTALL)
    parts = text.split(",")
    if len(parts) > len(EXPERTS) or not all(parts):
        raise OptionsError(
            f"--gguf {text}: pass one file for the first expert, or two for both: --gguf HIGH{GGUF_SUFFIX},"
            f"LOW{GGUF_SUFFIX}"
        )
    paths = [Path(part) for part in parts]
    for path in paths:
        check_gguf_file(path)
    return GgufFiles(*paths)


def check_gguf_file(path: Path) -> None:
    check_local_file("--gguf", path, GGUF_SUFFIX, "GGUF")
    names = gguf_tensor_names(path)
    if not any(marker in names for marker in WAN_MARKERS):
        raise OptionsError(
            f"--gguf {path} holds no Wan transformer (none of its {len(names)} tensors is head.modulation): pass a "
            "GGUF file of a Wan2.2 transformer"
        )


def gguf_tensor_names(path: Path) -> set[str]:
    """The tensor names in a GGUF file's header (its data is memory-mapped, not read); a file that does not parse
    is refused."""
    import gguf

    try:
        return {tensor.name for tensor in gguf.GGUFReader(str(path)).tensors}
    except Exception as exc:  # the reader raises ValueError, struct errors, OSError... on a file that is not GGUF
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise OptionsError(f"--gguf {path} is not a readable GGUF file ({reason}): pass a GGUF file") from None


def load_gguf_transformers(model: Path, files: GgufFiles, dtype: torch.dtype) -> dict[str, Any]:
    """Each expert named in ``files``, from its GGUF file (quantized linears stay quantized, ``GGUFParameter``),
    with the architecture of ``model``'s folder (its ``transformer*/config.json``): keyword arguments for the
    pipeline's ``from_pretrained``."""
    from diffusers import GGUFQuantizationConfig, WanTransformer3DModel

    loaded = {}
    for expert, path in files.by_expert().items():
        loaded[expert] = WanTransformer3DModel.from_single_file(
            str(path),
            quantization_config=GGUFQuantizationConfig(compute_dtype=dtype),
            config=str(model),
            subfolder=expert,
            torch_dtype=dtype,
            local_files_only=True,
        )
    return loaded
