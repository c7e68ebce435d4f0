"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for adapters that walk a model's submodules themselves.

FSDP2 all-gathers a sharded module's parameters in a forward pre-hook, frees them in
a forward hook, and hooks the backward on the forward's inputs (reduce-scatter of the
gradients) and outputs (re-gathering the parameters). An adapter calls a block's norms,
``attn.qkv`` and convolutions directly, never the block, so those hooks would not run:
``through_hooks`` runs the adapter's work on one block as a forward method of that block
(``register_fsdp_forward_method``, FSDP2's own means), so the block is gathered, freed
and reduced as if its ``forward`` ran.

The order (docs/distributed.md): ``adapted = adapt(model, scheme)``; ``fully_shard`` each
of the adapter's ``fsdp_units()`` (a ViT's ``model.blocks``), then
``fully_shard(adapted)``, the root that gathers everything else. ``sharding_refusal``
names what else is refused and why.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

__all__ = ["is_sharded", "order", "sharding_refusal", "through_hooks"]

T = TypeVar("T")

_METHOD = "_mixlabels_aligned_forward"
"""The forward method ``through_hooks`` registers on a sharded module (an instance attribute)."""


def order(units: str | None) -> str:
    """The prescribed order, ``units`` naming the modules to shard below the root (``None``: none)."""
    blocks = f"fully_shard each of {units}; then " if units else ""
    return (
        f"adapted = adapt(model, scheme); {blocks}fully_shard(adapted), last, as the root; "
        "and call adapted(images, label_map) (docs/distributed.md)"
    )


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` (FSDP2 makes its class a subclass of ``FSDPModule``)."""
    return isinstance(module, FSDPModule)


def _run(module: nn.Module, fn: Callable[..., T], *tensors: Any) -> T:
    """The registered forward method: the adapter's work on ``module``'s submodules."""
    return fn(*tensors)


def through_hooks(module: nn.Module, fn: Callable[..., T], *tensors: Any) -> T:
    """``fn(*tensors)``, run as a forward of ``module`` when ``fully_shard`` sharded it.

    FSDP2 treats ``tensors`` as the forward's inputs (cast to the ``MixedPrecisionPolicy``'s
    ``param_dtype``; their gradients trigger the reduce-scatter) and ``fn``'s result as its
    output (its gradients re-gather the parameters in backward). Pass every other argument in
    ``fn``'s closure: FSDP casts and rebuilds what it sees (dataclasses too), and a label map
    refuses to be cast. ``fn`` must do all its reading of ``module``'s parameters (kernels for label
    rules included) before it returns: they are freed afterwards. Unsharded: ``fn(*tensors)``.
    """
    if not isinstance(module, FSDPModule):
        return fn(*tensors)
    method: Callable[..., T] = _hooked_method_eagerly(module)
    return method(fn, *tensors)


def _hooked_method(module: nn.Module) -> Callable[..., Any]:
    """``module``'s hooked forward method, registered on the first call."""
    method: Callable[..., Any] | None = module.__dict__.get(_METHOD)
    if method is None:
        object.__setattr__(module, _METHOD, types.MethodType(_run, module))  # not a submodule, not state
        register_fsdp_forward_method(module, _METHOD)  # replaces it by the hooked version
        method = module.__dict__[_METHOD]
    return method


# Run eagerly under torch.compile too (a graph break where FSDP2's own hooks, which dynamo runs eagerly, break the
# graph anyway): dynamo cannot trace ``register_fsdp_forward_method`` (an internal error on the first compiled step of
# a model sharded per block), and a compiled check of the method's presence would not be guarded (each step would
# register it again). So the check and the registration run outside the graph, the registration once.
_hooked_method_eagerly = cast(Callable[[nn.Module], Callable[..., Any]],
                              torch.compiler.disable(_hooked_method, recursive=True))  # type: ignore[no-untyped-call]


def _where(names: list[str]) -> str | None:
    """``model.blocks.0, model.blocks.1`` as ``adapted.model.blocks`` (``None`` for no names)."""
    parents = sorted({n.rpartition(".")[0] for n in names})
    return ", ".join(f"adapted.{p}" if p else "adapted" for p in parents) or None


def _first(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def sharding_refusal(adapter: nn.Module, fsdp_units: Callable[[], tuple[nn.Module, ...]], reference: bool) -> str | None:
    """Why ``adapter``'s aligned forward cannot run with the ``fully_shard`` calls made so far (``None``: it can).

    Allowed: nothing sharded; the adapter alone; the adapter and any of its ``fsdp_units()`` (the
    modules its walk enters by ``through_hooks``), on the fast path (not the ``reference`` path).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None  # fully_shard needs a process group
    named = dict(adapter.named_modules())
    sharded = [n for n, m in named.items() if n and isinstance(m, FSDPModule)]
    if not sharded and not isinstance(adapter, FSDPModule):
        return None
    units = fsdp_units()
    unit_ids = {id(u) for u in units}
    entered = _where([n for n, m in named.items() if id(m) in unit_ids])
    why = (
        f"{type(adapter).__name__}(images, label_map) calls the model's submodules itself, passing through FSDP2's "
        f"hooks only of the adapted module{f' and of each of {entered}' if entered else ''}; "
    )
    prescribed = order(entered)
    if not isinstance(adapter, FSDPModule):
        return (
            f"{why}fully_shard was applied to {_first(sharded)} but not to the adapted module, so nothing would gather "
            f"the parameters outside those modules (they would stay sharded DTensors). Shard in this order: {prescribed}"
        )
    stray = [n for n in sharded if id(named[n]) not in unit_ids]
    if stray:
        return (
            f"{why}fully_shard was applied to {_first(stray)}, whose hooks it never runs (their parameters would stay "
            f"sharded DTensors). Shard in this order: {prescribed}"
        )
    if reference and sharded:
        return (
            f"{why}but the dense reference path (reference=True) passes through the root's alone: with sharded "
            "blocks, use the fast path, or shard only the adapted module (fully_shard(adapted))"
        )
    return None
