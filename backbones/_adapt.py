"""``adapt``: pick the adapter of a timm model's family, or say which families exist.

The registry is the single source of truth for what is supported: ``adapt`` walks it,
the tests build every family's ``example`` from it, and ``support_matrix`` (the
README's table) runs every scheme on those same examples.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import timm
from timm.models.regnet import RegNet, RegNetCfg
import torch
from timm.layers.mlp import GatedMlp
from timm.layers.norm import GroupNorm1
from timm.models.metaformer import Attention as MetaAttention
from timm.models.focalnet import FocalNet
from timm.models.maxxvit import MaxxVit, MaxxVitCfg, MaxxVitTransformerCfg
from timm.models.metaformer import LayerNorm2dNoBias, LayerNormNoBias, MetaFormer, Pooling, SepConv
from timm.models.gcvit import GlobalContextVit
from timm.models.mlp_mixer import MlpMixer
from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg
from timm.models.crossvit import CrossVit
from timm.models.tnt import TNT
from timm.models.mlp_mixer import Affine, MlpMixer, ResBlock, SpatialGatingBlock
from timm.models.nest import Nest
from timm.models.volo import VOLO
from torch import nn

from mixlabels.backbones._any import ANY_FAMILY, AdaptedClassifier, accepts_any_model, any_refusal
from mixlabels.backbones._beit import BEIT_FAMILY, AdaptedBeit
from mixlabels.backbones._cait import CAIT_FAMILY, AdaptedCaiT
from mixlabels.backbones._davit import DAVIT_FAMILY, AdaptedDaViT
from mixlabels.backbones._gcvit import GCVIT_FAMILY, AdaptedGCViT
from mixlabels.backbones._gmlp import GMLP_FAMILY, AdaptedGMLP
from mixlabels.backbones._crossvit import CROSSVIT_FAMILY, AdaptedCrossViT
from mixlabels.backbones._volo import VOLO_FAMILY, AdaptedVOLO
from mixlabels.backbones._fastvit import FASTVIT_FAMILY, AdaptedFastViT, tiny_fastvit
from mixlabels.backbones._efficientformer import EFFICIENTFORMER_FAMILY, AdaptedEfficientFormer, tiny_efficientformer
from mixlabels.backbones._efficientformer_v2 import (
    EFFICIENTFORMERV2_FAMILY,
    AdaptedEfficientFormerV2,
    tiny_efficientformer_v2,
)
from mixlabels.backbones._efficientnet import EFFICIENTNET_FAMILY, AdaptedEfficientNet
from mixlabels.backbones._convnext import CONVNEXT_FAMILY, AdaptedConvNeXt
from mixlabels.backbones._eva import EVA_FAMILY, AdaptedEva
from mixlabels.backbones._fsdp import is_sharded, order
from mixlabels.backbones._efficientvit_mit import EFFICIENTVIT_MIT_FAMILY, AdaptedEfficientViTMIT
from mixlabels.backbones._efficientvit_msra import EFFICIENTVIT_MSRA_FAMILY, AdaptedEfficientViTMSRA
from mixlabels.backbones._levit import LEVIT_FAMILY, AdaptedLeViT
from mixlabels.backbones._focalnet import FOCALNET_FAMILY, AdaptedFocalNet
from mixlabels.backbones._maxxvit import MAXXVIT_FAMILY, AdaptedMaxxVit
from mixlabels.backbones._metaformer import METAFORMER_FAMILY, AdaptedMetaFormer
from mixlabels.backbones._hiera import HIERA_FAMILY, AdaptedHiera
from mixlabels.backbones._mixer import MIXER_FAMILY, AdaptedMixer
from mixlabels.backbones._mvitv2 import MVITV2_FAMILY, AdaptedMViTv2
from mixlabels.backbones._nest import NEST_FAMILY, AdaptedNest
from mixlabels.backbones._pvt import PVT_FAMILY, AdaptedPVTv2
from mixlabels.backbones._relpos import RELPOS_FAMILY, AdaptedRelPosViT
from mixlabels.backbones._resmlp import RESMLP_FAMILY, AdaptedResMLP
from mixlabels.backbones._pvt import PVT_FAMILY, AdaptedPVTv2
from mixlabels.backbones._tnt import TNT_FAMILY, AdaptedTNT
from mixlabels.backbones._mobilenetv3 import (
    MOBILENETV3_FAMILY,
    MOBILENETV4_FAMILY,
    AdaptedMobileNetV3,
    AdaptedMobileNetV4,
    tiny_mobilenetv3,
    tiny_mobilenetv4,
)
from mixlabels.backbones._regnet import REGNET_FAMILY, AdaptedRegNet
from mixlabels.backbones._mobilevit import BYOBNET_FAMILY, AdaptedByobNet, tiny_mobilevit
from mixlabels.backbones._resnet import RESNET_FAMILY, AdaptedResNet
from mixlabels.backbones._swin import SWIN_FAMILY, AdaptedSwin
from mixlabels.backbones._swinv2 import SWINV2_FAMILY, AdaptedSwinV2
from mixlabels.backbones._swinv2_cr import SWINV2_CR_FAMILY, AdaptedSwinV2Cr
from mixlabels.backbones._twins import TWINS_FAMILY, AdaptedTwins
from mixlabels.backbones._xcit import XCIT_FAMILY, AdaptedXCiT
from mixlabels.backbones._vit import VIT_FAMILY, AdaptedViT, vit_refusal
from mixlabels import Scheme

__all__ = ["adapt", "SUPPORTED", "Family", "FAMILIES"]


@dataclass(frozen=True)
class Family:
    """One supported model family.

    Args:
        name: short key (``"vit"``, ``"swin"``, ...).
        description: what is supported, shown in errors and the support matrix.
        refusal: why a model is not of this family (``None`` when it is).
        build: ``build(model, scheme, reference)`` the adapter.
        example: a tiny randomly initialised timm model of the family (32x32 images, 10 classes):
            what the tests and the support matrix run.
        timm_modules: the timm modules (``timm.list_models(module=...)``) holding the names this
            family may accept; ``None``: every timm name (``backbones.count_timm_names`` counts them).
    """

    name: str
    description: str
    refusal: Callable[[nn.Module], str | None]
    build: Callable[[nn.Module, Scheme, bool], nn.Module]
    example: Callable[[], nn.Module]
    timm_modules: tuple[str, ...] | None = ()


def _tiny(name: str | type[nn.Module], **kwargs: Any) -> Callable[[], nn.Module]:
    """A seeded tiny model: ``timm.create_model(name, ...)``, or the class itself where timm's
    registered variants pin an argument (``mixer_*`` fixes ``patch_size``, ``gcvit_*`` ``depths``)."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        if isinstance(name, str):
            model: nn.Module = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
        else:
            model = name(num_classes=10, **kwargs)
        return model

    return make


_REGISTRY: list[Family] = [
    Family("vit", VIT_FAMILY, vit_refusal, AdaptedViT,
           _tiny("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2),
           ("vision_transformer", "deit")),
    Family("swin", SWIN_FAMILY, AdaptedSwin.refusal, AdaptedSwin,
           _tiny("swin_tiny_patch4_window7_224", img_size=32, patch_size=4, window_size=4, embed_dim=16,
                 depths=(2, 2), num_heads=(2, 2)), ("swin_transformer",)),
    Family("pvt_v2", PVT_FAMILY, AdaptedPVTv2.refusal, AdaptedPVTv2,
           _tiny("pvt_v2_b0", depths=(1, 1), embed_dims=(16, 32), num_heads=(1, 2), sr_ratios=(2, 1), mlp_ratios=(2, 2)), ("pvt_v2",)),
    Family("cait", CAIT_FAMILY, AdaptedCaiT.refusal, AdaptedCaiT,
           _tiny("cait_xxs24_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, depth_token_only=1), ("cait",)),
    Family("mlp_mixer", MIXER_FAMILY, AdaptedMixer.refusal, AdaptedMixer,
           _tiny(MlpMixer, img_size=32, patch_size=8, embed_dim=32, num_blocks=2), ("mlp_mixer",)),
    Family("convnext", CONVNEXT_FAMILY, AdaptedConvNeXt.refusal, AdaptedConvNeXt,
           _tiny("convnext_atto", depths=(1, 1, 1, 1), dims=(8, 16, 24, 32)), ("convnext",)),
    Family("metaformer", METAFORMER_FAMILY, AdaptedMetaFormer.refusal, AdaptedMetaFormer,
           _tiny(MetaFormer, depths=(1, 1, 1), dims=(8, 16, 32), token_mixers=(Pooling, SepConv, MetaAttention),
                 norm_layers=(GroupNorm1, LayerNorm2dNoBias, LayerNormNoBias), head_dim=16), ("metaformer",)),
    Family("vit_relpos", RELPOS_FAMILY, AdaptedRelPosViT.refusal, AdaptedRelPosViT,
           _tiny("vit_relpos_medium_patch16_cls_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                 rel_pos_dim=16), ("vision_transformer_relpos",)),
    Family("beit", BEIT_FAMILY, AdaptedBeit.refusal, AdaptedBeit,
           _tiny("beit_base_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2),
           ("beit",)),
    Family("eva", EVA_FAMILY, AdaptedEva.refusal, AdaptedEva,
           _tiny("vit_small_patch16_rope_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2),
           ("eva",)),
    Family("swinv2", SWINV2_FAMILY, AdaptedSwinV2.refusal, AdaptedSwinV2,
           _tiny("swinv2_tiny_window8_256", img_size=32, patch_size=4, window_size=4, embed_dim=16,
                 depths=(2, 2), num_heads=(2, 2)), ("swin_transformer_v2",)),
    Family("swinv2_cr", SWINV2_CR_FAMILY, AdaptedSwinV2Cr.refusal, AdaptedSwinV2Cr,
           _tiny("swinv2_cr_tiny_224", img_size=32, patch_size=4, window_size=4, embed_dim=16,
                 depths=(2, 2), num_heads=(2, 2), init_values=1.0), ("swin_transformer_v2_cr",)),
    Family("davit", DAVIT_FAMILY, AdaptedDaViT.refusal, AdaptedDaViT,
           _tiny("davit_tiny", depths=(1, 1), embed_dims=(16, 32), num_heads=(2, 2), window_size=4), ("davit",)),
    Family("gcvit", GCVIT_FAMILY, AdaptedGCViT.refusal, AdaptedGCViT,
           _tiny(GlobalContextVit, img_size=32, window_size=4, embed_dim=16, depths=(1, 2), num_heads=(2, 2)), ("gcvit",)),
    Family("efficientvit_mit", EFFICIENTVIT_MIT_FAMILY, AdaptedEfficientViTMIT.refusal, AdaptedEfficientViTMIT,
           _tiny("efficientvit_b0", widths=(8, 16, 16, 32), depths=(1, 1, 1, 1), head_dim=8, head_widths=(32, 32)),
           ("efficientvit_mit",)),
    Family("mvitv2", MVITV2_FAMILY, AdaptedMViTv2.refusal, AdaptedMViTv2,
           _tiny(MultiScaleVit, img_size=32, cfg=MultiScaleVitCfg(depths=(1, 1), embed_dim=16, num_heads=1, stride_kv_adaptive=(2, 2))),
           ("mvitv2",)),
    Family("efficientvit_msra", EFFICIENTVIT_MSRA_FAMILY, AdaptedEfficientViTMSRA.refusal, AdaptedEfficientViTMSRA,
           _tiny("efficientvit_m0", img_size=32, embed_dim=(16, 32), key_dim=(4, 4), depth=(1, 1), num_heads=(2, 2),
                 down_ops=(("", 1), ("subsample", 2))), ("efficientvit_msra",)),
    Family("hiera", HIERA_FAMILY, AdaptedHiera.refusal, AdaptedHiera,
           _tiny("hiera_tiny_224", img_size=32, embed_dim=16, num_heads=1, stages=(1, 1, 1), q_pool=2, mask_unit_size=(4, 4),
                 mask_unit_attn=(True, True, False)), ("hiera",)),
    Family("resmlp", RESMLP_FAMILY, AdaptedResMLP.refusal, AdaptedResMLP,
           _tiny(MlpMixer, img_size=32, patch_size=8, embed_dim=32, num_blocks=2, mlp_ratio=2, block_layer=ResBlock,
                 norm_layer=Affine), ("mlp_mixer",)),
    Family("gmlp", GMLP_FAMILY, AdaptedGMLP.refusal, AdaptedGMLP,
           _tiny(MlpMixer, img_size=32, patch_size=8, embed_dim=32, num_blocks=2, mlp_ratio=2,
                 block_layer=SpatialGatingBlock, mlp_layer=GatedMlp), ("mlp_mixer",)),
    Family("crossvit", CROSSVIT_FAMILY, AdaptedCrossViT.refusal, AdaptedCrossViT,
           _tiny(CrossVit, img_size=32, img_scale=(1.0, 0.75), patch_size=(4, 8), embed_dim=(16, 32),
                 depth=((1, 1, 0),), num_heads=(2, 2), mlp_ratio=(2, 2, 1)), ("crossvit",)),
    Family("tnt", TNT_FAMILY, AdaptedTNT.refusal, AdaptedTNT,
           _tiny(TNT, img_size=32, patch_size=8, embed_dim=32, inner_dim=8, depth=2, num_heads_inner=2,
                 num_heads_outer=2), ("tnt",)),
    Family("maxxvit", MAXXVIT_FAMILY, AdaptedMaxxVit.refusal, AdaptedMaxxVit,
           _tiny(MaxxVit, img_size=32, cfg=MaxxVitCfg(embed_dim=(8, 16, 32), depths=(1, 1, 1), block_type=("C", "M", "T"),
                 stem_width=8, transformer_cfg=MaxxVitTransformerCfg(dim_head=8, window_size=(2, 2)))), ("maxxvit",)),
    Family("twins", TWINS_FAMILY, AdaptedTwins.refusal, AdaptedTwins,
           _tiny("twins_svt_small", depths=(2, 1), embed_dims=(16, 32), num_heads=(1, 2), mlp_ratios=(2, 2),
                 wss=(4, 4), sr_ratios=(2, 1)), ("twins",)),
    Family("nest", NEST_FAMILY, AdaptedNest.refusal, AdaptedNest,
           _tiny(Nest, img_size=32, patch_size=4, num_levels=3, embed_dims=(8, 16, 32), num_heads=(1, 2, 2), depths=(1, 1, 1),
                 drop_path_rate=0.1), ("nest",)),
    Family("focalnet", FOCALNET_FAMILY, AdaptedFocalNet.refusal, AdaptedFocalNet,
           _tiny(FocalNet, embed_dim=8, depths=(1, 1, 1)), ("focalnet",)),
    Family("xcit", XCIT_FAMILY, AdaptedXCiT.refusal, AdaptedXCiT,
           _tiny("xcit_nano_12_p8_224", img_size=32, embed_dim=32, depth=2, num_heads=2, cls_attn_layers=1), ("xcit",)),
    Family("resnet", RESNET_FAMILY, AdaptedResNet.refusal, AdaptedResNet,
           _tiny("resnet18d", layers=(1, 1, 1, 1), channels=(8, 16, 24, 32), stem_width=8), ("resnet",)),
    Family("efficientnet", EFFICIENTNET_FAMILY, AdaptedEfficientNet.refusal, AdaptedEfficientNet,
           _tiny("test_efficientnet"), ("efficientnet",)),
    Family("levit", LEVIT_FAMILY, AdaptedLeViT.refusal, AdaptedLeViT,
           _tiny("levit_128s", img_size=32, embed_dim=(16, 32), key_dim=4, num_heads=(2, 2), depth=(1, 1), stem_type="s8"),
           ("levit",)),
    Family("mobilenetv3", MOBILENETV3_FAMILY, AdaptedMobileNetV3.refusal, AdaptedMobileNetV3, tiny_mobilenetv3,
           ("mobilenetv3", "hardcorenas")),
    Family("volo", VOLO_FAMILY, AdaptedVOLO.refusal, AdaptedVOLO,
           _tiny(VOLO, img_size=32, patch_size=4, stem_hidden_dim=16, layers=(1, 1), embed_dims=(16, 32), num_heads=(1, 2),
                 downsamples=(True, False), outlook_attention=(True, False), mlp_ratio=(2.0, 2.0), post_layers=("ca",)),
           ("volo",)),
    Family("fastvit", FASTVIT_FAMILY, AdaptedFastViT.refusal, AdaptedFastViT, tiny_fastvit, ("fastvit",)),
    Family("efficientformer", EFFICIENTFORMER_FAMILY, AdaptedEfficientFormer.refusal, AdaptedEfficientFormer,
           tiny_efficientformer, ("efficientformer",)),
    Family("mobilenetv4", MOBILENETV4_FAMILY, AdaptedMobileNetV4.refusal, AdaptedMobileNetV4, tiny_mobilenetv4,
           ("mobilenetv3",)),
    Family("regnet", REGNET_FAMILY, AdaptedRegNet.refusal, AdaptedRegNet,
           _tiny(RegNet, cfg=RegNetCfg(depth=5, w0=8, wa=8.0, wm=1.5, group_size=4, stem_width=8)), ("regnet",)),
    Family("byobnet", BYOBNET_FAMILY, AdaptedByobNet.refusal, AdaptedByobNet, tiny_mobilevit, ("byobnet", "mobilevit")),
    Family("efficientformer_v2", EFFICIENTFORMERV2_FAMILY, AdaptedEfficientFormerV2.refusal, AdaptedEfficientFormerV2,
           tiny_efficientformer_v2, ("efficientformer_v2",)),
    # Last: the fallback for NoAlign, taken only when no aligning family above accepts the model.
    Family("any", ANY_FAMILY, any_refusal, AdaptedClassifier, _tiny("test_nfnet"), None),
]  # fmt: skip
FAMILIES: tuple[Family, ...] = tuple(_REGISTRY)
SUPPORTED: tuple[str, ...] = tuple(f.description for f in _REGISTRY)


def _check_model(model: object) -> None:
    """Clear errors for what is not a bare timm model: wrappers say which attribute holds it."""
    from mixlabels.backbones._common import AdaptedBase  # the adapters' base (no import cycle at call time)

    if isinstance(model, AdaptedBase):
        raise TypeError(
            f"this model is already adapted ({type(model).__name__} with {type(model.scheme).__name__}): "
            "pass the timm model (adapted.model) to adapt it again with another scheme"
        )
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise TypeError(
            "adapt cannot adapt a torch.compile'd model (OptimizedModule): adapt the timm model first and compile "
            "the adapted module (torch.compile(adapt(model, scheme))), or pass the original, model._orig_mod"
        )
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        wrapper = "ddp" if isinstance(model, nn.parallel.DistributedDataParallel) else "dp"
        raise TypeError(
            f"adapt cannot adapt a {type(model).__name__} wrapper: adapt the timm model inside it "
            f"(adapt({wrapper}.module, scheme)), "
            f"or better adapt first and wrap the adapted module ({type(model).__name__}(adapt(model, scheme)))"
        )
    sharded = [name or "the model" for name, m in model.named_modules() if is_sharded(m)] if isinstance(model, nn.Module) else []
    if sharded:
        raise TypeError(
            f"adapt cannot adapt a model already sharded by FSDP2's fully_shard ({', '.join(sharded[:4])}"
            f"{' ...' if len(sharded) > 4 else ''}): adapt first, then shard: "
            + order("the adapter's blocks (adapted.fsdp_units())")
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"adapt takes a torch.nn.Module (a timm model, a torchvision model, your own classifier), got {type(model).__name__}")


def check_scheme(scheme: object) -> None:
    """Raise a clear error unless ``scheme`` is a scheme instance (``NoAlign()``, ``TLAlign(...)``, ...)."""
    if inspect.isclass(scheme):
        raise TypeError(f"scheme must be an instance, got the class {scheme.__name__}: pass {scheme.__name__}()")
    build = getattr(scheme, "build", None)
    if callable(build) and not hasattr(scheme, "start"):
        raise TypeError(f"scheme must be a scheme, got the config {type(scheme).__name__}: pass config.build()")
    if not (callable(getattr(scheme, "start", None)) and callable(getattr(scheme, "rules", None))
            and hasattr(scheme, "needs_token_logits")):
        raise TypeError(
            f"scheme must be a mixlabels scheme (NoAlign(), TransMix(), TLAlign(...), TokenLabeling(...)), "
            f"got {type(scheme).__name__}"
        )


def adapt(model: nn.Module, scheme: Scheme, reference: bool = False) -> nn.Module:
    """Wrap a timm model so that it also returns the scheme's aligned targets.

    Args:
        model: a timm model of a supported family (``SUPPORTED``), or any classifier for
            ``NoAlign``; shared, not copied.
        scheme: ``mixlabels.NoAlign()``, ``TransMix()``, ``TLAlign(...)``, ``TokenLabeling(...)``.
        reference: use the explicit, dense reference path (tests, speed baselines).

    Returns:
        A module: ``adapted(images)`` equals ``model(images)``; ``adapted(images, label_map)``
        is a ``mixlabels.AlignedOutput``. ``adapted.model is model``.

    Any classifier (a timm model of any family, a torchvision model, your own ``nn.Module``
    mapping images to logits) adapts with ``NoAlign()``; the other schemes need one of the
    aligning families.

    Raises:
        TypeError: the scheme needs a family this model is not of (the message lists those that
            exist), the model is already adapted, compiled, wrapped (DDP, DataParallel) or sharded
            (``fully_shard``: adapt first, docs/distributed.md), or the scheme is not a scheme instance.
    """
    _check_model(model)
    check_scheme(scheme)
    reasons = []
    for family in _REGISTRY[:-1]:
        why = family.refusal(model)
        if why is None:
            return family.build(model, scheme, reference)
        reasons.append(why)
    return _any_classifier(model, scheme, reference, reasons)


def _any_classifier(model: nn.Module, scheme: Scheme, reference: bool, reasons: list[str]) -> nn.Module:
    """The last family: ``NoAlign`` for any classifier; every other scheme refused, saying why and what works."""
    fallback = _REGISTRY[-1]
    why = fallback.refusal(model)
    if why is not None:
        raise TypeError(f"backbones.adapt takes a torch.nn.Module mapping images to logits: {why}")
    if accepts_any_model(scheme):
        return fallback.build(model, scheme, reference)
    aligning = ", ".join(f.name for f in _REGISTRY[:-1])
    listing = "\n  - ".join(f"{f.name}: {f.description}" for f in _REGISTRY[:-1])
    raise TypeError(
        f"aligned targets follow labels through a model's token mixers, which backbones.adapt knows only for "
        f"the families {aligning}; NoAlign() (the image-level CutMix/MixUp target) works for any classifier.\n"
        f"{type(scheme).__name__} cannot adapt {type(model).__name__}, which is none of them: {'; '.join(reasons)}.\n"
        f"Supported families:\n  - {listing}"
    )
