"""Families with a label rule on paper but no adapter yet: refused by name, saying why and what works.

``adapt`` falls through to these only after every aligning family has refused the model; the
text leads the error for the schemes that need an adapter (``NoAlign`` still takes the model).
"""

from __future__ import annotations

from torch import nn

__all__ = ["EFFICIENTFORMERV2_REFUSAL", "named_refusal"]

EFFICIENTFORMERV2_REFUSAL = (
    "timm EfficientFormerV2 (timm.models.efficientformer_v2) is not adapted: its Attention2d mixes heads before "
    "and after the softmax (talking heads: the rule would take the normalised |weights|), adds a depthwise-conv "
    "path on the values (v_local) to the attention's output, and in the last stages attends at half resolution "
    "(a strided conv before, a bilinear upsample after); Attention2dDownsample adds a strided conv to attention "
    "from a pooled query grid; each sum of two paths needs a rule combining their labels, and none of this has an "
    "adapter and a reference test yet; use the efficientformer (v1) family, or NoAlign() for these"
)


def named_refusal(model: nn.Module) -> str | None:
    """The refusal of a known but unadapted family (``None`` for any other model)."""
    module = type(model).__module__
    if module == "timm.models.efficientformer_v2":
        return EFFICIENTFORMERV2_REFUSAL
    return None
