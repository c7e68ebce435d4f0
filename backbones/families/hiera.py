"""Adapter for timm's Hiera: mask-unit attention on unrolled tokens, query pooling at stage transitions.

TL-Align Table 10 and Appendix D extended by the same reasoning as for Swin (windows)
and MViTv2 (query pooling). Hiera keeps its tokens "unrolled": ``Unroll`` permutes the
patch tokens once so that every max pool is a reshape and every mask unit a strided
slice. Labels are permuted the same way (timm's own ``Unroll`` applied to them), so they
stay token for token with the features. Events per block ``layer``, ``Y = labels_for(layer)``:

- patch embedding (7x7 stride 4 padding 3, overlapping): labels start on the pixels and are
  summed under every window (as PVT v2's); a MixToken map starts on the patch grid. Then
  ``aggregate`` by the unroll permutation (rows stay normalised).
- attention: mask-unit attention (window ``w`` holds tokens ``t * nw + w``) or global
  attention, ``mean_h(A_h) Y`` within each window (fused into the attention call when timm
  fuses). At a stage transition the queries are max-pooled over ``q_stride`` tokens: each
  pooled query's row mixes the window's keys' labels as the attention weighs them (queries
  only set the weights).
- the shortcut at a stage transition is max-pooled the same way (``proj`` first, a channel op,
  or max and mean pools concatenated): ``aggregate`` sums the labels of the ``q_stride``
  pooled tokens, so ``residual(layer, keep, mixed=...)`` combines labels on the pooled tokens.
- MLP, layer scale, norms: ``residual(layer, keep, mixed=None)``.
- readout: ``pool("mean", 0)`` (average pooling; no class token: TransMix refuses).

Shapes: ``b`` batch, ``h`` heads, ``w`` mask units (windows), ``t`` tokens in a window,
``s`` query stride, ``j`` pooled queries, ``d`` head dim, ``l`` label channels.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange, reduce
from timm.models.hiera import Hiera, HieraBlock, MaskUnitAttention
from torch import Tensor, nn

from mixlabels.backbones._attention import attention_with_labels
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import AdaptedBase, branch, explicit_mix, mix_token_space, start_on_convs
from mixlabels.backbones._dense import DenseRules, conv_matrix
from mixlabels.backbones._dense import drop_path_reference as _drop
from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap, TokenLayout
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._fsdp import through_hooks

__all__ = ["AdaptedHiera", "HIERA_FAMILY"]

HIERA_FAMILY = (
    "timm Hiera (2-D, image classification): mask-unit and global attention on unrolled tokens (labels unrolled "
    "alike), query pooling and the max-pooled shortcut at stage transitions as aggregation, overlapping patch "
    "embedding as aggregation; absolute or windowed-absolute position embeddings; average pooling; stochastic depth"
)


def _hiera_refusal(model: nn.Module) -> str | None:
    if type(model) is not Hiera:
        return f"{type(model).__name__} is not a timm Hiera"
    m: Any = model
    if m.head.pool_type != "avg":
        return f"global_pool={m.head.pool_type!r} has no label readout; use 'avg'"
    proj = m.patch_embed.proj
    if type(proj) is not nn.Conv2d or isinstance(proj.padding, str) or proj.padding_mode != "zeros" or proj.groups != 1:
        return "the patch embedding must be a 2-D nn.Conv2d with static zero padding (video Hiera is not supported)"
    if m.pos_embed_spatial is not None:
        return "sep_pos_embed (the video variant's separate position embeddings) is not supported"
    if m.patch_drop_rate > 0:
        return f"patch_drop_rate={m.patch_drop_rate} drops random mask units in training; use patch_drop_rate=0"
    for i, blk in enumerate(m.blocks):
        if type(blk) is not HieraBlock or type(blk.attn) is not MaskUnitAttention:
            return f"block {i} is not a HieraBlock with MaskUnitAttention"
    return None


def _windows(attn: Any, n: int) -> int:
    return n // (attn.q_stride * attn.window_size) if attn.use_mask_unit_attn else 1


def _qkv(attn: Any, x: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """q (max-pooled over the query stride), k, v as ``(b w, h, t, d)`` batches of windows, and ``w``."""
    nw = _windows(attn, x.shape[1])
    q, k, v = rearrange(attn.qkv(x), "b (t w) (three h d) -> three (b w) h t d", w=nw, three=3, h=attn.heads)
    if attn.q_stride > 1:  # timm's max pool over the unrolled stride
        q = reduce(q, "bw h (s j) d -> bw h j d", "max", s=attn.q_stride)
    return q, k, v, nw


def _attention(attn: Any, x: Tensor, labels: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """timm's ``MaskUnitAttention`` ``(b, n, c) -> (b, n / q_stride, c)``, and ``mean_h(A_h) Y`` per window."""
    q, k, v, nw = _qkv(attn, x)
    y = None if labels is None else rearrange(labels, "b (t w) l -> (b w) t l", w=nw)
    mixed = None
    if not attn.fused_attn:
        a = ((q * attn.scale) @ k.transpose(-1, -2)).softmax(dim=-1)
        out = a @ v
        if y is not None:
            mixed = explicit_mix(a, y)
    elif y is not None:
        out, mixed = attention_with_labels(q, k, v, y, attn.scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v)
    out = attn.proj(rearrange(out, "(b w) h j d -> b (j w) (h d)", w=nw))
    return out, (None if mixed is None else rearrange(mixed, "(b w) j l -> b (j w) l", w=nw))


def _shortcut(blk: Any, x: Tensor, x_norm: Tensor) -> Tensor:
    """timm's ``HieraBlock`` shortcut: at a stage transition, max-pooled (after ``proj``, or max and mean concatenated)."""
    if not blk.do_expand:
        return x
    s = blk.attn.q_stride
    if blk.proj is not None:
        return blk.proj(x_norm).view(x.shape[0], s, -1, blk.dim_out).amax(dim=1)  # type: ignore[no-any-return]
    pooled = x.view(x.shape[0], s, -1, x.shape[-1])
    return torch.cat([pooled.amax(dim=1), pooled.mean(dim=1)], dim=-1)


def _embed(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int], tuple[int, int]]:
    """Unrolled patch tokens ``(b, n, c)`` with position embeddings, the patch grid, and the grid labels start on."""
    proj = m.patch_embed.proj
    grid = check_batch(images, label_map, tuple(proj.stride))
    if list(grid) != list(m.unroll.size):
        raise ValueError(f"this Hiera was built for a {tuple(m.unroll.size)} patch grid, not {grid}: use its img_size")
    x = proj(images)
    start = (label_map.image_size[0], label_map.image_size[1])
    if label_map.token_space:
        x, start = mix_token_space(x, label_map, channels_last=False), grid
    x = m._pos_embed(rearrange(x, "b c h w -> b (h w) c"))
    return m.unroll(x), grid, start


def _token_logits(m: Any, x: Tensor) -> Tensor:
    """The head on every token ``(b, n, classes)``: norm per token, pre-logits, dropout, fc."""
    head = m.head
    return head.fc(head.drop(head.pre_logits(head.norm(x))))  # type: ignore[no-any-return]


class AdaptedHiera(AdaptedBase):
    """A timm Hiera returning the scheme's aligned targets."""

    family = HIERA_FAMILY
    refusal = staticmethod(_hiera_refusal)

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        tracker = start_on_convs(self.scheme, label_map, start, grid, len(m.blocks), [m.patch_embed.proj])
        tracker.aggregate(m.unroll, normalised=True)  # a permutation: labels follow the tokens, rows unchanged
        for layer, blk in enumerate(m.blocks):
            x = through_hooks(blk, functools.partial(self._block, blk, layer=layer, tracker=tracker), x)
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        return tuple(self.model.blocks)  # type: ignore[arg-type]  # timm is untyped

    @staticmethod
    def _block(blk: Any, x: Tensor, layer: int, tracker: LabelTracker) -> Tensor:
        x_norm = blk.norm1(x)
        shortcut = _shortcut(blk, x, x_norm)
        out, mixed = _attention(blk.attn, x_norm, tracker.labels_for(layer))
        s = blk.attn.q_stride
        if s > 1:  # the shortcut's max pool over the unrolled stride: its tokens' labels merged, by their mean (the
            # renormalised sum, in one operator instead of four)
            tracker.aggregate(lambda y: reduce(y, "b (s n) l -> b n l", "mean", s=s), normalised=True)
        out, keep = branch(blk.drop_path1, blk.ls1(out))
        tracker.residual(layer, keep, mixed=mixed)
        x = shortcut + out
        out, keep = branch(blk.drop_path2, blk.ls2(blk.mlp(blk.norm2(x))))
        tracker.residual(layer, keep, mixed=None)  # channel mixing
        return x + out

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """timm's blocks' modules for the output; explicit attention, pooling and permutation matrices on dense labels."""
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        rules = DenseRules(self.scheme, label_map, start, 0, len(m.blocks))
        if start != grid:
            proj = m.patch_embed.proj
            rules.aggregate(conv_matrix(start, torch.ones(proj.kernel_size), proj.stride, proj.padding)[0])
        n = grid[0] * grid[1]
        order = m.unroll(torch.arange(n, dtype=torch.float64).view(1, n, 1)).view(n).long()
        rules.aggregate(torch.eye(n, dtype=torch.float64)[order])  # row i takes token order[i]
        for layer, blk in enumerate(m.blocks):
            attn, n = blk.attn, x.shape[1]
            x_norm = blk.norm1(x)
            shortcut = _shortcut(blk, x, x_norm)
            out = attn(x_norm)  # timm's own attention
            mixed = _attention_matrix(attn, x_norm) @ rules.y
            s = attn.q_stride
            if s > 1:
                rules.aggregate(torch.eye(n // s, dtype=torch.float64).repeat(1, s))  # token i sums i, i + n/s, ...
            out, keep = _drop(blk.drop_path1, blk.ls1(out))
            if rules.rules.wants_labels(layer):  # the branch maps the tokens to the pooled ones
                rules.y = rules.rules.residual(rules.y, mixed, keep)
            x = shortcut + out
            x = x + _drop(blk.drop_path2, blk.ls2(blk.mlp(blk.norm2(x))))[0]
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        return rules.result(output, output, "mean", token_logits)


def _attention_matrix(attn: Any, x: Tensor) -> Tensor:
    """``mean_h(A_h)`` as one ``(b, n / q_stride, n)`` matrix: query ``j * nw + w`` over keys ``t * nw + w``."""
    b, n = x.shape[0], x.shape[1]
    with torch.no_grad():
        q, k, _, nw = _qkv(attn, x)
        a = ((q.double() * attn.scale) @ k.double().transpose(-1, -2)).softmax(dim=-1).mean(dim=1)  # (b w) j t
    a = rearrange(a, "(b w) j t -> b w j t", b=b)
    nq, nk = a.shape[2], a.shape[3]
    rows = torch.arange(nq)[None, :, None] * nw + torch.arange(nw)[:, None, None]  # w j 1
    cols = torch.arange(nk)[None, None, :] * nw + torch.arange(nw)[:, None, None]  # w 1 t
    matrix = torch.zeros(b, n // attn.q_stride, n, dtype=torch.float64)
    matrix[:, rows.expand(nw, nq, nk), cols.expand(nw, nq, nk)] = a
    return matrix


FAMILY = Family(
    name="hiera",
    description=HIERA_FAMILY,
    refusal=AdaptedHiera.refusal,
    build=AdaptedHiera,
    example=tiny("hiera_tiny_224", img_size=32, embed_dim=16, num_heads=1, stages=(1, 1, 1), q_pool=2, mask_unit_size=(4, 4),
        mask_unit_attn=(True, True, False)),
    timm_modules=("hiera",),
    speed_model="hiera_tiny_224",
)
