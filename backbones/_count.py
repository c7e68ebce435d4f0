"""How many ``timm.list_models()`` names (and torchvision classification builders) ``adapt`` accepts, per scheme
tier, from the registry.

Two ways, both from the families' own declarations:

- fast (default, builds nothing): a family accepts the names of the timm modules it
  declares (``Family.timm_modules``); ``None`` (the ``any`` family) is every name. An upper
  bound for the aligning families (a module may hold variants their refusal rejects).
- exact: every name of those modules is built on the ``meta`` device (no memory, no
  weights, no download) with its default configuration and shown to the family's
  ``refusal``; a name whose default build fails is not counted and is listed.

Tiers: ``TLAlign`` (and TokenLabeling; TransMix where the model has a class token) is the
aligning families; ``NoAlign`` is every classifier: ``adapt`` takes any ``nn.Module`` for it
(MixToken too where the model has timm's ``patch_embed``), so every name counts, built or not.

torchvision's classification builders (``torchvision.models.list_models(module=torchvision.models)``)
are counted the same way from ``Family.torchvision_builders`` (``count_torchvision_names``); exact
builds call ``torchvision.models.get_model(name, weights=None)`` on the ``meta`` device
(``meta_torchvision_model``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import timm
import torch
import torchvision
from torch import nn

from mixlabels.backbones._adapt import FAMILIES

__all__ = ["TierCount", "count_timm_names", "count_torchvision_names", "meta_torchvision_model"]


@dataclass(frozen=True)
class TierCount:
    """The timm names ``adapt`` accepts for one tier (or one family of it)."""

    tier: str
    names: tuple[str, ...]
    exact: bool
    failed: tuple[str, ...] = field(default=())  # exact only: names whose default build failed

    @property
    def count(self) -> int:
        return len(self.names)


def _declared(modules: tuple[str, ...] | None, everything: list[str]) -> list[str]:
    if modules is None:
        return everything
    found = {name for module in modules for name in timm.list_models(module=module)}
    return sorted(found)


def _meta_build(name: str) -> nn.Module | None:
    try:
        with torch.device("meta"):
            model: nn.Module = timm.create_model(name, pretrained=False)
    except Exception:  # noqa: BLE001 - a default build that fails is reported, not fatal
        return None
    return model


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter and buffer moved to the ``meta`` device as its module registers it; the builder's other
    tensors (arithmetic on sizes) stay on the CPU."""
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register_parameter(module, name, param)

    def buffer(module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        register_buffer(module, name, None if tensor is None else tensor.to("meta"), persistent)

    patched: Any = nn.Module
    patched.register_parameter, patched.register_buffer = parameter, buffer
    try:
        yield
    finally:
        patched.register_parameter, patched.register_buffer = register_parameter, register_buffer


def meta_torchvision_model(name: str) -> nn.Module:
    """``torchvision.models.get_model(name, weights=None)`` (never downloads weights) on the ``meta`` device; a
    builder that computes its widths with tensors (RegNet's ``BlockParams``), which ``meta`` cannot read back, is
    built with only its parameters and buffers there."""
    model: nn.Module
    try:
        with torch.device("meta"):
            model = torchvision.models.get_model(name, weights=None)
    except NotImplementedError:  # "Cannot copy out of meta tensor"
        with _parameters_on_meta():
            model = torchvision.models.get_model(name, weights=None)
    return model


def _meta_build_torchvision(name: str) -> nn.Module | None:
    try:
        model = meta_torchvision_model(name)
    except Exception:  # noqa: BLE001 - a default build that fails is reported, not fatal
        return None
    return model


def _tiers(
    declared: list[tuple[str, list[str]]], everything: list[str], exact: bool, build: Callable[[str], nn.Module | None]
) -> list[TierCount]:
    """Per aligning family (its declared names; exact: those its refusal accepts, built by ``build``), then the
    tiers ``TLAlign`` (their union) and ``NoAlign`` (``everything``)."""
    refusal = {f.name: f.refusal for f in FAMILIES}
    rows = []
    for family, names in declared:
        if not exact:
            rows.append(TierCount(f"TLAlign: {family}", tuple(names), False))
            continue
        accepted, failed = [], []
        for name in names:
            model = build(name)
            if model is None:
                failed.append(name)
            elif refusal[family](model) is None:
                accepted.append(name)
        rows.append(TierCount(f"TLAlign: {family}", tuple(accepted), True, tuple(failed)))
    union = sorted({n for r in rows for n in r.names})
    # NoAlign takes every nn.Module: no build needed to know that adapt accepts the name.
    return [*rows, TierCount("TLAlign", tuple(union), exact), TierCount("NoAlign", tuple(everything), True)]


def count_timm_names(exact: bool = False) -> list[TierCount]:
    """Per aligning family, then the tiers ``TLAlign`` (any aligning family) and ``NoAlign`` (every name).

    Example:
        >>> counts = {c.tier: c.count for c in count_timm_names()}
        >>> counts["NoAlign"] == len(timm.list_models()) and counts["TLAlign"] < counts["NoAlign"]
        True
    """
    everything = sorted(timm.list_models())
    declared = [(f.name, _declared(f.timm_modules, everything)) for f in FAMILIES if f.timm_modules]
    return _tiers(declared, everything, exact, _meta_build)


def count_torchvision_names(exact: bool = False) -> list[TierCount]:
    """``count_timm_names`` for torchvision's classification builders (``Family.torchvision_builders``).

    Example:
        >>> counts = {c.tier: c.count for c in count_torchvision_names()}
        >>> counts["NoAlign"] == len(torchvision.models.list_models(module=torchvision.models))
        True
    """
    everything = sorted(torchvision.models.list_models(module=torchvision.models))
    declared = [(f.name, sorted(f.torchvision_builders)) for f in FAMILIES if f.torchvision_builders]
    return _tiers(declared, everything, exact, _meta_build_torchvision)
