"""Which component is expected to run next: what is read ahead, and which switch a forecast is made for.

The pipeline declares an order (diffusers' ``model_cpu_offload_seq``) but a run may skip components (a
latents generation runs no VAE; prompts given as embeddings run no text encoder), so the order seen last
time comes first and the declared one only fills in what has not been seen yet.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any


def offload_order(pipeline: Any) -> list[str]:
    """The order the pipeline declares its components run in (diffusers' ``model_cpu_offload_seq``,
    e.g. ``"text_encoder->transformer->transformer_2->vae"``)."""
    seq = getattr(pipeline, "model_cpu_offload_seq", None)
    return [name.strip() for name in seq.split("->") if name.strip()] if isinstance(seq, str) else []


class ComponentOrder:
    """Which component is expected to run after another: the one seen after it last time, else the
    next one in the pipeline's declared order (wrapping around, to the next generation)."""

    def __init__(self, declared: list[str]) -> None:
        self.declared = declared
        self.seen_after: dict[str, str] = {}
        self._last: str | None = None

    def note(self, name: str) -> None:
        """``name`` becomes active now."""
        if self._last is not None and self._last != name:
            self.seen_after[self._last] = name
        self._last = name

    def expected_chain(self, name: str, candidates: Collection[str]) -> list[str]:
        """The components expected after ``name``, in order, each once, until ``name`` would come again
        (Wan2.2 without a VAE decode: after the low-noise expert, the high-noise one of the next generation)."""
        chain: list[str] = []
        after = self.expected_after(name, candidates)
        while after is not None and after != name and after not in chain:
            chain.append(after)
            after = self.expected_after(after, candidates)
        return chain

    def expected_after(self, name: str, candidates: Collection[str]) -> str | None:
        """The one component expected right after ``name`` among ``candidates`` (None: no guess)."""
        seen = self.seen_after.get(name)
        if seen is not None and seen in candidates:
            return seen
        declared = [n for n in self.declared if n in candidates]
        if name not in declared or len(declared) < 2:
            return None
        return declared[(declared.index(name) + 1) % len(declared)]

    def seen_before(self) -> dict[str, str]:
        """For each component seen after another, the one seen before it (what a forecast is made after)."""
        return {after: name for name, after in self.seen_after.items()}
