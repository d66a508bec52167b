"""What a REPL user meets on an offloaded pipeline: a short repr, and ``pipe.to`` refused until offload is disabled."""

from __future__ import annotations

import pytest

import flextensor_diffusers as ft
from flextensor_diffusers.recipes.models import build_pipeline


def test_moving_an_offloaded_pipeline_is_refused_until_offload_is_disabled() -> None:
    pipe = build_pipeline("wan22_t2v", "tiny")
    state = pipe.enable_flextensor_offload(budget="256KiB", device="cpu")
    text = repr(state)
    assert "\n" not in text and len(text) < 200, text
    assert text.startswith("<flextensor offload of WanPipeline on cpu, budget 256.00 KiB, components: ")
    with pytest.raises(ft.OffloadStateError, match=r"call pipe\.disable_flextensor_offload\(\) first"):
        pipe.to("cpu")
    pipe.disable_flextensor_offload()
    assert pipe.to("cpu") is pipe  # diffusers' own method again
    assert "components: none: disabled" in repr(state)


def test_a_refused_enable_leaves_pipe_to_as_it_was() -> None:
    pipe = build_pipeline("wan22_t2v", "tiny")
    with pytest.raises(ft.BudgetError):
        pipe.enable_flextensor_offload(budget="1KiB", device="cpu")
    assert "to" not in vars(pipe) and pipe.to("cpu") is pipe
