"""Where streaming meets the model: the calls of its units and of its entry points.

Streaming has to run *between* compiled regions, never inside one: a hook traced by
``torch.compile`` would be replayed as a graph without its side effects (the loads, the events),
silently computing with whatever a slot holds. So no module hooks (which ``module.compile()`` and
``compile_repeated_blocks`` compile together with the forward); instead:

* **units** keep their class (dynamo guards on it: a new class would recompile their regions) and
  get three instance attributes: ``_call_impl`` (the eager path: the handle's work around the
  original), ``_compiled_call_impl`` when the unit was compiled before (the same work around the
  compiled region), and ``compile`` (a later ``unit.compile(...)`` compiles the original and
  wraps the result the same way, refusing CUDA graphs, which would replay kernels outside the
  events that order slot reuse). The compiled region is exactly the one native compilation makes.
* the **model** gets its class swapped for a same-named subclass whose ``__call__`` does the
  workload's work, hidden from dynamo, and whose ``compile()`` is refused: whole-model compilation
  (`refuse_whole_model_compile`) would have to break its graph at every unit, so its kernels
  (fusions across block boundaries) and outputs would differ from the same compilation run natively.
* the handle's work (``enter``/``exit``) is hidden from dynamo entirely.

`Boundaries.remove` puts every attribute and class back.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .errors import FlexTensorError

#: Instance attribute holding a module's `Crossing` (absent: the subclass behaves as its base).
ATTRIBUTE = "_flextensor_crossing"
_SUBCLASSES: dict[type, type] = {}
_CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass(frozen=True)
class Crossing:
    """What runs when a call crosses a boundary; every callable is hidden from dynamo.

    ``exit`` is given the call's output; ``fail`` the exception it raised, and may return another one to
    raise in its place (one that names the fix)."""

    enter: Callable[[tuple, dict], None]
    exit: Callable[[Any], None]
    fail: Callable[[BaseException], BaseException | None]
    compiled: Callable[[], None] | None = None  # a unit was compiled: its compute times change


def hidden(fn: Callable) -> Callable:
    """``fn`` never traced by dynamo, nor anything it calls."""
    return torch.compiler.disable(fn)


def _refuse_cudagraphs(kwargs: dict, module: nn.Module) -> None:
    """Refuse ``torch.compile`` keyword arguments that capture CUDA graphs (its options are keyword-only)."""
    mode = kwargs.get("mode")
    options = kwargs.get("options") or {}
    if mode in _CUDAGRAPH_MODES or options.get("triton.cudagraphs"):
        raise FlexTensorError(
            f"torch.compile with CUDA graphs (mode={mode!r}) is not supported on an offloaded "
            f"{type(module).__name__}: graphs would replay outside the events that order streaming (and per "
            "block they fail natively too, each replay overwriting the previous block's output). Use "
            "mode='default' or 'max-autotune-no-cudagraphs'"
        )


WHOLE_MODEL_COMPILE = (
    "whole-model torch.compile of {cls} cannot stream between its blocks with outputs equal to the same "
    "compilation run natively (the graph would break at every streamed block). Compile the repeated blocks "
    "instead, before or after enabling offload: {cls}.compile_repeated_blocks(fullgraph=True), or compile each "
    "streamed block (recipes: --compile regional)"
)


def refuse_whole_model_compile(model: nn.Module) -> None:
    """Raise when ``model`` is compiled whole (``torch.compile(model)``, ``model.compile()``). A compiled
    region that contains units without being one is not detected."""
    if type(model).__name__ == "OptimizedModule" or model.__dict__.get("_compiled_call_impl") is not None:
        cls = type(getattr(model, "_orig_mod", model)).__name__
        raise FlexTensorError(WHOLE_MODEL_COMPILE.format(cls=cls))


def refuse_if_inside_whole_model_compile(model: nn.Module) -> None:
    """Raise when ``torch.compile(wrapper)`` calls ``model`` (checked at each call of the model)."""
    from torch._dynamo import eval_frame

    if getattr(eval_frame, "_is_in_optimized_module", lambda: False)():
        raise FlexTensorError(WHOLE_MODEL_COMPILE.format(cls=type(model).__name__))


def compiled_with_cudagraphs(module: nn.Module) -> bool:
    """Best effort: whether ``module.compile(...)`` was called with a CUDA-graph mode."""
    fn = module.__dict__.get("_compiled_call_impl")
    if fn is None:
        return False
    try:
        ctx = inspect.getclosurevars(fn).nonlocals.get("self")
        backend = getattr(getattr(ctx, "callback", None), "_torchdynamo_orig_backend", None)
        for _ in range(4):
            config = getattr(backend, "config", None)
            if isinstance(config, dict) and config.get("triton.cudagraphs"):
                return True
            backend = getattr(backend, "_torchdynamo_orig_backend", None)
    except (TypeError, ValueError):
        return False
    return False


@torch.compiler.disable(recursive=False)
def _cross(crossing: Crossing | None, inner: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``inner(*args, **kwargs)`` with the crossing's work around it; the one place that does it.
    Hidden from dynamo itself; what ``inner`` runs is compiled as it would be natively."""
    if crossing is None:
        return inner(*args, **kwargs)
    crossing.enter(args, kwargs)
    try:
        output = inner(*args, **kwargs)
    except BaseException as exc:
        instead = crossing.fail(exc)
        if instead is not None and instead is not exc:
            raise instead from exc
        raise
    crossing.exit(output)
    return output


def _bordered_class(cls: type) -> type:
    """The subclass of ``cls`` (same name) whose calls go through the instance's `Crossing`."""
    if cls in _SUBCLASSES:
        return _SUBCLASSES[cls]
    base_call = cls.__call__

    @torch.compiler.disable(recursive=False)
    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _cross(self.__dict__.get(ATTRIBUTE), functools.partial(base_call, self), args, kwargs)

    def compile(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        if self.__dict__.get(ATTRIBUTE) is not None:
            raise FlexTensorError(WHOLE_MODEL_COMPILE.format(cls=type(self).__name__))
        cls.compile(self, *args, **kwargs)

    sub = type(cls.__name__, (cls,), {"__call__": __call__, "compile": compile, "__module__": cls.__module__})
    sub.__qualname__ = cls.__qualname__
    sub._flextensor_base = cls  # type: ignore[attr-defined]
    _SUBCLASSES[cls] = sub
    return sub


def _crossing_call(module: nn.Module, inner: Callable[..., Any]) -> Callable[..., Any]:
    """``inner`` (a unit's original or compiled call) through the unit's crossing, if it still has one
    (after removal a compiled wrapper may still hold this function)."""

    @torch.compiler.disable(recursive=False)
    def call(*args: Any, **kwargs: Any) -> Any:
        return _cross(module.__dict__.get(ATTRIBUTE), inner, args, kwargs)

    call._flextensor_inner = inner  # type: ignore[attr-defined]
    return call


class Boundaries:
    """The swapped classes and wrapped methods of one offloaded model, and their undoing."""

    def __init__(self) -> None:
        self._modules: list[tuple[nn.Module, type]] = []
        self._methods: list[tuple[nn.Module, str]] = []
        self._units: list[nn.Module] = []

    def border_unit(self, module: nn.Module, crossing: Crossing) -> None:
        """Route a unit's calls, eager or compiled, through ``crossing``; its class stays."""
        if compiled_with_cudagraphs(module):
            _refuse_cudagraphs({"mode": "reduce-overhead"}, module)
        original = types.MethodType(type(module)._call_impl, module)  # what native compile() compiles
        module.__dict__[ATTRIBUTE] = crossing
        module.__dict__["_call_impl"] = _crossing_call(module, original)
        compiled = module.__dict__.get("_compiled_call_impl")
        if compiled is not None:
            module.__dict__["_compiled_call_impl"] = _crossing_call(module, compiled)

        def compile(*args: Any, **kwargs: Any) -> None:
            _refuse_cudagraphs(kwargs, module)
            region = torch.compile(original, *args, **kwargs)
            module.__dict__["_compiled_call_impl"] = _crossing_call(module, region)
            if crossing.compiled is not None:
                crossing.compiled()

        module.__dict__["compile"] = compile
        self._units.append(module)

    def border(self, module: nn.Module, crossing: Crossing) -> None:
        """Route ``module``'s calls through ``crossing``."""
        if compiled_with_cudagraphs(module):
            _refuse_cudagraphs({"mode": "reduce-overhead"}, module)
        original = type(module)
        module.__class__ = _bordered_class(original)
        module.__dict__[ATTRIBUTE] = crossing
        self._modules.append((module, original))

    def wrap_entry(self, module: nn.Module, name: str, crossing: Crossing) -> None:
        """Route calls of ``module.<name>`` (e.g. a VAE's ``decode``) through ``crossing``."""
        method = getattr(module, name)

        @functools.wraps(method)
        @torch.compiler.disable(recursive=False)
        def entry(*args: Any, **kwargs: Any) -> Any:
            return _cross(crossing, method, args, kwargs)

        setattr(module, name, entry)
        self._methods.append((module, name))

    def wrap_edit(self, module: nn.Module, name: str, editing: Callable[[], Any]) -> None:
        """Run every call of ``module.<name>`` (``load_state_dict``, ``fuse_lora``) inside ``editing()``."""
        method = getattr(module, name)

        @functools.wraps(method)
        def edit(*args: Any, **kwargs: Any) -> Any:
            with editing():
                return method(*args, **kwargs)

        setattr(module, name, edit)
        self._methods.append((module, name))

    def remove(self) -> None:
        for module in self._units:
            module.__dict__.pop(ATTRIBUTE, None)
            module.__dict__.pop("_call_impl", None)
            module.__dict__.pop("compile", None)
            compiled = module.__dict__.get("_compiled_call_impl")
            if compiled is not None:  # compiled before or after: the region itself again
                module.__dict__["_compiled_call_impl"] = getattr(compiled, "_flextensor_inner", compiled)
        self._units = []
        for module, name in self._methods:
            if name in vars(module):
                delattr(module, name)
        for module, original in reversed(self._modules):
            module.__dict__.pop(ATTRIBUTE, None)
            module.__class__ = original
        self._methods, self._modules = [], []
