"""Adapter for timm's VisionTransformerRelPos (``vit_relpos_*``, ``vit_srelpos_*``, ``*_cls_*``, ``*_rpn_*``).

A ViT without absolute position embeddings whose attention scores get a relative position
bias: ``RelPosBias`` (a learned table indexed by token offsets, as Swin v1) or ``RelPosMlp``
(an MLP on log-spaced offsets, in any of its modes: ``'cr'``, ``'swin'`` with its sigmoid
gain), per block or one shared by all blocks. Every variant is one additive ``(1, h, n, n)``
tensor from ``get_bias()``, which covers the class token too (``RelPosBias`` learns its row
and column, ``RelPosMlp`` pads them with zeros), so it is the fused call's ``attn_mask`` and
the labels move by the rows of ``softmax(q k^T * scale + bias)`` (``backbones.families._prefix_vit``).
``RelPosMlp`` has dropout in its MLP: the bias is drawn once per block, as timm draws it, and
the labels follow the bias the model used.
"""

from __future__ import annotations

from typing import Any

import torch
from timm.layers.pos_embed_rel import RelPosBias, RelPosMlp
from timm.models.vision_transformer_relpos import RelPosAttention, RelPosBlock, ResPostRelPosBlock, VisionTransformerRelPos
from torch import Tensor, nn

from mixlabels.backbones.families._prefix_vit import PrefixViT, patch_embed_refusal, pool_refusal, project_qkv
from mixlabels.backbones._family import Family, tiny

__all__ = ["AdaptedRelPosViT", "RELPOS_FAMILY", "relpos_refusal"]

RELPOS_FAMILY = (
    "timm VisionTransformerRelPos (vit_relpos_*, vit_srelpos_*: RelPosBias or RelPosMlp relative position "
    "bias, per block or shared, as the attention's additive mask; class token or global average pooling; "
    "fc_norm; pre-norm RelPosBlock and res-post-norm ResPostRelPosBlock; layer scale; qk_norm; stochastic depth)"
)


def relpos_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot be adapted as a rel-pos ViT (``None`` if it can)."""
    if type(model) is not VisionTransformerRelPos:
        return f"{type(model).__name__} is not a timm VisionTransformerRelPos"
    m: Any = model
    for i, blk in enumerate(m.blocks):
        if type(blk) not in (RelPosBlock, ResPostRelPosBlock) or type(blk.attn) is not RelPosAttention:
            return (
                f"block {i} is {type(blk).__name__} with {type(getattr(blk, 'attn', None)).__name__}; "
                "only RelPosBlock or ResPostRelPosBlock with RelPosAttention is supported"
            )
        rel_pos = blk.attn.rel_pos if blk.attn.rel_pos is not None else m.shared_rel_pos
        if rel_pos is not None and type(rel_pos) not in (RelPosBias, RelPosMlp):
            return f"block {i}'s relative position module is {type(rel_pos).__name__}; only RelPosBias and RelPosMlp are supported"
    return pool_refusal(m) or patch_embed_refusal(m)


class AdaptedRelPosViT(PrefixViT):
    """A timm rel-pos ViT whose forward also returns the scheme's aligned targets (``adapted(images)`` is the model's)."""

    family = RELPOS_FAMILY
    refusal = staticmethod(relpos_refusal)

    def _prepare(self, x: Tensor) -> tuple[Tensor, Any]:
        m: Any = self.model
        if m.cls_token is not None:
            x = torch.cat((m.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        return x, m.shared_rel_pos.get_bias() if m.shared_rel_pos is not None else None

    def _qkv(self, blk: Any, x: Tensor, layer: int, shared: Any) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        q, k, v = project_qkv(blk.attn, x)
        # timm adds a block's own bias, else the shared one (never both); drawn here, in timm's order.
        bias = blk.attn.rel_pos.get_bias() if blk.attn.rel_pos is not None else shared
        return q, k, v, bias

    def _post_norm(self, blk: Any) -> bool:
        return isinstance(blk, ResPostRelPosBlock)  # not type(): fully_shard subclasses a sharded block


FAMILY = Family(
    name="vit_relpos",
    description=RELPOS_FAMILY,
    refusal=AdaptedRelPosViT.refusal,
    build=AdaptedRelPosViT,
    example=tiny("vit_relpos_medium_patch16_cls_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
        rel_pos_dim=16),
    timm_modules=("vision_transformer_relpos",),
    speed_model="vit_relpos_small_patch16_224",
    class_token=True,
)
