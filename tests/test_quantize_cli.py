"""``--quantize int8|fp8`` and ``--gguf`` in the Wan2.2 recipe: the tiny recipe quantized (torchao) or loaded from a
GGUF file written here (Q8_0 linears, original Wan names, as diffusers' single-file loader reads them) writes,
offloaded, the same mp4 bytes as natively with the same quantized weights; LoRAs load first and stay unquantized; a bad
value, file or combination is one line and exit status 2 before anything loads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from flextensor_diffusers.recipes import wan22_t2v
from flextensor_diffusers.recipes.models import build_pipeline
from flextensor_diffusers.reports import compare
from tests.models import wan_cli_refusal

pytest.importorskip("torchao")
#: The text encoder, moved whole, needs 122.5 KiB; each int8 expert (161 KiB) then streams its blocks.
TINY = ["--random-weights", "tiny", "--device", "cpu", "-q", "--budget", "128000"]
#: A model folder of the tiny pipeline in bf16 (as the recipe loads --model) needs 110.5 KiB; a Q8_0 expert streams.
FOLDER_RUN = ["--frames", "9", "--height", "32", "--width", "32", "--steps", "2", "--device", "cpu", "-q"]
FOLDER_BUDGET = ["--budget", "113152"]


def run_mp4(argv: list[str], tmp_path: Path, name: str) -> tuple[bytes, dict]:
    output = tmp_path / f"{name}.mp4"
    summary = wan22_t2v.main([*argv, "--profile-dir", str(tmp_path / "profiles"), "--output", str(output)])
    return output.read_bytes(), summary


def test_an_int8_run_writes_the_bytes_of_the_native_int8_run(tmp_path: Path) -> None:
    offloaded, summary = run_mp4([*TINY, "--quantize", "int8"], tmp_path, "offloaded")
    native, _ = run_mp4([*TINY, "--quantize", "int8", "--no-offload"], tmp_path, "native")
    plain, _ = run_mp4([*TINY, "--no-offload"], tmp_path, "plain")
    assert offloaded == native and offloaded != plain
    transformer = summary["offload_report"]["components"]["transformer"]
    assert transformer["streamed_units"] > 0  # the quantized blocks streamed


def test_quantize_keeps_loras_unquantized_over_quantized_base_layers(tmp_path: Path) -> None:
    """``--lora`` loads before ``--quantize``: peft's adapters stay plain, the layers under them are torchao's."""
    from tests.test_lora_cli import lora_tensors, write

    lora = write(tmp_path / "style.safetensors", lora_tensors(1))
    options = wan22_t2v.parse_args([*TINY, "--quantize", "int8", "--lora", f"{lora}:0.5"])
    to_q = wan22_t2v.load(options, torch.device("cpu")).transformer.blocks[0].attn1.to_q
    assert type(to_q.base_layer.weight.data).__name__ == "Int8Tensor"
    assert type(to_q.lora_A["lora0"].weight.data) is torch.Tensor
    argv = [*TINY, "--budget", "140000", "--profile-dir", str(tmp_path / "p"), "--quantize", "int8"]
    argv += ["--lora", f"{lora}:0.5"]  # the adapters make each expert larger than TINY's budget streams
    report = compare.main(["--recipe", "wan22_t2v", "--out", str(tmp_path / "report"), "--", *argv])
    assert report["fidelity"]["latents"]["bitwise_equal"]


# ------------------------------------------------------------------------------------------------ GGUF

#: diffusers' names -> the original Wan checkpoint's, the inverse of convert_wan_transformer_to_diffusers.
ORIGINAL_NAMES = (
    ("condition_embedder.time_embedder.linear_", "time_embedding.L"),
    ("condition_embedder.text_embedder.linear_", "text_embedding.L"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn1", "self_attn"),
    ("attn2", "cross_attn"),
    (".to_out.0.", ".o."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    ("proj_out", "head.head"),
    ("norm2", "norm_swap"),
    ("norm3", "norm2"),
    ("norm_swap", "norm3"),
    ("scale_shift_table", "modulation"),
)


def original_name(name: str) -> str:
    if name == "scale_shift_table":
        return "head.modulation"
    for ours, theirs in ORIGINAL_NAMES:
        name = name.replace(ours, theirs)
    return name.replace("embedding.L1", "embedding.0").replace("embedding.L2", "embedding.2")


def write_gguf(path: Path, transformer: torch.nn.Module) -> Path:
    """The transformer's state dict as a GGUF file: Q8_0 for 2-D weights whose rows hold whole 32-value blocks,
    F32 for the rest."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch="wan")
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, tensor in transformer.state_dict().items():
        array = tensor.detach().float().numpy()
        if array.ndim == 2 and array.shape[1] % 32 == 0:
            writer.add_tensor(original_name(name), gguf.quants.quantize(array, q8), raw_dtype=q8)
        else:
            writer.add_tensor(original_name(name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory) -> dict[str, Path]:
    """A tiny Wan2.2 model folder, and a GGUF file of each of its experts."""
    pytest.importorskip("gguf")
    folder = tmp_path_factory.mktemp("gguf")
    pipe = build_pipeline("wan22_t2v", "tiny")
    pipe.save_pretrained(folder / "model")
    return {
        "model": folder / "model",
        "high": write_gguf(folder / "high.gguf", pipe.transformer),
        "low": write_gguf(folder / "low.gguf", pipe.transformer_2),
    }


def test_gguf_experts_load_quantized_and_stream_bitwise(gguf_model: dict[str, Path], tmp_path: Path) -> None:
    from diffusers.quantizers.gguf.utils import GGUFParameter

    both = f"{gguf_model['high']},{gguf_model['low']}"
    argv = ["--model", str(gguf_model["model"]), "--gguf", both, *FOLDER_RUN]
    options = wan22_t2v.parse_args(argv)
    assert options.gguf.by_expert() == {"transformer": gguf_model["high"], "transformer_2": gguf_model["low"]}
    pipe = wan22_t2v.load(options, torch.device("cpu"))
    for expert in (pipe.transformer, pipe.transformer_2):
        assert isinstance(expert.blocks[0].attn1.to_q.weight, GGUFParameter)
    offloaded, summary = run_mp4([*argv, *FOLDER_BUDGET], tmp_path, "offloaded")
    native, _ = run_mp4([*argv, "--no-offload"], tmp_path, "native")
    assert offloaded == native
    assert summary["offload_report"]["components"]["transformer"]["streamed_units"] > 0


def test_one_gguf_file_replaces_the_first_expert_only(gguf_model: dict[str, Path]) -> None:
    from diffusers.quantizers.gguf.utils import GGUFParameter

    argv = ["--model", str(gguf_model["model"]), "--gguf", str(gguf_model["high"]), *FOLDER_RUN]
    pipe = wan22_t2v.load(wan22_t2v.parse_args(argv), torch.device("cpu"))
    assert isinstance(pipe.transformer.blocks[0].attn1.to_q.weight, GGUFParameter)
    assert not isinstance(pipe.transformer_2.blocks[0].attn1.to_q.weight, GGUFParameter)


# ------------------------------------------------------------------------------------------------ user errors


def test_quantized_mistakes_are_one_line_before_anything_loads(
    gguf_model: dict[str, Path], tmp_path: Path, capsys
) -> None:
    def load(*args, **kwargs):
        raise AssertionError("loaded before the flags were checked")

    model = ["--model", str(gguf_model["model"]), *FOLDER_RUN]
    high = gguf_model["high"]
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + b"\x00" * 12)
    other = write_gguf(tmp_path / "other.gguf", torch.nn.Linear(32, 4))
    cases = {
        (*TINY, "--quantize", "int8", "--gpus", "2"): "error: --quantize cannot be combined with --gpus 2 yet",
        (*model, "--gguf", str(high), "--gpus", "2"): "error: --gguf cannot be combined with --gpus 2 yet",
        (*TINY, "--gguf", str(high)): "error: --gguf replaces the transformers of a model folder",
        (*model, "--gguf", str(high), "--quantize", "fp8"): "error: --gguf loads quantized transformers already: "
        "drop --quantize fp8",
        (*model, "--gguf", f"{high},{high},{high}"): f"error: --gguf {high},{high},{high}: pass one file",
        (*model, "--gguf", f"{high},"): f"error: --gguf {high},: pass one file",
        (*model, "--gguf", str(tmp_path / "none.gguf")): f"error: --gguf {tmp_path}/none.gguf: no such file",
        (*model, "--gguf", str(tmp_path / "w.safetensors")): f"error: --gguf {tmp_path}/w.safetensors: "
        "GGUF weights are read from .gguf files",
        (*model, "--gguf", str(garbage)): f"error: --gguf {garbage} is not a readable GGUF file (",
        (*model, "--gguf", str(other)): f"error: --gguf {other} holds no Wan transformer",
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wan22_t2v, "load", load)
        for argv, says in cases.items():
            assert wan_cli_refusal(list(argv), capsys).startswith(says), argv
        with pytest.raises(SystemExit) as info:  # argparse's own refusal: its usage, then the line
            wan22_t2v.cli([*TINY, "--quantize", "int4"])
        assert info.value.code == 2
        assert "error: argument --quantize: invalid choice: 'int4'" in capsys.readouterr().err.splitlines()[-1]


def test_a_missing_optional_package_is_one_line(monkeypatch, capsys) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    err = wan_cli_refusal([*TINY, "--quantize", "int8"], capsys)
    assert err == 'error: --quantize int8 needs the torchao package: pip install -e ".[quantize]"'
