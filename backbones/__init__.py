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

from mixlabels.backbones._adapt import FAMILIES, SUPPORTED, Family, adapt
from mixlabels.backbones._any import AdaptedClassifier
from mixlabels.backbones._attention import ROUTES, attention_route, attention_with_labels
from mixlabels.backbones._beit import AdaptedBeit
from mixlabels.backbones._cait import AdaptedCaiT
from mixlabels.backbones._convnext import AdaptedConvNeXt
from mixlabels.backbones._davit import AdaptedDaViT
from mixlabels.backbones._gcvit import AdaptedGCViT
from mixlabels.backbones._efficientnet import AdaptedEfficientNet
from mixlabels.backbones._count import TierCount, count_timm_names
from mixlabels.backbones._efficientvit_mit import AdaptedEfficientViTMIT
from mixlabels.backbones._efficientvit_msra import AdaptedEfficientViTMSRA
from mixlabels.backbones._levit import AdaptedLeViT
from mixlabels.backbones._hiera import AdaptedHiera
from mixlabels.backbones._focalnet import AdaptedFocalNet
from mixlabels.backbones._matrix import SupportRow, support_markdown, support_matrix
from mixlabels.backbones._eva import AdaptedEva
from mixlabels.backbones._maxxvit import AdaptedMaxxVit
from mixlabels.backbones._metaformer import AdaptedMetaFormer
from mixlabels.backbones._mixer import AdaptedMixer
from mixlabels.backbones._mvitv2 import AdaptedMViTv2
from mixlabels.backbones._nest import AdaptedNest
from mixlabels.backbones._pvt import AdaptedPVTv2
from mixlabels.backbones._relpos import AdaptedRelPosViT
from mixlabels.backbones._resmlp import AdaptedResMLP
from mixlabels.backbones._gmlp import AdaptedGMLP
from mixlabels.backbones._crossvit import AdaptedCrossViT
from mixlabels.backbones._tnt import AdaptedTNT
from mixlabels.backbones._efficientformer import AdaptedEfficientFormer
from mixlabels.backbones._volo import AdaptedVOLO
from mixlabels.backbones._fastvit import AdaptedFastViT
from mixlabels.backbones._mobilenetv3 import AdaptedMobileNetV3, AdaptedMobileNetV4
from mixlabels.backbones._regnet import AdaptedRegNet
from mixlabels.backbones._mobilevit import AdaptedByobNet
from mixlabels.backbones._efficientformer_v2 import AdaptedEfficientFormerV2
from mixlabels.backbones._resnet import AdaptedResNet
from mixlabels.backbones._swin import AdaptedSwin
from mixlabels.backbones._swinv2 import AdaptedSwinV2
from mixlabels.backbones._swinv2_cr import AdaptedSwinV2Cr
from mixlabels.backbones._twins import AdaptedTwins
from mixlabels.backbones._xcit import AdaptedXCiT
from mixlabels.backbones._task import AlignedClassificationTask
from mixlabels.backbones._vit import AdaptedViT
from mixlabels.backbones._vit_reference import reference_forward

__all__ = [
    "adapt",
    "AlignedClassificationTask",
    "SUPPORTED",
    "FAMILIES",
    "Family",
    "support_matrix",
    "support_markdown",
    "SupportRow",
    "AdaptedViT",
    "AdaptedSwin",
    "AdaptedSwinV2",
    "AdaptedSwinV2Cr",
    "AdaptedDaViT",
    "AdaptedGCViT",
    "AdaptedPVTv2",
    "AdaptedCaiT",
    "AdaptedMixer",
    "AdaptedConvNeXt",
    "AdaptedMetaFormer",
    "AdaptedRelPosViT",
    "AdaptedBeit",
    "AdaptedEva",
    "AdaptedMaxxVit",
    "AdaptedTwins",
    "AdaptedNest",
    "AdaptedFocalNet",
    "AdaptedXCiT",
    "AdaptedResNet",
    "AdaptedEfficientNet",
    "AdaptedMobileNetV3",
    "AdaptedMobileNetV4",
    "AdaptedEfficientFormer",
    "AdaptedVOLO",
    "AdaptedFastViT",
    "AdaptedRegNet",
    "AdaptedByobNet",
    "AdaptedEfficientFormerV2",
    "AdaptedClassifier",
    "AdaptedEfficientViTMIT",
    "AdaptedMViTv2",
    "AdaptedEfficientViTMSRA",
    "AdaptedHiera",
    "AdaptedResMLP",
    "AdaptedGMLP",
    "AdaptedCrossViT",
    "AdaptedTNT",
    "AdaptedLeViT",
    "count_timm_names",
    "TierCount",
    "reference_forward",
    "attention_with_labels",
    "attention_route",
    "ROUTES",
]
