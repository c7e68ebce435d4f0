"""How many ``timm.list_models()`` names ``adapt`` accepts, per scheme tier, from the registry.

Two ways, both from the families' own declarations:

- fast (default, builds nothing): a family accepts the names of the timm modules it
  declares (``Family.timm_modules``); ``None`` (the ``any`` family) is every name. An upper
  bound for the aligning families (a module may hold variants their refusal rejects).
- exact: every name is built on the ``meta`` device (no memory, no weights, no download)
  with its default configuration and shown to the families' ``refusal``; a name whose
  default build fails is counted as not accepted and listed. MixToken's tier is exact only:
  it needs the built model (an aligning family, or a ``patch_embed`` module).

Tiers: ``TLAlign`` (and TransMix/TokenLabeling where the family has a class token or
token logits) is the aligning families; ``NoAlign`` is every classifier; ``MixToken`` the
models whose patch embeddings ``adapt`` can reach.
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
    """Per aligning family, then the tiers ``TLAlign``, ``MixToken`` (exact only) and ``NoAlign``.

    Example:
        >>> counts = {c.tier: c.count for c in count_timm_names()}
        >>> counts["NoAlign"] == len(timm.list_models()) and counts["TLAlign"] < counts["NoAlign"]
        True
    """
    everything = sorted(timm.list_models())
    aligning = [f for f in FAMILIES if f.timm_modules is not None]
    if not exact:
        rows = [TierCount(f"TLAlign: {f.name}", tuple(_declared(f.timm_modules, everything)), False) for f in aligning]
        union = sorted({n for r in rows for n in r.names})
        return [*rows, TierCount("TLAlign", tuple(union), False), TierCount("NoAlign", tuple(everything), False)]
    per_family: dict[str, list[str]] = {f.name: [] for f in aligning}
    mixtoken: list[str] = []
    failed: list[str] = []
    for name in everything:
        model = _meta_build(name)
        if model is None:
            failed.append(name)
            continue
        family = next((f.name for f in aligning if f.refusal(model) is None), None)
        if family is not None:
            per_family[family].append(name)
        if family is not None or isinstance(getattr(model, "patch_embed", None), nn.Module):
            mixtoken.append(name)
    built = [n for n in everything if n not in set(failed)]
    rows = [TierCount(f"TLAlign: {f.name}", tuple(per_family[f.name]), True) for f in aligning]
    union = sorted({n for r in rows for n in r.names})
    return [
        *rows,
        TierCount("TLAlign", tuple(union), True),
        TierCount("MixToken", tuple(mixtoken), True, tuple(failed)),
        TierCount("NoAlign", tuple(built), True, tuple(failed)),
    ]
