"""`chunk_feed_forward`: at one chunk a Wan block's forward is bitwise diffusers' own (both temb layouts); chunked, the
tiny Wan2.2 pipeline offloaded is bitwise equal to the same chunked pipeline run natively (eagerly, with layerwise
fp8 casting, regionally compiled, and through the recipe's ``--ffn-chunks``); what it cannot change without changing
the math is refused, the model unchanged; and the block's activation peak at 81 frames falls with the chunk count
(`benchmarks/quantized_bench.py --trace-block`, on the meta device)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed, WanTransformerBlock

import flextensor_diffusers as ft
from flextensor_diffusers.engine.profile import model_fingerprint
from flextensor_diffusers.pipelines import feed_forward
from flextensor_diffusers.pipelines.compile import compile_pipeline
from flextensor_diffusers.recipes import wan22_t2v
from flextensor_diffusers.recipes.models import build_pipeline
from tests.models import TINY_WAN_ARGV, assert_same, snapshot, wan_cli_refusal, wan_latents

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 250_000  # streams the tiny transformers' blocks through two slots
#: With fp8 blocks, the experts alone (the text encoder would need 125 KiB): each streams its blocks.
FP8_BUDGET = 110_000
EXPERTS = ("transformer", "transformer_2")


def block_and_inputs(dtype: torch.dtype, temb_ndim: int) -> tuple[WanTransformerBlock, tuple]:
    """A small Wan block in the dtypes Wan loads in (fp32 table and norm2), and inputs of batch 2 whose 180 tokens
    do not divide by every chunk count."""
    torch.manual_seed(0)
    block = WanTransformerBlock(64, 160, 4, "rms_norm_across_heads", True, 1e-6).to(dtype)
    block.scale_shift_table.data = block.scale_shift_table.data.float()
    block.norm2.float()
    tokens = 3 * 6 * 10
    hidden, context = torch.randn(2, tokens, 64).to(dtype), torch.randn(2, 7, 64).to(dtype)
    temb = torch.randn(2, 6, 64) if temb_ndim == 3 else torch.randn(2, tokens, 6, 64)
    rope = WanRotaryPosEmbed(16, (1, 2, 2), 32)(torch.zeros(1, 16, 3, 12, 20))
    return block.eval().requires_grad_(False), (hidden, context, temb, rope)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temb_ndim", [3, 4], ids=["temb 3-d (A14B)", "temb 4-d (TI2V)"])
def test_one_chunk_is_bitwise_diffusers_forward_and_unchunking_restores_it(dtype, temb_ndim) -> None:
    block, inputs = block_and_inputs(dtype, temb_ndim)
    with torch.inference_mode():
        native = block(*inputs)
        assert ft.chunk_feed_forward(block, chunks=1) == 1
        assert torch.equal(block(*inputs), native)
        for chunks in (2, 7, 1000):  # uneven slices, and more chunks than tokens
            ft.chunk_feed_forward(block, chunks)
            assert ft.feed_forward_chunks(block) == chunks
            chunked = block(*inputs)
            assert chunked.shape == native.shape and chunked.dtype == native.dtype
            torch.testing.assert_close(chunked, native)  # equal in value, not necessarily in every bit
        assert ft.unchunk_feed_forward(block) == 1
        assert not {"forward", feed_forward.CHUNKS_ATTRIBUTE, ft.engine.VARIANT_ATTRIBUTE} & set(vars(block))
        assert torch.equal(block(*inputs), native)


def chunked_pipeline(chunks: int, layerwise_fp8: bool = False):
    pipe = build_pipeline("wan22_t2v", "tiny")
    for name in EXPERTS:
        if layerwise_fp8:
            getattr(pipe, name).enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
        assert ft.chunk_feed_forward(getattr(pipe, name), chunks) == 4
    return pipe


@pytest.mark.parametrize("layerwise_fp8", [False, True], ids=["fp32", "layerwise fp8"])
def test_offloaded_chunked_pipeline_is_bitwise_the_native_chunked_one(layerwise_fp8: bool) -> None:
    """12 tokens in 5 chunks (slices of 3, 3, 3, 3), with CFG, both experts; offload streams the blocks (layerwise
    casting's hooks then cast each linear up and down once per chunk, as natively)."""
    pipe = chunked_pipeline(5, layerwise_fp8)
    native = wan_latents(pipe)
    before = {name: snapshot(getattr(pipe, name)) for name in EXPERTS}
    if layerwise_fp8:
        pipe.enable_flextensor_offload(budget=FP8_BUDGET, device="cpu", components=list(EXPERTS))
    else:
        pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
    outs = [wan_latents(pipe) for _ in range(2)]  # profiling inside the first, the plan in the second
    assert all(torch.equal(out, native) for out in outs)
    report = pipe.flextensor_report()["components"]
    assert all(report[name]["streamed_units"] > 0 for name in EXPERTS)
    pipe.disable_flextensor_offload()
    for name, snap in before.items():
        assert_same(snap, getattr(pipe, name))
    assert ft.feed_forward_chunks(pipe.transformer) == 5  # offloading neither needs nor removes it


def test_regionally_compiled_chunked_blocks_stream_bitwise_without_recompiling(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    native_pipe = chunked_pipeline(3)
    compile_pipeline(native_pipe, "regional")
    native = wan_latents(native_pipe, num_inference_steps=3)
    pipe = chunked_pipeline(3)
    compile_pipeline(pipe, "regional")
    pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
    outs = [wan_latents(pipe, num_inference_steps=3) for _ in range(2)]
    warm = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # torch private: its graph counter
    outs.append(wan_latents(pipe, num_inference_steps=3))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == warm, "recompiled after warm-up"
    assert all(torch.equal(out, native) for out in outs)
    pipe.disable_flextensor_offload()


def test_the_recipe_chunks_both_experts_and_writes_the_native_chunked_bytes(tmp_path: Path) -> None:
    options = wan22_t2v.parse_args([*TINY_WAN_ARGV, "--ffn-chunks", "2"])
    pipe = wan22_t2v.load(options, torch.device("cpu"))
    assert options.ffn_chunks == 2 and all(ft.feed_forward_chunks(getattr(pipe, n)) == 2 for n in EXPERTS)
    videos = {}
    for mode in ("offloaded", "native"):
        output = tmp_path / f"{mode}.mp4"
        extra = ["--no-offload"] if mode == "native" else []
        wan22_t2v.main([*TINY_WAN_ARGV, "--ffn-chunks", "2", "-q", *extra, "--output", str(output)])
        videos[mode] = output.read_bytes()
    assert videos["offloaded"] == videos["native"]


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_bad_chunk_count_is_one_line_before_anything_loads(value: str, capsys) -> None:
    line = wan_cli_refusal([*TINY_WAN_ARGV, "--ffn-chunks", value], capsys)
    assert f"--ffn-chunks {value}: pass a whole number of 1 or more" in line


def assert_refused(model: torch.nn.Module, match: str, *, chunks: int = 2) -> None:
    before = {name: dict(vars(m)) for name, m in model.named_modules()}
    with pytest.raises(ft.FeedForwardChunkingError, match=match):
        ft.chunk_feed_forward(model, chunks)
    assert {name: dict(vars(m)) for name, m in model.named_modules()} == before


def test_what_it_cannot_change_without_changing_the_math_is_refused(monkeypatch) -> None:
    from diffusers.models.transformers import transformer_chronoedit

    block, _ = block_and_inputs(torch.float32, 3)
    for bad in (0, -3, True, 1.5):
        assert_refused(block, "pass a whole number >= 1", chunks=bad)
    assert_refused(torch.nn.Linear(4, 4), "has no WanTransformerBlock")
    copy = transformer_chronoedit.WanTransformerBlock(64, 160, 4, "rms_norm_across_heads", True, 1e-6)
    assert_refused(copy, r"knows diffusers' diffusers\.models\.transformers\.transformer_wan\.WanTransformerBlock")

    class Subclass(WanTransformerBlock):
        pass

    holder = torch.nn.Module()
    holder.blocks = torch.nn.ModuleList([Subclass(64, 160, 4, "rms_norm_across_heads", True, 1e-6)])
    holder._repeated_blocks = ["Subclass"]
    assert_refused(holder, "Subclass: leave its feed-forward unchunked")

    from diffusers.hooks import HookRegistry, ModelHook

    hooked, _ = block_and_inputs(torch.float32, 3)
    HookRegistry.check_if_exists_or_initialize(hooked).register_hook(ModelHook(), "probe")
    assert_refused(hooked, "has a forward of its own already")

    monkeypatch.setattr(feed_forward, "VERIFIED_FORWARDS", {"0" * 64: "0.0.0"})
    feed_forward.verified_block.cache_clear()
    try:
        assert_refused(block, r"WanTransformerBlock\.forward is not the one it was verified against.*install diffusers")
    finally:
        monkeypatch.undo()
        feed_forward.verified_block.cache_clear()


def test_an_offloaded_model_is_refused_until_disabled_and_profiles_tell_chunk_counts_apart() -> None:
    pipe = build_pipeline("wan22_t2v", "tiny")
    plain = model_fingerprint(pipe.transformer, [])
    pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
    assert_refused(pipe.transformer, "while it is offloaded")
    pipe.disable_flextensor_offload()
    ft.chunk_feed_forward(pipe.transformer, 2)
    two = model_fingerprint(pipe.transformer, [])
    ft.chunk_feed_forward(pipe.transformer, 4)
    assert len({plain["sha256"], two["sha256"], model_fingerprint(pipe.transformer, [])["sha256"]}) == 3
    ft.unchunk_feed_forward(pipe.transformer)
    assert model_fingerprint(pipe.transformer, []) == plain


def test_the_peak_at_81_frames_falls_with_chunks_until_attention_binds(tmp_path: Path) -> None:
    """One full-size block at 32 760 tokens on the meta device (no FLOPs): diffusers' forward peaks in its fp32
    feed-forward residual; chunked, the feed-forward stage shrinks with the count and self-attention binds."""
    out = tmp_path / "peak.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "quantized_bench.py"),
        "--trace-block",
        "--trace-weights",
        "bf16",
        "--trace-chunks",
        "1,4",
    ]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    native, one, four = json.loads(out.read_text())["rows"]
    assert native["tokens"] == 32760 and native["forward"] == "native" and four["chunks"] == 4
    stages = [row["stage_peak_bytes"] for row in (native, one, four)]
    assert native["peak_bytes"] == stages[0]["feed_forward"] > stages[0]["self_attention"]
    assert stages[1]["feed_forward"] < stages[0]["feed_forward"]
    assert stages[2]["feed_forward"] < 0.6 * stages[1]["feed_forward"]
    assert four["peak_bytes"] == stages[2]["self_attention"] < native["peak_bytes"]
