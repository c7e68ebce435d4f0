"""Adapter for timm's NaFlexVit on images: a ``(b, c, h, w)`` batch on a fixed patch grid.

NaFlexVit is a ViT whose embedding module (``NaFlexEmbeds``) does the patch projection, the
position embedding and the prefix tokens in one. On an image batch it cuts the images into
patches (a linear projection of each flattened patch, or a conv whose kernel is its stride: either
way a token is its own patch, as timm's ``PatchEmbed``), normalises them (``input_norm_layer``,
``embed_norm_layer``: per patch, channel ops), adds a position embedding resampled to the grid
(learned or factorised; the resampling acts on the table, never between tokens), then prepends the
class and register tokens. ``dynamic_img_pad`` pads nothing here: the input check refuses images that
do not divide into patches; ``enable_patch_interpolator`` resizes kernels for NaFlex patch batches
only. Its blocks are timm's ``Block`` with ``Attention`` (every registered name)
or ``EvaBlock`` with a model-level rotary embedding (``rope_type``); the attention mask is ``None`` on
this path (it comes only from a NaFlex batch's ``patch_valid``), so the labels move by
``mean_h(A_h) Y`` (TL-Align Eq. 9) as in any ViT. The walk is eva's (``backbones.families.eva``, on
``_prefix_vit``): this file builds the tokens as ``NaFlexEmbeds`` does, with MixToken after the
embedding's norm and before the position embedding, as the ViT family mixes after ``patch_embed``.
Heads: the class token (``'token'``), the mean of the patch tokens (``'avg'``, the prefix tokens too
with ``pool_include_prefix``) or the MAP head (``'map'``, ``backbones._attention_pool``).

NaFlex batches (a dict of patches, patch coordinates and a valid mask, or pre-patchified
``(b, n, p*p*c)`` tensors) have no image grid for the label map: refused when a label map comes with
them (without one, ``adapted(batch)`` is timm's own forward). So are patch dropout, pooling with a max
and every block or attention without a label rule (``naflexvit_refusal`` names them).
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from timm.layers.attention import Attention, AttentionRope
from timm.models.eva import EvaAttention, EvaBlock
from timm.models.naflexvit import NaFlexEmbeds, NaFlexVit, batch_patchify
from timm.models.vision_transformer import Block
from torch import Tensor, nn

from mixlabels import TokenLabelMap
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones.families._prefix_vit import pool_refusal
from mixlabels.backbones.families.eva import AdaptedEva

__all__ = ["AdaptedNaFlexViT", "NAFLEXVIT_FAMILY", "naflexvit_refusal"]

NAFLEXVIT_FAMILY = (
    "timm NaFlexVit on image batches (every naflexvit_* name: linear or conv patch embedding, learned or factorised "
    "position embedding resampled to the grid, aspect-preserving or not; dynamic_img_pad on images that divide into "
    "patches; class and/or register tokens; Block with Attention, or EvaBlock with EvaAttention/AttentionRope and a "
    "rotary embedding of any rope_type; qk_norm, layer scale, scale norms, SwiGLU; 'token', 'avg' (prefix tokens "
    "included or not) or 'map' head; stochastic depth; NaFlex dict/patch-sequence batches refused with a label map)"
)

_BLOCKS = {Block: (Attention,), EvaBlock: (EvaAttention, AttentionRope)}


def naflexvit_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot be adapted as a NaFlexVit on images (``None`` if it can)."""
    if type(model) is not NaFlexVit:  # a subclass may change the forward the walk re-runs
        return f"{type(model).__name__} is not a timm NaFlexVit"
    m: Any = model
    for i, blk in enumerate(m.blocks):
        attn = getattr(blk, "attn", None)
        if type(attn) not in _BLOCKS.get(type(blk), ()):
            return (
                f"block {i} is {type(blk).__name__} with {type(attn).__name__}; only Block with Attention or EvaBlock "
                "with EvaAttention/AttentionRope is supported (DiffAttention's A1 - lambda * A2 has negative weights: "
                "no label rule)"
            )
    if type(m.embeds) is not NaFlexEmbeds:
        return f"embeds is {type(m.embeds).__name__}, not timm's NaFlexEmbeds (its token grid has no label rule here)"
    if m.patch_drop is not None:
        return "patch dropout (patch_drop_rate > 0) drops tokens the labels cannot follow; set patch_drop_rate=0"
    return pool_refusal(m)


def _refuse_naflex_batch(images: Any) -> None:
    """A NaFlex batch carries no image grid the label map could be cut on: say so before any compute."""
    if isinstance(images, dict):
        raise ValueError(
            f"a NaFlex batch (a dict of {', '.join(sorted(images))}) has no fixed patch grid, so a TokenLabelMap "
            "cannot follow its tokens; pass images (batch, channels, H, W) with the label map, or call "
            "adapted(batch) without one for timm's own forward"
        )
    if isinstance(images, Tensor) and images.ndim != 4:
        raise ValueError(
            f"images of shape {tuple(images.shape)} look pre-patchified (a NaFlex patch sequence): they have no fixed "
            "patch grid for the label map; pass images (batch, channels, H, W)"
        )


class AdaptedNaFlexViT(AdaptedEva):
    """A timm NaFlexVit whose forward also returns the scheme's aligned targets (``adapted(images)`` is the model's)."""

    family = NAFLEXVIT_FAMILY
    refusal = staticmethod(naflexvit_refusal)

    def forward(self, images: Any, label_map: TokenLabelMap | None = None) -> Any:
        if label_map is None:
            return super().forward(images)  # timm's own forward: NaFlex batches welcome
        _refuse_naflex_batch(images)
        return super().forward(images, label_map)

    def _patch_size(self) -> tuple[int, int]:
        m: Any = self.model
        return tuple(m.embeds.patch_size)

    def _patches(self, images: Tensor) -> Tensor:
        """``NaFlexEmbeds.forward`` up to its norm, on images: the patch tokens ``b h w c``."""
        e: Any = self.model.embeds
        if e.is_linear:  # each patch flattened, then projected (the input check made the grid exact: no padding)
            x, grid = batch_patchify(images, e.patch_size, pad=e.dynamic_img_pad, channels_last=e.channels_last)
            x = e.proj(x if e.norm_input is None else e.norm_input(x))
        else:
            x = e.proj(images)  # b c h w, kernel = stride = patch
            grid = x.shape[-2:]
            x = rearrange(x, "b c h w -> b (h w) c")
        return rearrange(e.norm(x), "b (h w) c -> b h w c", h=grid[0])  # type: ignore[no-any-return]

    def _prepare(self, x: Tensor) -> tuple[Tensor, Any]:
        """The rest of ``NaFlexVit._forward_embeds`` on a fixed grid, in timm's order: position embedding, prefix
        tokens, position dropout, the rotary embedding, ``norm_pre`` (no mask: no ``patch_valid``)."""
        m: Any = self.model
        e = m.embeds
        grid = [int(x.shape[1]), int(x.shape[2])]
        x = rearrange(x, "b h w c -> b (h w) c").clone()  # timm adds the position embedding in place
        if e.pos_embed_type == "learned":
            e._apply_learned_pos_embed(x, grid_size=grid)  # the table resampled to the grid: per token
        elif e.pos_embed_type == "factorized":
            e._apply_factorized_pos_embed(x, grid_size=grid)
        prefix = [t.expand(x.shape[0], -1, -1) for t in (e.cls_token, e.reg_token) if t is not None]
        x = e.pos_drop(torch.cat([*prefix, x], dim=1))
        rope = None if m.rope is None else m.rope.get_embed(shape=grid)
        return m.norm_pre(x), rope

    def _block_rope(self, shared: Any, layer: int) -> Tensor | None:
        m: Any = self.model
        return shared[layer] if shared is not None and m.rope_is_mixed else shared  # type: ignore[no-any-return]


FAMILY = Family(
    name="naflexvit",
    description=NAFLEXVIT_FAMILY,
    refusal=AdaptedNaFlexViT.refusal,
    build=AdaptedNaFlexViT,
    example=tiny("naflexvit_base_patch16_radio_v3", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                 reg_tokens=2, pos_embed_grid_size=(8, 8)),  # fmt: skip
    timm_modules=("naflexvit",),
    speed_model="naflexvit_base_patch16_gap",
    class_token=True,
)
