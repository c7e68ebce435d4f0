"""Families with a label rule on paper but no adapter yet: refused by name, saying why and what works.

``adapt`` falls through to these only after every aligning family has refused the model; the
text leads the error for the schemes that need an adapter (``NoAlign`` still takes the model).
"""

from __future__ import annotations

from torch import nn

__all__ = ["VOLO_REFUSAL", "named_refusal"]

VOLO_REFUSAL = (
    "timm VOLO (timm.models.volo) is not adapted: its outlook attention (per-position k*k x k*k weights from a "
    "linear layer, applied by unfold/fold with stride 2: the label rule would be the fold of the head-mean local "
    "attentions, renormalised over in-grid taps), its 3-conv stem, the Transformer and class-attention stages, "
    "and the token-labeling aux_head (whose max over tokens is added to the logits: a readout with no label "
    "rule written here; return_dense likewise) have no adapter and no reference test yet; use NoAlign() "
    "(any classifier), or an adapted family with a class token (vit, cait, xcit) for TL-Align, TransMix or "
    "TokenLabeling"
)


def named_refusal(model: nn.Module) -> str | None:
    """The refusal of a known but unadapted family (``None`` for any other model)."""
    module = type(model).__module__
    if module == "timm.models.volo":
        return VOLO_REFUSAL
    return None
