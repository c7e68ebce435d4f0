"""Adapter for timm's Beit (BEiT, BEiTv2: ``beit_*``, ``beitv2_*``).

A ViT with a class token whose attention scores get a relative position bias: each block's
own table (``use_rel_pos_bias``), one ``RelativePositionBias`` shared by all blocks
(``use_shared_rel_pos_bias``), or both summed, as timm adds them. The bias is
``(h, n, n)`` over the class token and the patches (the class token's row, column and
self-offset are learned entries of the table), so it is the fused call's ``attn_mask`` and
the labels move by the rows of ``softmax(q k^T * scale + bias)`` (``backbones.families._prefix_vit``).
``q_bias``/``v_bias`` (k gets none) are part of the qkv projection; layer scale
``gamma_1``/``gamma_2`` and the MLP (GELU, or SwiGLU with its optional inner norm) are
channel ops; the head reads the class token or averages the patches under ``fc_norm``.
"""

from __future__ import annotations

from typing import Any

import torch
from timm.models.beit import Attention, Beit, Block
from torch import Tensor, nn

from mixlabels.backbones.families._prefix_vit import PrefixViT, patch_embed_refusal, pool_refusal, project_qkv
from mixlabels.backbones._family import Family, tiny

__all__ = ["AdaptedBeit", "BEIT_FAMILY", "beit_refusal"]

BEIT_FAMILY = (
    "timm Beit (BEiT, BEiTv2: class token; per-block and/or shared relative position bias as the attention's "
    "additive mask; absolute position embedding; q_bias/v_bias; layer scale gamma_1/gamma_2; GELU or SwiGLU "
    "MLP; class-token or average pooling with fc_norm; stochastic depth)"
)


def beit_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot be adapted as a BEiT (``None`` if it can)."""
    if type(model) is not Beit:
        return f"{type(model).__name__} is not a timm Beit"
    m: Any = model
    for i, blk in enumerate(m.blocks):
        if type(blk) is not Block or type(blk.attn) is not Attention:
            return (
                f"block {i} is {type(blk).__name__} with {type(getattr(blk, 'attn', None)).__name__}; "
                "only timm's Beit Block with its Attention is supported"
            )
    return pool_refusal(m) or patch_embed_refusal(m)


class AdaptedBeit(PrefixViT):
    """A timm BEiT whose forward also returns the scheme's aligned targets (``adapted(images)`` is the model's)."""

    family = BEIT_FAMILY
    refusal = staticmethod(beit_refusal)

    def _prepare(self, x: Tensor) -> tuple[Tensor, Any]:
        m: Any = self.model
        x = torch.cat((m.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        if m.pos_embed is not None:
            x = x + m.pos_embed
        return m.pos_drop(x), m.rel_pos_bias() if m.rel_pos_bias is not None else None

    def _qkv(self, blk: Any, x: Tensor, layer: int, shared: Any) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        attn = blk.attn
        q, k, v = project_qkv(attn, x)
        bias = shared
        if attn.relative_position_bias_table is not None:  # the block's own table, plus the shared one
            own = attn._get_rel_pos_bias()
            bias = own if shared is None else own + shared
        return q, k, v, bias


FAMILY = Family(
    name="beit",
    description=BEIT_FAMILY,
    refusal=AdaptedBeit.refusal,
    build=AdaptedBeit,
    example=tiny("beit_base_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2),
    timm_modules=("beit",),
    speed_model="beit_base_patch16_224",
)
