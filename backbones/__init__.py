"""backbones: adapters that let timm models carry mixed labels along their tokens.

``adapt(model, scheme)`` wraps a timm model (parameters shared, never copied):
called on images it returns exactly what the model returns; called with a
``mixlabels.TokenLabelMap`` it returns a ``mixlabels.AlignedOutput`` with the
logits, the scheme's stop-gradient targets and ``.loss()``.

Example:
    >>> import timm, torch, mixlabels
    >>> from mixlabels import backbones
    >>> model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8,
    ...                           embed_dim=32, depth=2, num_heads=2, num_classes=10)
    >>> aligned = backbones.adapt(model, mixlabels.TLAlign())
    >>> images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    >>> mask = torch.zeros(4, 32, 32); mask[:, :, :16] = 1.0  # CutMix: left half from the sample itself
    >>> lm = mixlabels.TokenLabelMap.from_mask(mask, labels.flip(0), labels, num_classes=10)
    >>> out = aligned(lm.mix_pixels(images), lm)
    >>> out.loss().backward()
    >>> out.target.shape, aligned.model is model
    (torch.Size([4, 10]), True)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mixlabels.backbones._adapt import FAMILIES, SUPPORTED, Family, adapt
from mixlabels.backbones._any import AdaptedClassifier
from mixlabels.backbones._attention import ROUTES, attention_route, attention_with_labels
from mixlabels.backbones._common import compiled_label_convs
from mixlabels.backbones._count import TierCount, count_timm_names, count_torchvision_names
from mixlabels.backbones._matrix import SupportRow, support_markdown, support_matrix
from mixlabels.backbones._task import AlignedClassificationTask
from mixlabels.backbones._vit_reference import reference_forward

if TYPE_CHECKING:
    from mixlabels.backbones._common import AdaptedBase

# Every family's adapter class (``backbones.AdaptedViT``, ``backbones.AdaptedResNet``, ...) comes from the
# families' declarations, so that adding a family touches no list here.
_ADAPTERS = {f.build.__name__: f.build for f in FAMILIES if isinstance(f.build, type)}


def __getattr__(name: str) -> type[AdaptedBase]:
    if name in _ADAPTERS:
        return _ADAPTERS[name]
    raise AttributeError(f"module 'mixlabels.backbones' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_ADAPTERS])


__all__ = [
    "adapt",
    "AlignedClassificationTask",
    "SUPPORTED",
    "FAMILIES",
    "Family",
    "support_matrix",
    "support_markdown",
    "SupportRow",
    "AdaptedClassifier",
    "count_timm_names",
    "count_torchvision_names",
    "TierCount",
    "reference_forward",
    "attention_with_labels",
    "attention_route",
    "ROUTES",
    "compiled_label_convs",
]
