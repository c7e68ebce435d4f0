"""Adapter for timm's SwinTransformerV2: cosine window attention, shifted windows, post-norm, patch merging.

What differs from Swin v1 (``_swin.py``, whose window, shift and merge label code this reuses):

- cosine attention: ``A_h = softmax(cos(q_i, k_j) * s_h + B_h + M)`` with a learnable per-head
  logit scale ``s_h = exp(min(t_h, log 100))``, a continuous position bias ``B_h = 16
  sigmoid(cpb_mlp(coords))`` and the shift mask ``M``; without gradients the fast path hands SDPA
  the normalised ``q * s_h``, the normalised ``k`` and scale 1, with ``B_h + M`` as the additive
  mask, so its softmax is timm's; in training the bias needs its gradient, which no fused kernel
  returns, so the matrix is built as timm builds it (timm has no fused route either) and mixes
  the labels too;
- post-norm residuals ``x + drop_path(norm(branch(x)))``: the norm is a channel op, so the labels
  follow the branch's token mix exactly as in a pre-norm block.

Events per block ``layer`` (blocks counted over all stages):

- window attention: ``residual(layer, keep, mixed=mean_h(A_h) Y)`` with ``Y = labels_for(layer)``
  mixed inside every (shifted) window (``mixed=None`` when ``labels_for`` is ``None``);
- MLP: ``residual(layer, keep, mixed=None)`` (channel mixing);
- patch merging (start of stages 1..): ``aggregate`` summing every 2x2 group of labels;
- readout: ``pool("mean", 0)`` (global average pooling, no class token: TransMix refuses).

Shapes: ``b`` batch, ``h w`` token grid, ``nw`` windows, ``n m`` tokens in a window, ``c``
channels, ``l`` label channels, ``hd`` heads, ``d`` head dim.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from timm.layers.classifier import ClassifierHead
from timm.models.swin_transformer_v2 import PatchMerging, SwinTransformerV2, SwinTransformerV2Block, WindowAttention
from torch import Tensor, nn

from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap
from mixlabels.backbones._attention import attention_with_labels
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import branch, explicit_mix, mix_token_space
from mixlabels.backbones._dense import DenseRules, conv_matrix, window_matrix
from mixlabels.backbones.families.swin import AdaptedSwin, check_window_grids, shifted_windows, window_ids
from mixlabels.backbones._family import Family, tiny

__all__ = ["AdaptedSwinV2", "SWINV2_FAMILY", "cosine_attention", "cosine_scores", "cosine_window_attention"]

SWINV2_FAMILY = (
    "timm SwinTransformerV2 (cosine window attention with learnable logit scale and continuous position bias, "
    "shift mask, post-norm residuals, patch merging, global average pooling; every stage's grid divisible by "
    "its window; stochastic depth)"
)


def _swinv2_refusal(model: nn.Module) -> str | None:
    if type(model) is not SwinTransformerV2:
        return f"{type(model).__name__} is not a timm SwinTransformerV2"
    m: Any = model
    if m.global_pool != "avg" or not isinstance(m.head, ClassifierHead):
        return f"global_pool={m.global_pool!r} has no label readout; use 'avg'"
    for i, stage in enumerate(m.layers):
        if not isinstance(stage.downsample, (PatchMerging, nn.Identity)):
            return f"stage {i} downsamples with {type(stage.downsample).__name__}, not PatchMerging"
        for blk in stage.blocks:
            if type(blk) is not SwinTransformerV2Block or type(blk.attn) is not WindowAttention:
                return f"stage {i} has {type(blk).__name__}; only timm's SwinTransformerV2Block is supported"
    return None


def _qkv(attn: Any, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """timm's projections (with its q/zero-k/v bias): ``(b, hd, n, d)`` each."""
    if attn.q_bias is None:
        qkv = attn.qkv(x)
    else:
        bias = torch.cat((attn.q_bias, attn.k_bias, attn.v_bias))
        qkv = attn.qkv(x) + bias if attn.qkv_bias_separate else F.linear(x, weight=attn.qkv.weight, bias=bias)
    q, k, v = rearrange(qkv, "b n (three hd d) -> three b hd n d", three=3, hd=attn.num_heads)
    return q, k, v


def _position_bias(attn: Any) -> Tensor:
    """The continuous position bias ``16 sigmoid(cpb_mlp(coords))`` ``(hd, n, n)``, as timm builds it."""
    n = attn.window_size[0] * attn.window_size[1]
    table = attn.cpb_mlp(attn.relative_coords_table).view(-1, attn.num_heads)
    bias = rearrange(table[attn.relative_position_index.view(-1)], "(n m) hd -> hd n m", n=n)
    return 16 * torch.sigmoid(bias)


def _logit_scale(attn: Any) -> Tensor:
    return torch.clamp(attn.logit_scale, max=math.log(1.0 / 0.01)).exp()  # hd 1 1


def _scores(attn: Any, q: Tensor, k: Tensor, mask: Tensor | None) -> Tensor:
    return cosine_scores(q, k, _logit_scale(attn), _position_bias(attn), mask)


def cosine_scores(q: Tensor, k: Tensor, logit_scale: Tensor, bias: Tensor, mask: Tensor | None) -> Tensor:
    """timm's cosine attention logits ``(b nw, hd, n, m)``: ``cos(q, k) s_h + B_h (+ M)`` in timm's order of operations.

    ``logit_scale`` ``(hd, 1, 1)`` (clamped and exponentiated), ``bias`` ``(hd, n, m)``, ``mask`` ``(nw, n, m)``.
    """
    scores = (F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)) * logit_scale
    scores = scores + bias.unsqueeze(0)
    if mask is not None:
        nw = mask.shape[0]
        scores = rearrange(scores, "(b nw) hd n m -> b nw hd n m", nw=nw) + rearrange(mask, "nw n m -> 1 nw 1 n m")
        scores = rearrange(scores, "b nw hd n m -> (b nw) hd n m")
    return scores


def cosine_attention(
    q: Tensor, k: Tensor, v: Tensor, logit_scale: Tensor, bias: Tensor, mask: Tensor | None, labels: Tensor | None,
    attn_drop: nn.Module,
) -> tuple[Tensor, Tensor | None]:
    """Swin V2's cosine window attention ``(b nw, hd, n, d)`` and ``mean_h(A_h) @ labels`` (``None`` without labels).

    Args:
        q, k, v: ``(b nw, hd, n, d)``.
        logit_scale: ``(hd, 1, 1)``, clamped and exponentiated.
        bias: ``(hd, n, n)`` position bias.
        mask: ``(nw, n, n)`` 0/-100 shift mask or ``None``.
        labels: ``(b nw, n, l)`` window labels, or ``None`` when this layer is not aligned.
        attn_drop: the module's attention dropout (timm's own draw on the matrix is kept when active).

    Without gradients (evaluation, a frozen bias) this is one fused SDPA call that also mixes
    the labels; in training the bias MLP needs its gradient and the matrix is built explicitly.
    """
    dropping = attn_drop.training and isinstance(attn_drop, nn.Dropout) and attn_drop.p > 0
    if dropping or (torch.is_grad_enabled() and bias.requires_grad):
        # timm's own dropout draw on the matrix; or a learnable bias, whose gradient no fused kernel
        # returns (SDPA would build the matrix on its math path anyway): timm's order, timm's rounding
        a = cosine_scores(q, k, logit_scale, bias, mask).softmax(dim=-1)
        mixed = explicit_mix(a, labels) if labels is not None else None  # the undropped attention, as the paper's code
        return attn_drop(a) @ v, mixed
    # cos(q, k) s_h = (s_h q / |q|) . (k / |k|): SDPA at scale 1 with the bias (and mask) as its mask
    qs, kn = F.normalize(q, dim=-1) * logit_scale, F.normalize(k, dim=-1)
    attn_mask = bias.unsqueeze(0)  # 1 hd n m
    if mask is not None:
        attn_mask = attn_mask + repeat(mask, "nw n m -> (b nw) 1 n m", b=q.shape[0] // mask.shape[0])
    if labels is None:
        return F.scaled_dot_product_attention(qs, kn, v, attn_mask=attn_mask, scale=1.0), None
    return attention_with_labels(qs, kn, v, labels, 1.0, 0.0, attn_mask=attn_mask)


def cosine_window_attention(attn: Any, x: Tensor, mask: Tensor | None, labels: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """timm's v2 ``WindowAttention.forward`` on windows ``(b nw, n, c)``, plus ``mean_h(A_h) @ labels``.

    Args:
        attn: the block's v2 ``WindowAttention``.
        mask: ``(nw, n, n)`` 0/-100 shift mask or ``None``.
        labels: ``(b nw, n, l)`` window labels, or ``None`` when this layer is not aligned.
    """
    q, k, v = _qkv(attn, x)
    out, mixed = cosine_attention(q, k, v, _logit_scale(attn), _position_bias(attn), mask, labels, attn.attn_drop)
    out = rearrange(out, "b hd n d -> b n (hd d)")
    return attn.proj_drop(attn.proj(out)), mixed


class AdaptedSwinV2(AdaptedSwin):
    """A timm Swin V2 whose forward also returns the scheme's aligned targets (pooled readout)."""

    family = SWINV2_FAMILY
    refusal = staticmethod(_swinv2_refusal)
    merging = PatchMerging  # Swin V2's; the walk, its grid check and its FSDP2 units are Swin's

    def _block(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker) -> Tensor:
        h = x.shape[1]
        mask = blk.get_attn_mask(x) if blk.dynamic_mask else blk.attn_mask  # nw n n or None (x: only its shape)

        def attend(windows: Tensor, labels: Tensor | None) -> tuple[Tensor, Tensor | None]:
            return cosine_window_attention(blk.attn, windows, mask, labels)

        out, mixed = shifted_windows(x, tracker.labels_for(layer), tuple(blk.window_size), tuple(blk.shift_size), attend)
        out, keep = branch(blk.drop_path1, blk.norm1(out))  # post-norm: a channel op on the branch
        tracker.residual(layer, keep, mixed=mixed)
        x = rearrange(x + out, "b h w c -> b (h w) c")
        out, keep = branch(blk.drop_path2, blk.norm2(blk.mlp(x)))
        tracker.residual(layer, keep, mixed=None)  # channel mixing: labels unchanged
        return rearrange(x + out, "b (h w) c -> b h w c", h=h)

    # ------------------------------------------------------------------ reference
    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit cosine window attention scattered into one ``(b, n, n)`` matrix per block, dense labels."""
        m: Any = self.model
        grid = check_batch(images, label_map, tuple(m.patch_embed.patch_size))
        check_window_grids(m.layers, grid, PatchMerging)
        x = m.patch_embed(images)
        if label_map.token_space:
            x = mix_token_space(x, label_map, channels_last=True)
        depth = sum(len(stage.blocks) for stage in m.layers)
        rules = DenseRules(self.scheme, label_map, grid, 0, depth)
        layer = 0
        for stage in m.layers:
            if isinstance(stage.downsample, PatchMerging):
                merge, grid = conv_matrix(grid, torch.ones(2, 2), stride=(2, 2))
                rules.aggregate(merge)
            x = stage.downsample(x)
            for blk in stage.blocks:
                b, h, w, c = x.shape
                ids = window_ids((h, w), tuple(blk.window_size), tuple(blk.shift_size))  # nw n: original token ids
                windows = rearrange(x.flatten(1, 2)[:, ids], "b nw n c -> (b nw) n c")
                attn = blk.attn
                q, k, v = _qkv(attn, windows)
                mask = blk.get_attn_mask(x) if blk.dynamic_mask else blk.attn_mask
                a = _scores(attn, q, k, mask).softmax(dim=-1)  # (b nw) hd n m
                out = attn.proj_drop(attn.proj(rearrange(attn.attn_drop(a) @ v, "b hd n d -> b n (hd d)")))
                tokens = out.new_zeros(b, h * w, c)
                tokens[:, ids.flatten()] = rearrange(out, "(b nw) n c -> b (nw n) c", b=b)
                attn_out, keep = branch(blk.drop_path1, blk.norm1(rearrange(tokens, "b (h w) c -> b h w c", h=h)))
                mean = rearrange(a.detach().double().mean(dim=1), "(b nw) n m -> b nw n m", b=b)
                rules.mix(layer, window_matrix(mean, ids, h * w), keep)
                x = (x + attn_out).flatten(1, 2)
                x = (x + branch(blk.drop_path2, blk.norm2(blk.mlp(x)))[0]).view(b, h, w, c)
                layer += 1
        x = m.norm(x)
        output = m.forward_head(x)
        token_logits = m.head.fc(m.head.drop(x.flatten(1, 2))) if self.scheme.needs_token_logits else None
        return rules.result(output, output, "mean", token_logits)


FAMILY = Family(
    name="swinv2",
    description=SWINV2_FAMILY,
    refusal=AdaptedSwinV2.refusal,
    build=AdaptedSwinV2,
    example=tiny("swinv2_tiny_window8_256", img_size=32, patch_size=4, window_size=4, embed_dim=16,
        depths=(2, 2), num_heads=(2, 2)),
    timm_modules=("swin_transformer_v2",),
    speed_model="swinv2_tiny_window8_256",
)
