"""Pipelines that share components: one offload for all of them.

Diffusers pipelines are often made from another's components (``OtherPipeline(**pipe.components)``): the modules
are the same objects, so their offload (host copies, handles, boundaries) is already in place, made by the first
pipeline's ``enable_flextensor_offload``. Offloading them again would pack views of host copies as if they were
weights. So an offload belongs to its components (`ComponentOwners`), and a pipeline whose components are all
those of one offload, by name and by identity, *joins* it when it asks for the same options (`SharedOffload`):
both run from one set of host copies, only one component of either holding device memory at a time, and disabling
offload on any of them disables it for all. Anything else is refused before anything changes, naming the fix: a
pipeline with only some of another's offloaded components, or with other options.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..engine import OffloadStateError


@dataclass(frozen=True)
class EnableCall:
    """The arguments of one ``enable_flextensor_offload`` call, as given: a pipeline joins an offload only when
    asked for the same one (budget, device, patterns, host budget, `OffloadConfig` options...)."""

    arguments: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, **arguments: Any) -> EnableCall:
        return cls(tuple(sorted(arguments.items())))

    def differences(self, other: EnableCall) -> list[str]:
        """The names of the arguments given other values in ``other``."""
        mine, theirs = dict(self.arguments), dict(other.arguments)
        return [name for name in sorted(mine.keys() | theirs.keys()) if mine.get(name) != theirs.get(name)]


class ComponentOwners:
    """Which offload each offloaded component belongs to (weakly: a module gone is forgotten)."""

    def __init__(self) -> None:
        self._owner: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()

    def claim(self, module: nn.Module, offload: Any) -> None:
        self._owner[module] = offload

    def release(self, offload: Any) -> None:
        for module in [m for m, owner in self._owner.items() if owner is offload]:
            del self._owner[module]

    def owners(self, components: dict[str, nn.Module]) -> list[Any]:
        """The distinct offloads that some of ``components`` belong to."""
        found: dict[int, Any] = {}
        for module in components.values():
            owner = self._owner.get(module)
            if owner is not None:
                found[id(owner)] = owner
        return list(found.values())


#: Every live pipeline offload's components.
OWNERS = ComponentOwners()


@dataclass(frozen=True)
class SharedOffload:
    """What a pipeline asks of an offload its components already belong to: whether it may join, or why not."""

    offload: Any  # the `PipelineOffload` the components belong to
    components: dict[str, nn.Module]  # the joining pipeline's components with weights
    call: EnableCall

    def check(self) -> None:
        """Refuse, naming the fix, unless the pipeline has exactly the offload's components and asks the same."""
        first = type(self.offload.pipeline).__name__
        fix = f"or call disable_flextensor_offload() on that {first} first"
        ours = self.offload.components()
        same = ours.keys() == self.components.keys() and all(ours[n] is m for n, m in self.components.items())
        if not same:
            shared = [n for n, m in self.components.items() if ours.get(n) is m]
            raise OffloadStateError(
                f"component(s) {', '.join(map(repr, shared or list(self.components)))} of this pipeline are offloaded "
                f"with a {first} whose components ({', '.join(ours)}) are not all this pipeline's "
                f"({', '.join(self.components)}): a pipeline made from all of them shares that offload; {fix}"
            )
        differ = self.offload.call.differences(self.call)
        if differ:
            raise OffloadStateError(
                f"this pipeline's components are offloaded with a {first}, with other options "
                f"({', '.join(differ)}): enable with the same options to share that offload, {fix}"
            )


def refuse_unshareable(owners: list[Any], components: dict[str, nn.Module]) -> None:
    """Components offloaded with several pipelines that share none: refused (each must be disabled first)."""
    if len(owners) > 1:
        names = ", ".join(type(o.pipeline).__name__ for o in owners)
        raise OffloadStateError(
            f"this pipeline's components ({', '.join(components)}) are offloaded with several pipelines ({names}): "
            "call disable_flextensor_offload() on them first"
        )
