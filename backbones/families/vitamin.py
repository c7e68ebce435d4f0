"""Adapter for timm's ViTamin (``vitamin``): a ViT whose ``HybridEmbed`` is ``MbConvStages``, built on ``vit_hybrid``.

The labels follow the conv stages by ``backbones._convnet``'s rules, then the transformer by ``vit``'s (the walks are
``vit_hybrid``'s ``AdaptedViTHybrid``; this file gives it ViTamin's CNN). Events, ``layer`` counting the
``MbConvLNBlock``\\ s, then the transformer's blocks:

- the stem (``Stem``: a 3x3 stride-2 conv, a per-position norm-act, a 3x3 stride-1 conv): the strided conv aggregates
  from the pixels over its windows, the stride-1 conv mixes by its normalised |kernel| (a MixToken map is mixed on the
  stem's grid and starts there);
- each ``MbConvLNBlock`` (``drop_path(1x1 -> depthwise kxk -> 1x1 (pre_norm(x))) + shortcut(x)``): the branch's
  depthwise conv mixes by the channel-averaged normalised |kernel| at stride 1 and aggregates over its windows when
  strided; the shortcut keeps the labels (identity, a 1x1 conv) or aggregates over its pool's windows
  (``Downsample2d``: a 3x3 stride-2 average pool, then a 1x1 conv); the branch joins by the residual rule, drop path
  deciding per sample as the scheme says;
- ``MbConvStages.pool`` (``StridedConv``: a norm, then a 3x3 stride-2 conv) aggregates over its windows, with
  ``HybridEmbed``'s projection (``proj=False`` in timm's names: none); the token grid is its output grid, row-major;
- the prefix tokens (class, register: none in timm's names) carry the image's label until the transformer;
- the transformer's blocks: timm's ``Block`` with ``Attention`` (head-mean attention) and a per-token MLP (``Mlp``,
  ``GluMlp``, ``SwiGLU`` or ViTamin's ``GeGluMlp``: channel ops);
- readout: the mean of the patch tokens (``global_pool='avg'``, timm's names) or ``pool("token", 0)``.

Shapes: ``b`` batch, ``n`` positions or tokens, ``c`` classes, ``l`` label channels.
"""

from __future__ import annotations

from typing import Any

import timm
import torch
from timm.layers.drop import DropPath
from timm.layers.hybrid_embed import HybridEmbed
from timm.models.vision_transformer import VisionTransformer
from timm.models.vitamin import Downsample2d, GeGluMlp, MbConvLNBlock, MbConvStages, StridedConv, VitCfg, VitConvCfg, Stem
from torch import Tensor, nn

from mixlabels.backbones._common import branch
from mixlabels.backbones._convnet import Path, path_of, path_refusal
from mixlabels.backbones._family import Family
from mixlabels.backbones.families.vit_hybrid import _CNN, AdaptedViTHybrid, _sequence, transformer_refusal

__all__ = ["AdaptedViTamin", "VITAMIN_FAMILY", "vitamin_refusal", "tiny_vitamin"]

VITAMIN_FAMILY = (
    "timm ViTamin (VisionTransformer over a HybridEmbed of MbConvStages): the conv stem and MbConvLNBlock stages by the "
    "CNN rules (strided convs and the downsampling shortcut's pool aggregate over their windows; stride-1 3x3 and "
    "depthwise convs mix labels by the normalised |kernel|; each block's branch joins by the residual rule), the "
    "StridedConv pool aggregates to the token grid, then ViT's Block + Attention (head-mean attention; Mlp or GeGluMlp "
    "channel mixing); 'avg' or 'token' readout; stochastic depth"
)

def _branch_modules(blk: Any) -> list[nn.Module]:
    """An ``MbConvLNBlock``'s branch in its forward's order, before its drop path."""
    return [blk.pre_norm, blk.down, blk.conv1_1x1, blk.act1, blk.conv2_kxk, blk.act2, blk.conv3_1x1]


def _shortcut_modules(blk: Any) -> list[nn.Module]:
    sc = blk.shortcut
    return [sc.pool, sc.expand] if type(sc) is Downsample2d else [sc]


def _block(blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
    """timm's ``MbConvLNBlock.forward`` with the drop-path draw exposed."""
    shortcut = blk.shortcut(x)
    h, keep = branch(blk.drop_path, _sequence(_branch_modules(blk))(x))
    return h + shortcut, keep


def _paths(blk: Any) -> tuple[Path, Path]:
    return path_of(_branch_modules(blk)), path_of(_shortcut_modules(blk))


def _stem_modules(stem: Any) -> list[nn.Module]:
    return [stem.conv1, stem.norm1, stem.conv2]


def _blocks(bb: Any) -> list[nn.Module]:
    return [blk for stage in bb.stages for blk in stage]


def _cnn(bb: Any) -> _CNN:
    """``MbConvStages`` (``mbconv_refusal`` accepted it) as ``vit_hybrid``'s parts: its pool is the tail."""
    blocks = tuple(_blocks(bb))
    pool = [bb.pool.norm, bb.pool.proj]
    return _CNN(bb.stem, path_of(_stem_modules(bb.stem)), blocks, _block, tuple(_paths(b) for b in blocks), _sequence(pool), path_of(pool))


def _block_refusal(blk: Any, where: str) -> str | None:
    if type(blk) is not MbConvLNBlock:
        return f"{where} is {type(blk).__name__}; only timm's MbConvLNBlock is supported in ViTamin's stages"
    if type(blk.drop_path) not in (DropPath, nn.Identity):
        return f"{where}'s drop_path is {type(blk.drop_path).__name__}, not timm's DropPath"
    kind: type[nn.Module] = type(blk.shortcut)
    if kind not in (Downsample2d, nn.Identity, nn.Conv2d):
        return f"{where}'s shortcut is {kind.__name__}; only Downsample2d, a conv or the identity is supported"
    return path_refusal(_branch_modules(blk), f"{where}'s branch") or path_refusal(_shortcut_modules(blk), f"{where}'s shortcut")


def mbconv_refusal(bb: nn.Module) -> str | None:
    """Why a ``HybridEmbed``'s backbone is not ViTamin's ``MbConvStages`` with a label rule (``None``: it is)."""
    if type(bb) is not MbConvStages:
        return f"HybridEmbed's backbone is {type(bb).__name__}, not ViTamin's MbConvStages (the vit_hybrid family takes ResNet backbones)"
    b: Any = bb
    if type(b.stem) is not Stem:
        return f"the backbone's stem is {type(b.stem).__name__}, not ViTamin's Stem"
    why = path_refusal(_stem_modules(b.stem), "the backbone's stem")
    if why is not None:
        return why
    if type(b.stages) is not nn.Sequential or any(type(stage) is not nn.Sequential for stage in b.stages):
        return "the backbone's stages are not a Sequential of Sequentials of MbConvLNBlocks"
    for i, blk in enumerate(_blocks(b)):
        why = _block_refusal(blk, f"the backbone's block {i}")
        if why is not None:
            return why
    if type(b.pool) is not StridedConv:
        return f"the backbone's pool is {type(b.pool).__name__}, not ViTamin's StridedConv"
    return path_refusal([b.pool.norm, b.pool.proj], "the backbone's pool")


def vitamin_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm ViTamin this adapter carries labels through (``None``: it is)."""
    if not isinstance(model, VisionTransformer):
        return f"{type(model).__name__} is not a timm VisionTransformer"
    m: Any = model
    if type(m.patch_embed) is not HybridEmbed:
        return f"patch_embed is {type(m.patch_embed).__name__}, not timm's HybridEmbed over ViTamin's MbConvStages"
    return mbconv_refusal(m.patch_embed.backbone) or transformer_refusal(model)


class AdaptedViTamin(AdaptedViTHybrid):
    """A timm ViTamin returning the scheme's aligned targets (``adapted(images)`` is the model's): ``vit_hybrid``'s
    walks over ViTamin's conv stages."""

    family = VITAMIN_FAMILY
    refusal = staticmethod(vitamin_refusal)

    def _backbone(self, bb: Any) -> _CNN:
        return _cnn(bb)


def tiny_vitamin(drop_path_rate: float = 0.0, conv_drop_path_rate: float = 0.0, **kwargs: Any) -> nn.Module:
    """A seeded tiny ViTamin on 32x32 images (10 classes): ``vitamin_small_224``'s layout (GeGluMlp, no class token,
    'avg' pooling) with an 8-wide stem, stages of 1 and 2 MbConvLNBlocks (8 and 16 wide: a strided block with a
    1x1-expanding shortcut, a stride-1 one), a 32-wide 2x2 token grid and two transformer blocks.
    ``conv_drop_path_rate``: drop path on the conv blocks too (timm's names build them without)."""
    torch.manual_seed(0)
    cfg = VitCfg(embed_dim=(8, 16, 32), depths=(1, 2, 1), stem_width=8, conv_cfg=VitConvCfg(norm_layer="layernorm2d", norm_eps=1e-6))
    args = {"img_size": 32, "embed_dim": 32, "depth": 2, "num_heads": 2, "num_classes": 10} | kwargs
    model: Any = timm.create_model("vitamin_small_224", pretrained=False, embed_cfg=cfg, drop_path_rate=drop_path_rate, **args)
    if conv_drop_path_rate:
        for blk in _blocks(model.patch_embed.backbone):
            blk.drop_path = DropPath(conv_drop_path_rate)
    return model  # type: ignore[no-any-return]


FAMILY = Family(
    name="vitamin",
    description=VITAMIN_FAMILY,
    refusal=vitamin_refusal,
    build=AdaptedViTamin,
    example=tiny_vitamin,
    timm_modules=("vitamin",),
    speed_model="vitamin_small_224",
    class_token=False,
)
