"""Adapter for timm's Eva: EVA, EVA02 and the rotary-embedding ViTs of ``eva.py`` (``vit_*_rope_*``, DINOv3, ...).

Rotary position embedding rotates the patch tokens' q and k (never the prefix tokens')
before attention; the attention rows are still the mixing weights, so the labels move by
``mean_h(A_h) Y`` with ``A = softmax(q_rot k_rot^T * scale)`` (TL-Align Eq. 9), fused into
the attention call as for any ViT (``backbones.families._prefix_vit``). Every rope type timm builds
here (``'cat'``, ``'mixed'`` with its per-block embedding, ``'dinov3'``, ``'mrope'``,
train-time coordinate shift/jitter/rescale) is taken from the model's own ``_pos_embed``
and applied with timm's ``apply_rot_embed_cat``, exactly as the attention applies it.
Grouped-query attention repeats k and v per head group after the rotation, as timm does.
The MLP (GELU, SwiGLU or packed GluMlp, optional inner norm), layer scale ``gamma_1``/
``gamma_2``, the attention's scale norm and sigmoid gate, and pre/post norms are channel ops.
Class token and/or register tokens are prefix tokens labelled with the image target; the head
reads the class token or averages the patch tokens (prefix excluded, as timm pools).
"""

from __future__ import annotations

from typing import Any

import torch
from timm.layers.pos_embed_sincos import apply_rot_embed_cat
from timm.layers.attention import AttentionRope
from timm.models.eva import Eva, EvaAttention, EvaBlock, EvaBlockPostNorm
from torch import Tensor, nn

from mixlabels.backbones.families._prefix_vit import PrefixViT, patch_embed_refusal, pool_refusal, project_qkv
from mixlabels.backbones._family import Family, tiny

__all__ = ["AdaptedEva", "EVA_FAMILY", "eva_refusal"]

EVA_FAMILY = (
    "timm Eva (EVA, EVA02, vit_*_rope_* and the other rotary ViTs in eva.py: rotary position embedding of every "
    "rope type on the patch tokens' q/k; absolute position embedding; class and/or register tokens; EvaAttention "
    "or AttentionRope with fused or separate qkv, q/v bias, qk_norm, scale norm, gate, grouped-query heads; "
    "SwiGLU/GELU MLP; pre- or post-norm blocks; layer scale; class-token or average pooling; stochastic depth)"
)


def eva_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot be adapted as an Eva (``None`` if it can)."""
    if type(model) is not Eva:
        return f"{type(model).__name__} is not a timm Eva"
    m: Any = model
    for i, blk in enumerate(m.blocks):
        if type(blk) not in (EvaBlock, EvaBlockPostNorm) or type(blk.attn) not in (EvaAttention, AttentionRope):
            return (
                f"block {i} is {type(blk).__name__} with {type(getattr(blk, 'attn', None)).__name__}; "
                "only EvaBlock or EvaBlockPostNorm with EvaAttention or AttentionRope is supported"
            )
    if m.patch_drop is not None:
        return "patch dropout (patch_drop_rate > 0) drops tokens the labels cannot follow; set patch_drop_rate=0"
    return pool_refusal(m) or patch_embed_refusal(m)


def rotate(x: Tensor, rope: Tensor | None, attn: Any) -> Tensor:
    """q or k ``(b, h, n, d)`` with the rotary embedding applied to the patch tokens, as timm's attention does."""
    if rope is None:
        return x
    p = attn.num_prefix_tokens
    half = getattr(attn, "rotate_half", False)
    return torch.cat([x[:, :, :p], apply_rot_embed_cat(x[:, :, p:], rope, half=half)], dim=2)


class AdaptedEva(PrefixViT):
    """A timm Eva whose forward also returns the scheme's aligned targets (``adapted(images)`` is the model's)."""

    family = EVA_FAMILY
    refusal = staticmethod(eva_refusal)

    def _prepare(self, x: Tensor) -> tuple[Tensor, Any]:
        m: Any = self.model
        x, rope = m._pos_embed(x)  # prefix tokens, position embedding, the rotary embedding (timm's own)
        return m.norm_pre(x), rope

    def _qkv(self, blk: Any, x: Tensor, layer: int, shared: Any) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        attn = blk.attn
        rope = self._block_rope(shared, layer)
        q, k, v = project_qkv(attn, x)
        q, k = rotate(q, rope, attn).type_as(v), rotate(k, rope, attn).type_as(v)
        groups = getattr(attn, "num_kv_groups", 1)
        if groups > 1:  # grouped-query attention: head h reads kv head h // groups
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return q, k, v, None

    def _block_rope(self, shared: Any, layer: int) -> Tensor | None:
        """The rotary embedding block ``layer`` applies: mixed rope makes one per block."""
        m: Any = self.model
        return shared[layer] if shared is not None and getattr(m, "rope_mixed", False) else shared  # type: ignore[no-any-return]

    def _post_norm(self, blk: Any) -> bool:
        return isinstance(blk, EvaBlockPostNorm)  # not type(): fully_shard subclasses a sharded block


FAMILY = Family(
    name="eva",
    description=EVA_FAMILY,
    refusal=AdaptedEva.refusal,
    build=AdaptedEva,
    example=tiny("vit_small_patch16_rope_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2),
    timm_modules=("eva",),
    speed_model="eva02_tiny_patch14_224",
    class_token=True,
)
