"""A chunked feed-forward for Wan's transformer blocks: the user's change to the model, run natively and offloaded.

At 81 frames 832x480 a Wan2.2-A14B block's largest activations are in its feed-forward stage (norm3, the
5120 -> 13824 -> 5120 GELU MLP, the gated fp32 residual) over all 32 760 tokens at once. Every step of that stage is
row-wise, so `chunk_feed_forward` makes each ``WanTransformerBlock`` run it over ``chunks`` slices of the sequence,
each written into one output allocated up front: the stage's temporaries shrink about ``chunks``-fold.

It changes the model, not the offload, so that a native run and an offloaded run of the chunked model compute the
same thing: offloaded-with-chunks is bitwise equal to native-with-chunks (`tests/test_feed_forward.py`). It is not
bitwise equal to the unchunked model: a GEMM over fewer rows may use other kernels (cuBLAS picks its algorithm by
shape), so results may differ in the last bits. At ``chunks=1`` the forward is bitwise equal to diffusers' own.

The forward is written here from the block's submodules, and holds no reference it no longer needs (diffusers'
keeps the cross-attention output and the feed-forward's input alive to its end), so it lowers the block's peak at
``chunks=1`` already. Float sums and products are commutative and bf16 -> fp32 is exact, so the in-place forms
below give the bits of diffusers' expressions. Refused, model unchanged, with the fix named: a block class other
than diffusers' ``transformer_wan.WanTransformerBlock``, a diffusers whose ``WanTransformerBlock.forward`` is not
the one verified here (its source tokens are compared), a block whose ``forward`` something else replaced (a
diffusers hook), and a model that is offloaded now (its profiles measured the other forward: disable offload first).
Each chunked block names its count in ``VARIANT_ATTRIBUTE``, which the engine's profile fingerprint includes.

    import flextensor_diffusers as ft
    ft.chunk_feed_forward(pipe.transformer, chunks=4)  # and pipe.transformer_2
    ...
    ft.unchunk_feed_forward(pipe.transformer)          # diffusers' forward again
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import io
import numbers
import textwrap
import tokenize
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..engine import VARIANT_ATTRIBUTE, FlexTensorError, is_offloaded

#: The chunk count, on each chunked block.
CHUNKS_ATTRIBUTE = "_flextensor_ffn_chunks"
#: sha256 of the tokens of the ``WanTransformerBlock.forward`` verified bitwise against this forward (comments and
#: blank lines aside; the same digest on Python 3.11 to 3.13), and the diffusers release it was read from.
VERIFIED_FORWARDS = {"2a3065b96ebfb31e4da1b53bd925672c6180ad99e908a41989f6773b2f170a59": "0.42.1"}
_SKIPPED_TOKENS = (tokenize.COMMENT, tokenize.NL, tokenize.ENDMARKER)


class FeedForwardChunkingError(FlexTensorError, ValueError):
    """`chunk_feed_forward` cannot change this model without changing its math, or was asked for a bad count."""


def source_digest(function: Any) -> str:
    """sha256 of ``function``'s source tokens: comments, blank lines and trailing dedents left out, indentation kept
    as INDENT/DEDENT (the same on every Python the package supports)."""
    source = textwrap.dedent(inspect.getsource(function)) + "\n"
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in _SKIPPED_TOKENS]
    while tokens and tokens[-1].type in (tokenize.NEWLINE, tokenize.DEDENT):
        tokens.pop()
    words = (tokenize.tok_name[t.type] if t.type in (tokenize.INDENT, tokenize.DEDENT) else t.string for t in tokens)
    return hashlib.sha256("\x00".join(words).encode()).hexdigest()


@functools.cache
def verified_block() -> type[nn.Module]:
    """diffusers' ``WanTransformerBlock``, once its forward is found to be the verified one."""
    import diffusers
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    try:
        digest = source_digest(WanTransformerBlock.forward)
    except (OSError, TypeError, tokenize.TokenError) as exc:
        digest = f"unreadable ({exc})"
    if digest not in VERIFIED_FORWARDS:
        verified = ", ".join(sorted(set(VERIFIED_FORWARDS.values())))
        raise FeedForwardChunkingError(
            f"chunk_feed_forward: diffusers {diffusers.__version__}'s WanTransformerBlock.forward is not the one it "
            f"was verified against (diffusers {verified}), so it cannot promise the same math: install diffusers "
            f"{verified}, or leave the feed-forward unchunked"
        )
    return WanTransformerBlock


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks to change: ``model`` itself if it is one, else every module of a class it declares repeated
    (``_repeated_blocks``) or named like the known block; refused unless every one is the known class."""
    known = verified_block()
    names = {known.__name__, *(getattr(model, "_repeated_blocks", None) or ())}
    found = [(name, m) for name, m in model.named_modules() if type(m).__name__ in names]
    others = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for _, m in found if type(m) is not known})
    if others:
        raise FeedForwardChunkingError(
            f"chunk_feed_forward knows diffusers' {known.__module__}.{known.__qualname__} only; "
            f"{type(model).__name__} has {', '.join(others)}: leave its feed-forward unchunked"
        )
    if not found:
        raise FeedForwardChunkingError(
            f"{type(model).__name__} has no WanTransformerBlock: chunk_feed_forward applies to Wan transformers "
            "(pipe.transformer, pipe.transformer_2) or their blocks"
        )
    return found


def _check_free(model: nn.Module, blocks: list[tuple[str, nn.Module]], verb: str) -> None:
    if is_offloaded(model):
        raise FeedForwardChunkingError(
            f"{verb} {type(model).__name__} while it is offloaded would change the forward its plan measured: "
            "call it before enable_flextensor_offload / offload(), or disable offload first"
        )
    for name, block in blocks:
        forward = block.__dict__.get("forward")
        if forward is not None and getattr(forward, "__func__", None) is not chunked_forward:
            raise FeedForwardChunkingError(
                f"{type(model).__name__}.{name} has a forward of its own already (a diffusers hook?), which "
                f"{verb} would replace: remove it first, or chunk before adding it"
            )


def chunk_feed_forward(model: nn.Module, chunks: int) -> int:
    """Make each ``WanTransformerBlock`` of ``model`` (a Wan transformer, or one block) run its feed-forward stage
    over ``chunks`` slices of the sequence (see the module docstring); returns the number of blocks changed.

    Again with another count replaces it; `unchunk_feed_forward` restores diffusers' forward. Call it before
    offloading (refused while offloaded); a compiled block recompiles at its next call, and at each new count."""
    if isinstance(chunks, bool) or not isinstance(chunks, numbers.Integral) or chunks < 1:
        raise FeedForwardChunkingError(f"chunk_feed_forward: chunks={chunks!r}: pass a whole number >= 1")
    chunks = int(chunks)
    blocks = _blocks(model)
    _check_free(model, blocks, "chunk_feed_forward on")
    for _, block in blocks:
        block.__dict__[CHUNKS_ATTRIBUTE] = chunks
        block.__dict__[VARIANT_ATTRIBUTE] = f"feed-forward in {chunks} chunks"
        block.__dict__["forward"] = types.MethodType(chunked_forward, block)
    return len(blocks)


def unchunk_feed_forward(model: nn.Module) -> int:
    """Give each chunked block of ``model`` diffusers' forward again; returns the number of blocks restored."""
    blocks = [(n, b) for n, b in _blocks(model) if CHUNKS_ATTRIBUTE in b.__dict__]
    _check_free(model, blocks, "unchunk_feed_forward on")
    for _, block in blocks:
        for attribute in ("forward", CHUNKS_ATTRIBUTE, VARIANT_ATTRIBUTE):
            block.__dict__.pop(attribute, None)
    return len(blocks)


def feed_forward_chunks(model: nn.Module) -> int | None:
    """The chunk count of ``model``'s chunked blocks (None: none is chunked)."""
    counts = {m.__dict__[CHUNKS_ATTRIBUTE] for m in model.modules() if CHUNKS_ATTRIBUTE in m.__dict__}
    return max(counts) if counts else None


# ----------------------------------------------------------------------------------------------- the forward


def chunked_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """``WanTransformerBlock.forward`` with its feed-forward stage in ``self._flextensor_ffn_chunks`` slices."""
    shift, scale, gate, ff_shift, ff_scale, ff_gate = _modulation(self, temb)
    h = hidden_states
    update = self.attn1(_modulated(self.norm1, h, shift, scale), None, None, rotary_emb)
    h = _gated_residual(h, update, gate)
    del update
    h = h + self.attn2(self.norm2(h.float()).type_as(h), encoder_hidden_states, None, None)
    chunks = self.__dict__.get(CHUNKS_ATTRIBUTE, 1)
    if chunks == 1:
        return _feed_forward(self, h, ff_shift, ff_scale, ff_gate)
    out = torch.empty_like(h)
    for rows in _spans(h.shape[1], chunks):
        out[:, rows] = _feed_forward(self, h[:, rows], *(_rows(t, rows) for t in (ff_shift, ff_scale, ff_gate)))
    return out


def _modulation(block: nn.Module, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Shift, scale and gate of the attention and feed-forward stages, fp32: each (batch, 1, dim) from a
    (batch, 6, dim) ``temb`` (Wan2.1, Wan2.2 A14B), or per token, (batch, seq, dim), from a (batch, seq, 6, dim)
    one (Wan2.2 TI2V)."""
    if temb.ndim == 4:
        terms = (block.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
        return tuple(t.squeeze(2) for t in terms)
    return (block.scale_shift_table + temb.float()).chunk(6, dim=1)


def _modulated(norm: nn.Module, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(norm(x.float()) * (1 + scale) + shift).type_as(x)``, the shift added in place."""
    out = norm(x.float()) * (1 + scale)
    out += shift
    return out.type_as(x)


def _gated_residual(x: torch.Tensor, update: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``(x.float() + update.float() * gate).type_as(x)`` with one fp32 temporary in place of three (``gate`` is
    fp32, so the product is too; ``x`` is added to it in place)."""
    out = update * gate
    out += x
    return out.type_as(x)


def _feed_forward(
    block: nn.Module, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, gate: torch.Tensor
) -> torch.Tensor:
    """The feed-forward stage of the rows ``x``: norm3, modulation, the MLP, the gated fp32 residual."""
    update = block.ffn(_modulated(block.norm3, x, shift, scale))
    return _gated_residual(x, update, gate)


def _spans(length: int, chunks: int) -> Iterator[slice]:
    """``chunks`` slices of ``range(length)`` of ceil(length / chunks) rows, the last shorter (fewer if too short)."""
    step = max(1, -(-length // chunks))
    return (slice(start, min(start + step, length)) for start in range(0, length, step))


def _rows(term: torch.Tensor, rows: slice) -> torch.Tensor:
    """A modulation term for ``rows``: the same for every token (batch, 1, dim), or its rows (batch, seq, dim)."""
    return term if term.shape[1] == 1 else term[:, rows]
