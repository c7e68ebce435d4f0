"""Adapter for timm's SwinTransformerV2Cr: Swin V2 as re-implemented by C. Rw (own block and stage layout).

Against ``_swinv2.py`` (whose cosine attention this reuses) and ``_swin.py`` (windows, shifts, merges):

- the stages take and return NCHW (the patch embedding's output), blocks run NHWC inside;
- patch merging normalises the concatenated 2x2 tokens before the linear reduction: a 2x2
  merge all the same (``aggregate`` summing every 2x2 group of labels);
- cosine attention with a per-head logit scale and a position bias from an MLP on log-spaced
  relative coordinates (no sigmoid; the MLP has its own dropout in training, drawn once per
  block as timm draws it);
- post-norm residuals and the optional extra main-branch norm ``norm3`` (every
  ``extra_norm_period`` blocks, at stage ends, always in the last block: it is the final
  norm): norms are channel ops, labels unchanged.

Events per block ``layer``: attention ``residual(layer, keep, mixed=mean_h(A_h) Y)`` inside every
(shifted) window, MLP ``residual(layer, keep, mixed=None)``; merges ``aggregate``; readout
``pool("mean", 0)`` (no class token: TransMix refuses).

Shapes: ``b`` batch, ``h w`` token grid, ``nw`` windows, ``n m`` tokens in a window, ``c``
channels, ``l`` label channels, ``hd`` heads, ``d`` head dim.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from einops import rearrange
from timm.layers.classifier import ClassifierHead
from timm.models.swin_transformer_v2_cr import (
    PatchMerging,
    SwinTransformerV2Cr,
    SwinTransformerV2CrBlock,
    SwinTransformerV2CrStage,
    WindowMultiHeadAttention,
)
from torch import Tensor, nn

from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap, TokenLayout
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import AdaptedBase, branch, mix_token_space, mean_pool_merge, stride_grid
from mixlabels.backbones._dense import DenseRules, conv_matrix, window_matrix
from mixlabels.backbones.families.swin import check_window_grids, shifted_windows, window_ids
from mixlabels.backbones.families.swinv2 import cosine_attention, cosine_scores
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._fsdp import through_hooks

__all__ = ["AdaptedSwinV2Cr", "SWINV2_CR_FAMILY"]

SWINV2_CR_FAMILY = (
    "timm SwinTransformerV2Cr (cosine window attention with learnable logit scale and log-spaced MLP position "
    "bias, shift mask, post-norm residuals and extra main-branch norms, patch merging, global average pooling; "
    "every stage's grid divisible by its window; stochastic depth)"
)


def _swinv2_cr_refusal(model: nn.Module) -> str | None:
    if type(model) is not SwinTransformerV2Cr:
        return f"{type(model).__name__} is not a timm SwinTransformerV2Cr"
    m: Any = model
    if not isinstance(m.head, ClassifierHead):
        return f"the head is {type(m.head).__name__}, not timm's ClassifierHead; it has no label readout"
    if m.head.global_pool.pool_type != "avg":
        return f"global_pool={m.head.global_pool.pool_type!r} has no label readout; use 'avg'"
    for i, stage in enumerate(m.stages):
        if type(stage) is not SwinTransformerV2CrStage:
            return f"stage {i} is {type(stage).__name__}; only timm's SwinTransformerV2CrStage is supported"
        if not isinstance(stage.downsample, (PatchMerging, nn.Identity)):
            return f"stage {i} downsamples with {type(stage.downsample).__name__}, not PatchMerging"
        for blk in stage.blocks:
            if type(blk) is not SwinTransformerV2CrBlock or type(blk.attn) is not WindowMultiHeadAttention:
                return f"stage {i} has {type(blk).__name__}; only timm's SwinTransformerV2CrBlock is supported"
    return None


def _attention_parts(attn: Any, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q, k, v ``(b nw, hd, n, d)``, the logit scale ``(hd, 1, 1)`` and the position bias ``(hd, n, n)``,
    in timm's order (the bias MLP's dropout draws after the projections, before the attention's)."""
    q, k, v = rearrange(attn.qkv(x), "b n (three hd d) -> three b hd n d", three=3, hd=attn.num_heads)
    scale = torch.clamp(rearrange(attn.logit_scale, "hd -> hd 1 1"), max=math.log(1.0 / 0.01)).exp()
    return q, k, v, scale, attn._relative_positional_encodings()[0]


def _window_attention(attn: Any, x: Tensor, mask: Tensor | None, labels: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """timm's ``WindowMultiHeadAttention.forward`` on windows ``(b nw, n, c)``, plus ``mean_h(A_h) @ labels``."""
    q, k, v, scale, bias = _attention_parts(attn, x)
    out, mixed = cosine_attention(q, k, v, scale, bias, mask, labels, attn.attn_drop)
    return attn.proj_drop(attn.proj(rearrange(out, "b hd n d -> b n (hd d)"))), mixed


class AdaptedSwinV2Cr(AdaptedBase):
    """A timm Swin V2-CR whose forward also returns the scheme's aligned targets (pooled readout)."""

    family = SWINV2_CR_FAMILY
    refusal = staticmethod(_swinv2_cr_refusal)

    def reference_grid(self, label_map: TokenLabelMap) -> tuple[int, int]:
        """The reference's labels start on the patch grid (see ``AdaptedBase.reference_bytes``)."""
        m: Any = self.model
        return stride_grid(label_map, tuple(m.patch_embed.patch_size))

    def _embed(self, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int], int]:
        m: Any = self.model
        grid = check_batch(images, label_map, tuple(m.patch_embed.patch_size))
        check_window_grids(m.stages, grid, PatchMerging)
        x = m.patch_embed(images)  # b c h w
        if label_map.token_space:
            x = mix_token_space(x, label_map, channels_last=False)
        return x, grid, sum(len(stage.blocks) for stage in m.stages)

    def _readout(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """Logits from the last stage's NCHW output (its last block's ``norm3`` is the final norm), token logits."""
        m: Any = self.model
        output = m.forward_head(x)
        token_logits = None
        if self.scheme.needs_token_logits:  # the classifier on every final token
            token_logits = m.head.fc(m.head.drop(rearrange(x, "b c h w -> b (h w) c")))
        return output, token_logits

    # ------------------------------------------------------------------ fast path
    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid, depth = self._embed(images, label_map)
        tracker = self.scheme.start(label_map, TokenLayout(grid=grid, num_prefix=0, depth=depth, class_token=False))
        layer = 0
        for stage in m.stages:
            x = rearrange(x, "b c h w -> b h w c")
            if isinstance(stage.downsample, PatchMerging):  # concatenating 2x2 tokens: their labels add up
                merge, grid = mean_pool_merge(grid, (2, 2), (2, 2))
                tracker.aggregate(merge, normalised=True)
            x = stage.downsample(x)
            for blk in stage.blocks:
                x = through_hooks(blk, functools.partial(self._block, blk, layer=layer, tracker=tracker), x)
                layer += 1
            x = rearrange(x, "b h w c -> b c h w")
        tracker.pool("mean", 0)
        output, token_logits = self._readout(x)
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        m: Any = self.model
        return tuple(blk for stage in m.stages for blk in stage.blocks)

    def _block(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker) -> Tensor:
        h = x.shape[1]
        mask = blk.get_attn_mask(x) if blk.dynamic_mask else blk.attn_mask  # nw n n or None (x: only its shape)

        def attend(windows: Tensor, labels: Tensor | None) -> tuple[Tensor, Tensor | None]:
            return _window_attention(blk.attn, windows, mask, labels)

        out, mixed = shifted_windows(x, tracker.labels_for(layer), tuple(blk.window_size), tuple(blk.shift_size), attend)
        out, keep = branch(blk.drop_path1, blk.norm1(out))  # post-norm: a channel op on the branch
        tracker.residual(layer, keep, mixed=mixed)
        x = rearrange(x + out, "b h w c -> b (h w) c")
        out, keep = branch(blk.drop_path2, blk.norm2(blk.mlp(x)))
        tracker.residual(layer, keep, mixed=None)  # channel mixing: labels unchanged
        x = blk.norm3(x + out)  # the extra main-branch norm (or Identity): a channel op
        return rearrange(x, "b (h w) c -> b h w c", h=h)

    # ------------------------------------------------------------------ reference
    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit cosine window attention scattered into one ``(b, n, n)`` matrix per block, dense labels."""
        m: Any = self.model
        x, grid, depth = self._embed(images, label_map)
        rules = DenseRules(self.scheme, label_map, grid, 0, depth)
        layer = 0
        for stage in m.stages:
            x = x.permute(0, 2, 3, 1)
            if isinstance(stage.downsample, PatchMerging):
                merge, grid = conv_matrix(grid, torch.ones(2, 2), stride=(2, 2))
                rules.aggregate(merge)
            x = stage.downsample(x)
            for blk in stage.blocks:
                b, h, w, c = x.shape
                ids = window_ids((h, w), tuple(blk.window_size), tuple(blk.shift_size))  # nw n: original token ids
                windows = rearrange(x.flatten(1, 2)[:, ids], "b nw n c -> (b nw) n c")
                attn = blk.attn
                q, k, v, scale, bias = _attention_parts(attn, windows)
                mask = blk.get_attn_mask(x) if blk.dynamic_mask else blk.attn_mask
                a = cosine_scores(q, k, scale, bias, mask).softmax(dim=-1)  # (b nw) hd n m
                out = attn.proj_drop(attn.proj(rearrange(attn.attn_drop(a) @ v, "b hd n d -> b n (hd d)")))
                tokens = out.new_zeros(b, h * w, c)
                tokens[:, ids.flatten()] = rearrange(out, "(b nw) n c -> b (nw n) c", b=b)
                attn_out, keep = branch(blk.drop_path1, blk.norm1(tokens.view(b, h, w, c)))
                mean = rearrange(a.detach().double().mean(dim=1), "(b nw) n m -> b nw n m", b=b)
                rules.mix(layer, window_matrix(mean, ids, h * w), keep)
                x = (x + attn_out).flatten(1, 2)
                x = blk.norm3(x + branch(blk.drop_path2, blk.norm2(blk.mlp(x)))[0]).view(b, h, w, c)
                layer += 1
            x = x.permute(0, 3, 1, 2)
        output, token_logits = self._readout(x)
        return rules.result(output, output, "mean", token_logits)


FAMILY = Family(
    name="swinv2_cr",
    description=SWINV2_CR_FAMILY,
    refusal=AdaptedSwinV2Cr.refusal,
    build=AdaptedSwinV2Cr,
    example=tiny("swinv2_cr_tiny_224", img_size=32, patch_size=4, window_size=4, embed_dim=16,
        depths=(2, 2), num_heads=(2, 2), init_values=1.0),
    timm_modules=("swin_transformer_v2_cr",),
    speed_model="swinv2_cr_tiny_224",
)
