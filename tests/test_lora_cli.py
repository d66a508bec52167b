"""``--lora PATH[:SCALE]`` in the Wan2.2 recipe: LoRA files made here (tiny, random weights, no download) load into
the expert each names, at its scale, as the Python calls do, offloaded bitwise as natively; a bad file or value is one
line and exit status 2, before anything loads where it can be."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from flextensor_diffusers.recipes import wan22_t2v
from flextensor_diffusers.recipes.models import build_pipeline
from flextensor_diffusers.reports import compare
from tests.models import wan_cli_refusal

peft = pytest.importorskip("peft")
from peft.utils import get_peft_model_state_dict  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

TINY = ["--random-weights", "tiny", "--device", "cpu", "-q", "--budget", "250000"]


def lora_tensors(seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    """A LoRA of the tiny Wan2.2 transformer (``transformer.…`` names), random weights."""
    model = copy.deepcopy(build_pipeline("wan22_t2v", "tiny").transformer)
    torch.manual_seed(seed)
    modules = ["to_q", "to_v", "ffn.net.2"]
    model.add_adapter(peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=modules, init_lora_weights=False))
    return {f"transformer.{k}": v.contiguous() for k, v in get_peft_model_state_dict(model).items()}


def write(path: Path, tensors: dict[str, torch.Tensor], expert: str = "transformer") -> Path:
    save_file({expert + k[len("transformer") :]: v for k, v in tensors.items()}, str(path))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("loras")
    return {
        "first": write(folder / "first.safetensors", lora_tensors(1)),
        "second": write(folder / "second.safetensors", lora_tensors(2), expert="transformer_2"),
    }


def test_loras_load_into_the_experts_they_name_at_their_scales(files: dict[str, Path]) -> None:
    """The recipe's pipeline computes what the Python calls give (each file into its expert, then set_adapters)."""
    argv = [*TINY, "--lora", f"{files['first']}:0.5", "--lora", str(files["second"])]
    options = wan22_t2v.parse_args(argv)
    assert [(lora.path, lora.scale) for lora in options.loras] == [(files["first"], 0.5), (files["second"], 1.0)]
    device = torch.device("cpu")
    latents = wan22_t2v.generate(wan22_t2v.load(options, device), options, device, 2, "latent")

    pipe = build_pipeline("wan22_t2v", "tiny")
    plain = wan22_t2v.generate(pipe, options, device, 2, "latent")
    pipe.load_lora_weights(lora_tensors(1), adapter_name="one")
    pipe.load_lora_weights(lora_tensors(2), adapter_name="two", load_into_transformer_2=True)
    pipe.set_adapters(["one", "two"], adapter_weights=[0.5, 1.0])
    expected = wan22_t2v.generate(pipe, options, device, 2, "latent")
    assert torch.equal(latents, expected) and not torch.equal(latents, plain)


def test_a_run_with_loras_is_offloaded_bitwise_as_natively(files: dict[str, Path], tmp_path: Path) -> None:
    recipe_argv = [*TINY, "--profile-dir", str(tmp_path / "p"), "--lora", f"{files['first']}:0.7"]
    recipe_argv += ["--lora", str(files["second"])]
    report = compare.main(["--recipe", "wan22_t2v", "--out", str(tmp_path / "report"), "--", *recipe_argv])
    assert report["fidelity"]["latents"]["bitwise_equal"]
    assert report["arguments"]["loras"][0] == {"path": str(files["first"]), "scale": 0.7}


def test_lora_mistakes_are_one_line_before_anything_loads(files: dict[str, Path], tmp_path: Path, capsys) -> None:
    def load(*args, **kwargs):
        raise AssertionError("loaded before --lora was checked")

    not_lora = write(tmp_path / "plain.safetensors", {"transformer.x": torch.zeros(2)})
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 40)
    first = files["first"]
    cases = {
        f"{tmp_path}/none.safetensors": f"error: --lora {tmp_path}/none.safetensors: no such file",
        f"{tmp_path}/style.bin": f"error: --lora {tmp_path}/style.bin: LoRA weights are read from .safetensors files",
        f"{first}:strong": f"error: --lora {first}:strong: the LoRA's scale after ':' must be a number: pass e.g. "
        f"--lora {first}:0.8",
        f"{first}:nan": f"error: --lora {first}:nan: the LoRA's scale after ':' must be a number",
        str(garbage): f"error: --lora {garbage} is not a readable safetensors file (",
        str(not_lora): f"error: --lora {not_lora} holds no LoRA weights (none of its 1 tensors has 'lora' in its name)",
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wan22_t2v, "load", load)
        for value, says in cases.items():
            assert wan_cli_refusal([*TINY, "--lora", value], capsys).startswith(says), value
        err = wan_cli_refusal([*TINY, "--lora", str(first), "--gpus", "2"], capsys)
        assert err.startswith("error: --lora cannot be combined with --gpus 2 yet")


def test_a_lora_that_does_not_fit_the_model_is_one_line(tmp_path: Path, capsys) -> None:
    """Checked once the weights are loaded: another model's shapes, or names of no layer of the model."""
    wide = {k: torch.zeros(v.shape[0], 2 * v.shape[1]) if "lora_A" in k else v for k, v in lora_tensors(1).items()}
    other = write(tmp_path / "other.safetensors", wide)  # lora_A of a model twice as wide
    err = wan_cli_refusal([*TINY, "--lora", str(other)], capsys)
    assert err.startswith(f"error: --lora {other} does not fit the model's transformer (")
    nowhere = {
        "transformer.nowhere.lora_A.weight": torch.zeros(4, 8),
        "transformer.nowhere.lora_B.weight": torch.zeros(8, 4),
    }
    for name, tensors in {"elsewhere": nowhere, "half": dict(list(nowhere.items())[:1])}.items():
        path = write(tmp_path / f"{name}.safetensors", tensors)
        assert wan_cli_refusal([*TINY, "--lora", str(path)], capsys).startswith(
            f"error: --lora {path} does not fit the model"
        )
