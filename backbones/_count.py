"""How many ``timm.list_models()`` names ``adapt`` accepts, per scheme tier, from the registry.

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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import timm
import torch
from torch import nn

from mixlabels.backbones._adapt import FAMILIES

__all__ = ["TierCount", "count_timm_names"]


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


def count_timm_names(exact: bool = False) -> list[TierCount]:
    """Per aligning family, then the tiers ``TLAlign`` (any aligning family) and ``NoAlign`` (every name).

    Example:
        >>> counts = {c.tier: c.count for c in count_timm_names()}
        >>> counts["NoAlign"] == len(timm.list_models()) and counts["TLAlign"] < counts["NoAlign"]
        True
    """
    everything = sorted(timm.list_models())
    aligning = [f for f in FAMILIES if f.timm_modules is not None]
    rows = []
    for family in aligning:
        names = _declared(family.timm_modules, everything)
        if not exact:
            rows.append(TierCount(f"TLAlign: {family.name}", tuple(names), False))
            continue
        accepted, failed = [], []
        for name in names:
            model = _meta_build(name)
            if model is None:
                failed.append(name)
            elif family.refusal(model) is None:
                accepted.append(name)
        rows.append(TierCount(f"TLAlign: {family.name}", tuple(accepted), True, tuple(failed)))
    union = sorted({n for r in rows for n in r.names})
    # NoAlign takes every nn.Module: no build needed to know that adapt accepts the name.
    return [*rows, TierCount("TLAlign", tuple(union), exact), TierCount("NoAlign", tuple(everything), True)]
