"""Every diffusers LoRA method called on an offloaded Wan2.2 pipeline gives the latents the same calls give natively,
on the first expert (``transformer``) and on the second (``transformer_2``, ``load_into_transformer_2=True``), with
the LoRA loaded after enabling offload (its weights are added to the offloaded model) or before (its weights are
packed with the blocks', so unloading or deleting it takes packed tensors out of the model).

LoRA state dicts are made in memory, as diffusers' own tests make them: ``add_adapter`` on a copy of the
transformer with random (not zero) weights, read back with peft's ``get_peft_model_state_dict``."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.recipes.models import build_pipeline
from tests.models import enable_with_one_component_in_ram, set_host_overhead, wan_latents

peft = pytest.importorskip("peft")
from peft.utils import get_peft_model_state_dict  # noqa: E402

BUDGET = 250_000
TARGETS = ("transformer", "transformer_2")
#: Layers the LoRAs adapt: attention projections and the feed-forward's output.
LORA_MODULES = ["to_q", "to_v", "to_out.0", "ffn.net.2"]

Step = Callable[[object], object]


def lora_state_dict(pipe, seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    """A Wan LoRA as ``load_lora_weights`` reads it (keys ``transformer.…``), random weights of the right shapes."""
    model = copy.deepcopy(pipe.transformer)
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=LORA_MODULES, init_lora_weights=False)
    model.add_adapter(config, adapter_name="made")
    return {f"transformer.{key}": value for key, value in get_peft_model_state_dict(model, adapter_name="made").items()}


def latents(pipe) -> torch.Tensor:
    """Two steps (one per expert) with CFG: every LoRA'd expert computes."""
    return wan_latents(pipe, num_inference_steps=2)


@dataclass
class Lockstep:
    """A native and an offloaded pipeline given the same calls; their latents compared after each."""

    native: object
    offloaded: object
    outputs: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def start(
        cls, before_enable: list[Step], without_lora: bool = False, device: str = "cpu", enable: Step | None = None
    ) -> Lockstep:
        """``without_lora``: the native latents without any LoRA are ``outputs[0]``; ``enable``: how offload is
        enabled (else at `BUDGET` on ``device``)."""
        pair = cls(build_pipeline("wan22_t2v", "tiny").to(device), build_pipeline("wan22_t2v", "tiny"))
        if without_lora:
            pair.outputs.append(latents(pair.native))
        for step in before_enable:
            step(pair.native)
            step(pair.offloaded)
        budget = BUDGET if device == "cpu" else "64MiB"
        (enable or (lambda pipe: pipe.enable_flextensor_offload(budget=budget, device=device)))(pair.offloaded)
        pair.compare()
        return pair

    def do(self, step: Step) -> None:
        step(self.native)
        step(self.offloaded)
        self.compare()

    def compare(self) -> None:
        expected = latents(self.native)
        assert torch.equal(latents(self.offloaded), expected)
        self.outputs.append(expected)

    def changed(self, index: int) -> bool:
        """The call before the ``index``-th comparison changed the latents (the test means something)."""
        return not torch.equal(self.outputs[index], self.outputs[index - 1])

    def finish(self) -> None:
        """Offload disabled, the pipeline still computes what the native one does."""
        self.offloaded.disable_flextensor_offload()
        assert torch.equal(latents(self.offloaded), self.outputs[-1])


def load(target: str, state: dict, name: str, **kwargs: object) -> Step:
    """``load_lora_weights`` of a copy of ``state``: with ``low_cpu_mem_usage`` the model takes the given tensors
    themselves (``assign=True``), and a hotswap then writes into them."""
    into = {"load_into_transformer_2": True} if target == "transformer_2" else {}

    def step(pipe) -> None:
        own = {key: value.clone() for key, value in state.items()}
        pipe.load_lora_weights(own, adapter_name=name, **into, **kwargs)

    return step


@pytest.fixture(scope="module")
def loras() -> dict[str, dict[str, torch.Tensor]]:
    pipe = build_pipeline("wan22_t2v", "tiny")
    return {"a": lora_state_dict(pipe, 1), "a2": lora_state_dict(pipe, 2), "b": lora_state_dict(pipe, 3)}


@pytest.mark.parametrize("target", TARGETS)
def test_load_lora_weights_after_enable_and_hotswap(target: str, loras: dict) -> None:
    """``load_lora_weights`` with ``low_cpu_mem_usage=True`` (diffusers' default: adapter layers made on the meta
    device, then given their weights by the model's ``load_state_dict``) and ``hotswap=True``."""
    pair = Lockstep.start([])
    pair.do(load(target, loras["a"], "a", low_cpu_mem_usage=True))
    assert pair.changed(-1)
    pair.do(load(target, loras["a2"], "a", hotswap=True))
    assert pair.changed(-1)
    pair.finish()


@pytest.mark.parametrize("target", TARGETS)
def test_load_lora_weights_without_low_cpu_mem_usage(target: str, loras: dict) -> None:
    pair = Lockstep.start([])
    pair.do(load(target, loras["a"], "a", low_cpu_mem_usage=False))
    assert pair.changed(-1)
    pair.finish()


@pytest.mark.parametrize("target", TARGETS)
def test_hotswap_of_a_lora_loaded_before_enable(target: str, loras: dict) -> None:
    """The swapped weights are packed ones: written in place, inside ``editing()``."""
    pair = Lockstep.start([load(target, loras["a"], "a")])
    pair.do(load(target, loras["a2"], "a", hotswap=True))
    assert pair.changed(-1)
    pair.finish()


@pytest.mark.parametrize("when", ["loaded after enable", "loaded before enable"])
@pytest.mark.parametrize("target", TARGETS)
def test_adapter_methods(target: str, when: str, loras: dict) -> None:
    """``set_adapters``, ``disable_lora`` / ``enable_lora``, ``delete_adapters`` and ``unload_lora_weights``, then a
    LoRA loaded again under a name an unloaded one had."""
    loads = [load(target, loras["a"], "a"), load(target, loras["b"], "b")]
    pair = Lockstep.start(loads if when == "loaded before enable" else [], without_lora=True)
    if when == "loaded after enable":
        for step in loads:
            pair.do(step)
    pair.do(lambda pipe: pipe.set_adapters(["a", "b"], adapter_weights=[0.5, 1.5]))
    assert pair.changed(-1)
    pair.do(lambda pipe: pipe.disable_lora())
    assert torch.equal(pair.outputs[-1], pair.outputs[0])
    pair.do(lambda pipe: pipe.enable_lora())
    pair.do(lambda pipe: pipe.delete_adapters("a"))
    assert pair.changed(-1)
    pair.do(lambda pipe: pipe.unload_lora_weights())
    assert torch.equal(pair.outputs[-1], pair.outputs[0])
    pair.do(load(target, loras["a2"], "a"))
    assert pair.changed(-1)
    pair.finish()


@pytest.mark.parametrize("when", ["loaded after enable", "loaded before enable"])
@pytest.mark.parametrize("target", TARGETS)
def test_fuse_and_unfuse_lora(target: str, when: str, loras: dict) -> None:
    """``fuse_lora`` writes the base weights (packed) and ``unfuse_lora`` takes the LoRA out again; the adapter is
    then unloaded, leaving the base weights as fusing and unfusing left them."""
    first = load(target, loras["a"], "a")
    pair = Lockstep.start([first] if when == "loaded before enable" else [])
    if when == "loaded after enable":
        pair.do(first)
    pair.do(lambda pipe: pipe.fuse_lora(components=[target], lora_scale=0.75))
    pair.do(lambda pipe: pipe.unfuse_lora(components=[target]))
    pair.do(lambda pipe: pipe.unload_lora_weights())
    pair.finish()


def test_adapter_methods_on_an_expert_waiting_on_disk(loras: dict, tmp_path, monkeypatch) -> None:
    """A host budget of one expert: the LoRA'd second expert waits in a cache file when each method is called."""
    set_host_overhead(monkeypatch, own=0, reserve=0)
    enable = lambda pipe: enable_with_one_component_in_ram(pipe, BUDGET, tmp_path)  # noqa: E731
    pair = Lockstep.start([load("transformer_2", loras["a"], "a")], enable=enable)
    tier = ft.pipeline_offload(pair.offloaded)
    steps = [
        load("transformer_2", loras["b"], "b"),
        lambda pipe: pipe.set_adapters(["a", "b"], adapter_weights=[0.3, 1.0]),
        lambda pipe: pipe.delete_adapters("a"),
        lambda pipe: pipe.unload_lora_weights(),
    ]
    for step in steps:
        tier.handles["transformer"].activate()  # the second expert moves out to disk
        assert "transformer_2" in tier.host_tier.report()["on_disk"]
        pair.do(step)
    pair.finish()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("when", ["loaded after enable", "loaded before enable"])
def test_adapter_methods_on_cuda(when: str, loras: dict) -> None:
    loads = [load("transformer_2", loras["a"], "a"), load("transformer", loras["b"], "b")]
    pair = Lockstep.start(loads if when == "loaded before enable" else [], device="cuda")
    for step in loads if when == "loaded after enable" else []:
        pair.do(step)
    pair.do(lambda pipe: pipe.set_adapters(["a", "b"], adapter_weights=[0.5, 1.5]))
    pair.do(lambda pipe: pipe.fuse_lora(components=["transformer"], lora_scale=0.75))
    pair.do(lambda pipe: pipe.unfuse_lora(components=["transformer"]))
    pair.do(load("transformer_2", loras["a2"], "a", hotswap=True))
    pair.do(lambda pipe: pipe.delete_adapters("a"))
    pair.do(lambda pipe: pipe.unload_lora_weights())


def test_an_adapter_packed_at_enable_and_unloaded_is_not_taken_for_a_swap(loras: dict) -> None:
    """Its packed weights are out of the model: the handle drops them, and still refuses a real swap."""
    pair = Lockstep.start([load("transformer", loras["a"], "a")])
    pair.do(lambda pipe: pipe.unload_lora_weights())
    handle = ft.pipeline_offload(pair.offloaded).handles["transformer"]
    assert handle.device_copies.dropped  # the adapter's packed weights
    handle.release()
    block = pair.offloaded.transformer.blocks[0].attn1.to_q
    block.weight = torch.nn.Parameter(block.weight.detach().clone())
    with pytest.raises(ft.OffloadStateError, match=r"blocks\.0\.attn1\.to_q\.(base_layer\.)?weight.*editing\(\)"):
        latents(pair.offloaded)
