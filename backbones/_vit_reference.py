"""Reference path for the ViT adapter: explicit attention matrices and dense labels.

Written for clarity, not speed, and independently of the event protocol: every
scheme's rule is spelled out here on ``(b, n, c)`` class distributions, so the fast
path (compact ``(b, n, k)`` weights, alignment fused into attention, events) is
tested against a second implementation. Materialises ``(b, h, n, n)`` per layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from mixlabels.backbones._checks import check_batch
from mixlabels import AlignedOutput, NoAlign, Scheme, TLAlign, TokenLabeling, TokenLabelMap, TransMix

__all__ = ["reference_forward"]


def _drop_path(x: Tensor, module: nn.Module) -> tuple[Tensor, Tensor | None]:
    """timm's DropPath, same RNG draw, and the per-sample keep flags."""
    prob = float(getattr(module, "drop_prob", 0.0))
    if prob == 0.0 or not module.training:
        return x, None
    keep_prob = 1.0 - prob
    mask = x.new_empty((x.shape[0], 1, 1)).bernoulli_(keep_prob)  # b 1 1
    scaled = mask / keep_prob if getattr(module, "scale_by_keep", True) else mask
    return x * scaled, mask.view(-1) > 0


def reference_forward(model: nn.Module, scheme: Scheme, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
    """Run a timm ViT on a mixed batch with explicit attention and dense labels.

    Args:
        model: a timm ``VisionTransformer`` (as accepted by ``backbones.adapt``).
        scheme: ``NoAlign``, ``TransMix``, ``TLAlign`` or ``TokenLabeling`` (no annotator).
        images: ``(b, 3, H, W)``.
        label_map: the batch's map.

    Returns:
        The same ``AlignedOutput`` as the fast path (``weights`` is ``None``: labels are dense).
    """
    m: Any = model  # timm is untyped
    grid = check_batch(images, label_map, tuple(m.patch_embed.patch_size))
    depth, p = len(m.blocks), m.num_prefix_tokens
    align: set[int] = set()
    normalize, follow_drop = True, True
    if isinstance(scheme, TLAlign):
        layers = range(depth) if scheme.layers is None else scheme.layers
        align, normalize = {i % depth for i in layers}, scheme.normalize
        follow_drop = scheme.drop_path == "follow"  # "official": a dropped sample's labels mix anyway
    elif isinstance(scheme, TokenLabeling):
        if scheme.annotator is not None:
            raise NotImplementedError("the reference path covers label-map token targets only")
        align = set(range(depth)) if scheme.aligned else set()
    elif not isinstance(scheme, (NoAlign, TransMix)):
        raise TypeError(f"the reference path knows NoAlign, TransMix, TLAlign and TokenLabeling, got {scheme!r}")

    x = m.patch_embed(images)
    if label_map.token_space:
        if x.ndim == 4:
            x = rearrange(
                label_map.mix_tokens(rearrange(x, "b h w d -> b (h w) d"), grid), "b (h w) d -> b h w d", h=grid[0]
            )
        else:
            x = label_map.mix_tokens(x, grid)
    x = m.norm_pre(m.patch_drop(m._pos_embed(x)))  # b n d

    # Eq. 5 on dense labels: prefix tokens carry the image-level target, patch tokens their area's.
    image_target = label_map.image_targets()  # b c
    patch_target = label_map.targets(label_map.token_weights(grid))  # b n c
    y0 = torch.cat([image_target.unsqueeze(1).expand(-1, p, -1), patch_target], dim=1)  # b n c
    y = y0
    class_row: Tensor | None = None
    for i, blk in enumerate(m.blocks):
        attn = blk.attn
        h = blk.norm1(x)
        q, k, v = rearrange(attn.qkv(h), "b n (three h d) -> three b h n d", three=3, h=attn.num_heads)
        q, k = attn.q_norm(q), attn.k_norm(k)
        a = torch.softmax(q @ k.transpose(-2, -1) * attn.scale, dim=-1)  # b h n n, the full matrix
        out = F.dropout(a, attn.attn_drop.p, attn.training) @ v  # b h n d
        out = attn.norm(rearrange(out, "b h n d -> b n (h d)"))
        if getattr(attn, "gate", None) is not None:
            out = out * attn.gate(h).sigmoid()
        branch, keep = _drop_path(blk.ls1(attn.proj_drop(attn.proj(out))), blk.drop_path1)
        if i in align:
            mixed = a.detach().float().mean(dim=1) @ y  # Eq. 9: head-mean attention on the labels
            new = (y + mixed) / 2 if normalize else mixed  # Eq. 11 (or the residual dropped)
            y = new if keep is None or not follow_drop else torch.where(keep.view(-1, 1, 1), new, y)
        if i == depth - 1:
            class_row = a.detach().float()[:, :, 0, p:].mean(dim=1)  # b n: TransMix's class attention
        x = x + branch
        branch, _ = _drop_path(blk.ls2(blk.mlp(blk.norm2(x))), blk.drop_path2)
        x = x + branch  # MLP residual: Norm(Y + Y) = Y
    x = m.norm(x)
    output = m.forward_head(x)
    logits = output[0] if isinstance(output, tuple) else output

    if m.global_pool == "token":
        y_readout = y[:, 0]
    else:
        y_readout = y[:, (0 if m.pool_include_prefix else p) :].mean(dim=1)
    token_logits = token_target = None
    beta = 0.0
    if isinstance(scheme, TLAlign):
        target = y_readout
    elif isinstance(scheme, TransMix):
        if m.global_pool != "token":
            raise ValueError("TransMix needs a class token")
        assert class_row is not None
        w = class_row / class_row.sum(dim=-1, keepdim=True)
        target = (torch.einsum("bn,bnc->bc", w, patch_target) + image_target) / 2
    elif isinstance(scheme, TokenLabeling):
        target = y_readout if scheme.aligned else image_target
        token_target = (y if scheme.aligned else y0)[:, p:]
        token_logits = m.head(m.head_drop(m.fc_norm(x[:, p:])))
        beta = scheme.beta
    else:
        target = image_target
    return AlignedOutput(output, logits, target.detach(), None, token_logits, token_target, beta)
