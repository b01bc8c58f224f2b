"""The FLOPs of a fit, counted by torch's ``FlopCounterMode``: its formulas for the matrix products and convolutions
that run (2 FLOPs a multiply-add; elementwise work is not counted), and ours for the attention operators it has
none for (``ATTENTION_FORMULAS``), which it would count as nothing: on a CPU the scaled-dot-product attention of
every transformer layer and its backward, and on any device the fused transformer layer that a module in eval
mode runs without gradients (the frozen global model of FedBR, FedNTD and MOON)."""

from __future__ import annotations

from math import prod
from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_backward_flop_count, sdpa_flop_count

Shape = tuple[int, ...]


def _heads(shape: Shape) -> Shape:
    """(batch, heads, tokens, head dim) of an attention operand given as (..., tokens, head dim)."""
    *lead, tokens, dim = shape
    return (prod(lead[:-1]), lead[-1] if lead else 1, tokens, dim)


def attention_flops(query: Shape, key: Shape, value: Shape, *_: Any, out_shape: Any = None, **__: Any) -> int:
    """A scaled-dot-product attention's forward: the scores (q k^T) and their product with v, as torch counts
    its flash, efficient and cuDNN kernels."""
    return sdpa_flop_count(_heads(query), _heads(key), _heads(value))


def attention_backward_flops(
    grad_out: Shape, query: Shape, key: Shape, value: Shape, *_: Any, out_shape: Any = None, **__: Any
) -> int:
    """Its backward: the scores again, and the gradients of the scores, v, q and k, as torch counts its kernels'."""
    return sdpa_backward_flop_count(_heads(grad_out), _heads(query), _heads(key), _heads(value))


def _self_attention(batch: int, heads: int, queries: int, keys: int, dim: int) -> int:
    head = dim // heads
    return sdpa_flop_count((batch, heads, queries, head), (batch, heads, keys, head), (batch, heads, keys, head))


def encoder_layer_flops(
    src: Shape,
    embed_dim: int,
    num_heads: int,
    qkv_weight: Shape,
    qkv_bias: Shape,
    proj_weight: Shape,
    proj_bias: Shape,
    *rest: Any,
    out_shape: Any = None,
    **__: Any,
) -> int:
    """``nn.TransformerEncoderLayer``'s fused forward (its "fast path"): the q, k, v projections, the attention,
    the output projection and the two feed-forward layers (``rest[7]``, ``rest[9]``: their weights)."""
    *lead, tokens, _ = src
    batch = prod(lead)
    weights = (qkv_weight, proj_weight, rest[7], rest[9])
    return sum(2 * batch * tokens * w[0] * w[1] for w in weights) + _self_attention(
        batch, num_heads, tokens, tokens, embed_dim
    )


def multi_head_attention_flops(
    query: Shape,
    key: Shape,
    value: Shape,
    embed_dim: int,
    num_head: int,
    *_: Any,
    out_shape: Any = None,
    **__: Any,
) -> int:
    """``nn.MultiheadAttention``'s fused forward: the q, k, v projections, the attention, the output projection."""
    *lead, queries, _dim = query
    keys = key[-2]
    batch = prod(lead)
    projections = 2 * batch * embed_dim * embed_dim * (2 * queries + 2 * keys)
    return projections + _self_attention(batch, num_head, queries, keys, embed_dim)


def _ops(*names: str) -> list[Any]:
    """The aten operators of ``names`` that this torch has."""
    return [getattr(torch.ops.aten, name) for name in names if hasattr(torch.ops.aten, name)]


FORMULAS: list[tuple[list[Any], Callable[..., int]]] = [
    (
        _ops("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable"),
        attention_flops,
    ),
    (
        _ops(
            "_scaled_dot_product_flash_attention_for_cpu_backward",
            "_scaled_dot_product_fused_attention_overrideable_backward",
        ),
        attention_backward_flops,
    ),
    (_ops("_transformer_encoder_layer_fwd"), encoder_layer_flops),
    (_ops("_native_multi_head_attention"), multi_head_attention_flops),
]
# ours for what torch counts as nothing; a torch that counts an operator itself keeps its own formula
ATTENTION_FORMULAS = {op: formula for ops, formula in FORMULAS for op in ops if op not in flop_registry}


class _GlobalOnly:
    """Stands in for ``FlopCounterMode``'s module tracker: every count goes to the total ("Global") alone. The
    tracker's backward hooks on each module's inputs break a ``torch.func.grad`` taken inside a step (FedMix's
    input gradient: "A leaf node was passed to _will_engine_execute_node"), and the bench reads only the total."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _GlobalOnly:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class FitFlopCounter(FlopCounterMode):
    """``FlopCounterMode`` with ``ATTENTION_FORMULAS``, counting the total only (``get_total_flops``), with no
    module hooks."""

    def __init__(self) -> None:
        super().__init__(display=False, custom_mapping=ATTENTION_FORMULAS)
        self.mod_tracker = _GlobalOnly()  # type: ignore[assignment]
