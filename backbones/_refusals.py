"""Families with a label rule on paper but no adapter yet: refused by name, saying why and what works.

``adapt`` falls through to these only after every aligning family has refused the model; the
text leads the error for the schemes that need an adapter (``NoAlign`` still takes the model).
"""

from __future__ import annotations

from torch import nn

__all__ = ["MOBILEVIT_REFUSAL", "EFFICIENTFORMERV2_REFUSAL", "named_refusal"]

_USE_INSTEAD = (
    "use NoAlign() (any classifier), or an adapted family for TL-Align, TransMix or TokenLabeling "
    "(`python -m mixlabels.backbones.matrix` lists them)"
)

MOBILEVIT_REFUSAL = (
    "timm MobileViT v1/v2 (MobileVitBlock / MobileVitV2Block in timm's ByobNet) is not adapted: a block unfolds "
    "the map into patches, attends across patches between the pixels at one offset (v2: separable linear "
    "attention), folds back, and fuses that path with the block's input in one conv over both, with no residual "
    "around the block: two label states meet in one kernel (the rule would weigh each half's normalised |kernel|), "
    "and the tracker carries one; none of this has an adapter and a reference test yet; " + _USE_INSTEAD
)

EFFICIENTFORMERV2_REFUSAL = (
    "timm EfficientFormerV2 (timm.models.efficientformer_v2) is not adapted: its Attention2d mixes heads before "
    "and after the softmax (talking heads: the rule would take the normalised |weights|), adds a depthwise-conv "
    "path on the values (v_local) to the attention's output, and in the last stages attends at half resolution "
    "(a strided conv before, a bilinear upsample after); Attention2dDownsample adds a strided conv to attention "
    "from a pooled query grid; each sum of two paths needs a rule combining their labels, and none of this has an "
    "adapter and a reference test yet; use the efficientformer (v1) family, or NoAlign() for these"
)


def _has_mobilevit_block(model: nn.Module) -> bool:
    return any(type(mod).__module__ == "timm.models.mobilevit" for mod in model.modules())


def named_refusal(model: nn.Module) -> str | None:
    """The refusal of a known but unadapted family (``None`` for any other model)."""
    module = type(model).__module__
    if module == "timm.models.efficientformer_v2":
        return EFFICIENTFORMERV2_REFUSAL
    if module == "timm.models.byobnet" and _has_mobilevit_block(model):
        return MOBILEVIT_REFUSAL
    return None
