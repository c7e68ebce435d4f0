"""Adapter for timm's TNT (Transformer in Transformer): pixel tokens inside patches, patch tokens outside.

Labels live on one sequence ``[cls, patches (n), pixel tokens (n * m)]`` (pixel tokens patch by
patch, row-major inside each patch, as timm's ``pixel_embed`` holds them), started from the
mixed image's pixel labels:

- pixel tokens: ``PixelEmbed``'s strided conv (inside each patch, or over the whole image for
  ``legacy`` models before the unfold) aggregates: every token sums its window's labels,
  renormalised;
- patch tokens: the linear projection of a patch's pixel tokens aggregates them (their sum,
  renormalised: a patch's pixels weigh as often as the overlapping windows take them, as for
  PVT v2's overlapping patch embedding); the class token starts on the image target.

Both are separable, so the start is one ``aggregate`` from the pixels with per-axis matrices.
Every ``Block`` (one layer) then emits, in timm's order:

1. inner attention over each patch's ``m`` pixel tokens: their labels mix by the head-mean
   attention within the patch (Eq. 9), a residual. Stochastic depth draws here per patch
   (timm's ``DropPath`` on the ``(b * n, m, c)`` pixel batch): a patch whose branch dropped
   keeps its pixels' labels (the ``follow`` rule, written into the mixed labels, for every scheme);
2. the inner MLP: channel mixing;
3. ``patch += proj(norm(pixels of the patch))``: the patch token adds its pixels' content, a
   residual whose mixed labels are ``Norm(sum of the patch's pixel-token labels)``;
4. outer attention over ``[cls, patches]`` (head-mean attention, Eq. 9; TransMix reads the class
   token's row in the last block, spread back onto the pixels of each patch), then the MLP.

The readout (class token, or the patch mean for ``global_pool='avg'``) sees ``[cls, patches]``:
a last ``aggregate`` drops the pixel tokens, so token targets are the patch tokens'.

Shapes: ``b`` batch, ``n`` patches, ``m`` pixel tokens per patch, ``h w`` pixels, ``l`` label channels.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from einops import rearrange
from timm.layers.mlp import Mlp
from timm.models.tnt import TNT, Attention, Block, PixelEmbed
from torch import Tensor, nn

from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap, TokenLayout
from mixlabels._label_map import fp32_labels
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._windows import apply_separable
from mixlabels.backbones._common import AdaptedBase, branch
from mixlabels.backbones._dense import DenseRules, conv_matrix, drop_path_reference as _drop, row_normalise
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._fsdp import through_hooks

__all__ = ["AdaptedTNT", "TNT_FAMILY", "tnt_start_matrices"]

TNT_FAMILY = (
    "timm TNT (pixel tokens inside each patch: conv aggregate, inner attention mixing labels within the patch; "
    "patch tokens: their pixels' aggregate, then + their pixels' content (a residual), outer attention with "
    "the class token; legacy and current pixel embeddings; token or avg pooling; stochastic depth)"
)


def _tnt_refusal(model: nn.Module) -> str | None:
    if type(model) is not TNT:
        return f"{type(model).__name__} is not a timm TNT"
    m: Any = model
    if m.global_pool not in ("token", "avg"):
        return f"global_pool={m.global_pool!r} has no label readout; use 'token' or 'avg'"
    conv = m.pixel_embed.proj
    if type(m.pixel_embed) is not PixelEmbed or type(conv) is not nn.Conv2d or isinstance(conv.padding, str) or conv.groups != 1:
        return "the pixel embedding is not timm's PixelEmbed with a plain zero-padded nn.Conv2d"
    for i, blk in enumerate(m.blocks):
        if type(blk) is not Block or type(blk.attn_in) is not Attention or type(blk.attn_out) is not Attention:
            return f"block {i} is not timm's TNT Block with its Attention"
        if type(blk.mlp_in) is not Mlp or type(blk.mlp) is not Mlp:
            return f"block {i}'s MLPs are not timm Mlps (per-token channel mixing)"
    return None


def _axis(size: int, patch: int, conv: Any, a: int, legacy: bool, new_patch: int) -> tuple[Tensor, Tensor]:
    """Along one axis: ``(pixel tokens, pixels)`` and ``(patches, pixels)`` row-stochastic float64 matrices;
    pixel tokens ordered patch-major."""
    k, s, p = conv.kernel_size[a], conv.stride[a], conv.padding[a]

    def windows(length: int) -> Tensor:
        out = (length + 2 * p - k) // s + 1
        starts = torch.arange(out)[:, None] * s - p
        taps = torch.arange(length)[None, :]
        return row_normalise(((taps >= starts) & (taps < starts + k)).double())

    num = size // patch
    if legacy:  # the conv runs over the image, then the unfold takes new_patch x new_patch tokens per patch
        tokens = windows(size)[: num * new_patch]
    else:  # the conv runs inside every patch (zero padding at the patch border)
        tokens = torch.kron(torch.eye(num, dtype=torch.float64), windows(patch))
    per_patch = tokens.shape[0] // num
    patches = row_normalise(torch.kron(torch.eye(num, dtype=torch.float64), torch.ones(1, per_patch, dtype=torch.float64)) @ tokens)
    return tokens, patches


def tnt_start_matrices(m: Any, image_size: tuple[int, int]) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """``((T_h, T_w), (P_h, P_w))``: pixels to pixel tokens and to patch tokens, per axis, float64 row-stochastic."""
    pe = m.pixel_embed
    axes = [_axis(image_size[a], pe.patch_size[a], pe.proj, a, pe.legacy, pe.new_patch_size[a]) for a in (0, 1)]
    return (axes[0][0], axes[1][0]), (axes[0][1], axes[1][1])


def _embed(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, Tensor, tuple[int, int]]:
    """timm's pixel and patch embeddings (MixToken on the pixel embedding: both follow), and the patch grid."""
    grid = check_batch(images, label_map, tuple(m.pixel_embed.patch_size))
    b = images.shape[0]
    pixel = m.pixel_embed(images, m.pixel_pos)  # (b n) m c
    if label_map.token_space:  # a patch's pixel tokens move together, and its patch token is made from them
        mixed = label_map.mix_tokens(rearrange(pixel, "(b n) m c -> b n (m c)", b=b), grid)
        pixel = rearrange(mixed, "b n (m c) -> (b n) m c", m=pixel.shape[1])
    patch = m.norm2_proj(m.proj(m.norm1_proj(rearrange(pixel, "(b n) m c -> b n (m c)", b=b))))
    patch = torch.cat((m.cls_token.expand(b, -1, -1), patch), dim=1) + m.patch_pos
    return pixel, m.pos_drop(patch), grid


def _scores(attn: Any, x: Tensor) -> tuple[Tensor, Tensor]:
    """timm's TNT ``Attention``: the softmax matrix ``(b, h, n, n)`` and the values ``(b, h, n, d)``."""
    q, k = rearrange(attn.qk(x), "b n (two h d) -> two b h n d", two=2, h=attn.num_heads)
    v = rearrange(attn.v(x), "b n (h d) -> b h n d", h=attn.num_heads)
    return ((q @ k.transpose(-2, -1)) * attn.scale).softmax(dim=-1), v


def _attn_out(attn: Any, a: Tensor, v: Tensor) -> Tensor:
    return attn.proj_drop(attn.proj(rearrange(attn.attn_drop(a) @ v, "b h n d -> b n (h d)")))  # type: ignore[no-any-return]


def _pixels_to_patch(blk: Any, pixel: Tensor, b: int) -> Tensor:
    if blk.norm2_proj is None:  # legacy
        return blk.proj(rearrange(blk.norm1_proj(pixel), "(b n) m c -> b n (m c)", b=b))  # type: ignore[no-any-return]
    return blk.norm2_proj(blk.proj(blk.norm1_proj(rearrange(pixel, "(b n) m c -> b n (m c)", b=b))))  # type: ignore[no-any-return]


def _pixel_order(t: Tensor, grid: tuple[int, int]) -> Tensor:
    """Pixel-token labels from their 2-D layout ``(b, H', W', l)`` to timm's patch-major order ``(b, n*m, l)``."""
    return rearrange(t, "b (ph r) (pw c) l -> b (ph pw r c) l", ph=grid[0], pw=grid[1])


class AdaptedTNT(AdaptedBase):
    """A timm TNT returning the scheme's aligned targets (pixel and patch tokens on one label sequence)."""

    family = TNT_FAMILY
    refusal = staticmethod(_tnt_refusal)

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        pixel, patch, grid = _embed(m, images, label_map)
        size = (int(images.shape[-2]), int(images.shape[-1]))
        (th, tw), (ph, pw) = (tuple(t.to(label_map.device, torch.float32) for t in pair) for pair in tnt_start_matrices(m, size))
        n, per = grid[0] * grid[1], pixel.shape[1]
        tracker = self.scheme.start(label_map, TokenLayout(grid=size, num_prefix=1, depth=len(m.blocks), class_token=True))

        def start(y: Tensor) -> Tensor:
            # per-axis matrices, two matmuls each: a three-operand einsum here cost a tenth of the step
            patches = apply_separable(y[:, 1:], size, ph, pw)
            tokens = _pixel_order(rearrange(apply_separable(y[:, 1:], size, th, tw), "b (h w) l -> b h w l", h=th.shape[0]), grid)
            return torch.cat([y[:, :1], patches, tokens], dim=1)

        tracker.aggregate(start)
        for layer, blk in enumerate(m.blocks):
            step = functools.partial(self._block, blk, layer=layer, tracker=tracker, n=n, per=per, start=(ph, pw))
            pixel, patch = through_hooks(blk, step, pixel, patch)  # both token sets are the block's inputs
        patch = m.norm(patch)
        tracker.aggregate(lambda y: y[:, : 1 + n])  # the head reads [cls, patches]
        tracker.pool("token", 0) if m.global_pool == "token" else tracker.pool("mean", 1)
        output = m.forward_head(patch)
        token_logits = m.head(m.head_drop(patch[:, 1:])) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        m: Any = self.model
        return tuple(m.blocks)

    def _block(self, blk: Any, pixel: Tensor, patch: Tensor, layer: int, tracker: LabelTracker, n: int, per: int,
               start: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:  # fmt: skip
        b = patch.shape[0]
        y = tracker.labels_for(layer)
        a, v = _scores(blk.attn_in, blk.norm_in(pixel))  # (b n) h m m; labels read it before the in-place dropout
        mixed = None
        if y is not None:
            with fp32_labels(y.device):
                inner = a.detach().float().mean(dim=1) @ rearrange(y[:, 1 + n :], "b (n m) l -> (b n) m l", m=per)
        out, keep = branch(blk.drop_path, _attn_out(blk.attn_in, a, v))  # keep: per patch, (b n)
        if y is not None:
            own = rearrange(y[:, 1 + n :], "b (n m) l -> (b n) m l", m=per)
            inner = inner if keep is None else torch.where(keep.view(-1, 1, 1), inner, own)  # a dropped patch keeps its labels
            mixed = torch.cat([y[:, : 1 + n], rearrange(inner, "(b n) m l -> b (n m) l", b=b)], dim=1)
        tracker.residual(layer, None, mixed=mixed)
        pixel = pixel + out
        pixel = pixel + branch(blk.drop_path, blk.mlp_in(blk.norm_mlp_in(pixel)))[0]  # channel mixing
        y, mixed = tracker.labels_for(layer), None
        if y is not None:  # patch += its pixels' content: the patch rows get Norm(sum of its pixel-token labels)
            sums = rearrange(y[:, 1 + n :], "b (n m) l -> b n m l", m=per).sum(dim=2)
            mixed = torch.cat([y[:, :1], sums / sums.sum(dim=-1, keepdim=True), y[:, 1 + n :]], dim=1)
        tracker.residual(layer, None, mixed=mixed)
        patch = torch.cat([patch[:, :1], patch[:, 1:] + _pixels_to_patch(blk, pixel, b)], dim=1)
        a, v = _scores(blk.attn_out, blk.norm_out(patch))  # b h (1+n) (1+n)
        y, mixed = tracker.labels_for(layer), None
        mean = a.detach().float().mean(dim=1)
        if tracker.wants_class_attention(layer):
            tracker.class_attention(layer, self._pixel_row(mean[:, 0, 1:], start))
        if y is not None:
            with fp32_labels(y.device):
                mixed = torch.cat([mean @ y[:, : 1 + n], y[:, 1 + n :]], dim=1)
        out, keep = branch(blk.drop_path, _attn_out(blk.attn_out, a, v))
        tracker.residual(layer, keep, mixed=mixed)
        patch = patch + out
        out, keep = branch(blk.drop_path, blk.mlp(blk.norm_mlp(patch)))
        tracker.residual(layer, keep, mixed=None)  # channel mixing
        return pixel, patch + out

    @staticmethod
    def _pixel_row(row: Tensor, start: tuple[Tensor, Tensor]) -> Tensor:
        """The class token's row over the patches, renormalised, spread over each patch's pixels
        (``row @ (P_h (x) P_w)``), with a zero for the class token: ``(b, 1 + h*w)``."""
        ph, pw = start
        row = rearrange(row / row.sum(dim=-1, keepdim=True), "b (p q) -> b p q", p=ph.shape[0])
        pixels = rearrange(ph.T @ (row @ pw), "b h w -> b (h w)")  # two matmuls
        return torch.cat([pixels.new_zeros(pixels.shape[0], 1), pixels], dim=1)

    # ------------------------------------------------------------------------------------------ reference
    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit ``(N, N)`` matrices over the whole sequence; the start built in 2-D with ``conv_matrix``."""
        m: Any = self.model
        pixel, patch, grid = _embed(m, images, label_map)
        size = (int(images.shape[-2]), int(images.shape[-1]))
        b, n, per = patch.shape[0], grid[0] * grid[1], pixel.shape[1]
        total = 1 + n + n * per
        rules = DenseRules(self.scheme, label_map, size, 1, len(m.blocks), class_token=True)
        tokens, patches = self._start_2d(m, size, grid)
        merge = torch.zeros(total, 1 + size[0] * size[1], dtype=torch.float64)
        merge[0, 0] = 1.0
        merge[1 : 1 + n, 1:] = patches
        merge[1 + n :, 1:] = tokens
        rules.aggregate(merge)
        eye = torch.eye(total, dtype=torch.float64)
        for layer, blk in enumerate(m.blocks):
            a, v = _scores(blk.attn_in, blk.norm_in(pixel))
            inner = rearrange(a.detach().double().mean(dim=1), "(b n) i j -> b n i j", b=b)  # before the in-place dropout
            out, keep = _drop(blk.drop_path, _attn_out(blk.attn_in, a, v))
            matrix = eye.repeat(b, 1, 1)
            for i in range(n):
                rows = slice(1 + n + i * per, 1 + n + (i + 1) * per)
                kept = torch.ones(b, dtype=torch.bool) if keep is None else rearrange(keep, "(b n) -> b n", b=b)[:, i].cpu()
                matrix[kept, rows, rows] = inner[kept, i]
            rules.mix(layer, matrix, None)
            pixel = pixel + out
            pixel = pixel + _drop(blk.drop_path, blk.mlp_in(blk.norm_mlp_in(pixel)))[0]
            gather = eye.clone()
            for i in range(n):
                gather[1 + i] = 0.0
                gather[1 + i, 1 + n + i * per : 1 + n + (i + 1) * per] = 1.0 / per  # rows of the mix sum to 1
            rules.mix(layer, gather, None)
            patch = torch.cat([patch[:, :1], patch[:, 1:] + _pixels_to_patch(blk, pixel, b)], dim=1)
            a, v = _scores(blk.attn_out, blk.norm_out(patch))
            outer = a.detach().double().mean(dim=1)  # before the in-place dropout
            out, keep = _drop(blk.drop_path, _attn_out(blk.attn_out, a, v))
            matrix = eye.repeat(b, 1, 1)
            matrix[:, : 1 + n, : 1 + n] = outer
            rules.mix(layer, matrix, keep)
            if rules.wants_class_attention(layer):
                row = outer[:, 0, 1:]
                pixels = (row / row.sum(-1, keepdim=True)) @ patches
                rules.attend_class(torch.cat([pixels.new_zeros(b, 1), pixels], dim=1))
            patch = patch + out
            patch = patch + _drop(blk.drop_path, blk.mlp(blk.norm_mlp(patch)))[0]
        patch = m.norm(patch)
        rules.aggregate(eye[: 1 + n])
        output = m.forward_head(patch)
        token_logits = m.head(m.head_drop(patch[:, 1:])) if self.scheme.needs_token_logits else None
        if m.global_pool == "token":
            return rules.result(output, output, "token", token_logits)
        return rules.result(output, output, "mean", token_logits, first=1)

    @staticmethod
    def _start_2d(m: Any, size: tuple[int, int], grid: tuple[int, int]) -> tuple[Tensor, Tensor]:
        """``(pixel tokens, pixels)`` and ``(patches, pixels)`` matrices written out in 2-D (patch-major tokens)."""
        pe = m.pixel_embed
        conv, kernel = pe.proj, torch.ones(pe.proj.kernel_size)
        if pe.legacy:
            windows, out = conv_matrix(size, kernel, conv.stride, conv.padding)  # over the whole image
            crop = (grid[0] * pe.new_patch_size[0], grid[1] * pe.new_patch_size[1])
            keep = rearrange(torch.arange(out[0] * out[1]), "(h w) -> h w", h=out[0])[: crop[0], : crop[1]]
            tokens = row_normalise(windows)[_pixel_order(keep[None, :, :, None], grid).flatten()]
        else:
            inside, _ = conv_matrix(tuple(pe.patch_size), kernel, conv.stride, conv.padding)  # within one patch
            inside = row_normalise(inside)
            ids = rearrange(torch.arange(size[0] * size[1]), "(ph r pw c) -> (ph pw) (r c)", ph=grid[0], pw=grid[1],
                            r=pe.patch_size[0])  # fmt: skip
            tokens = torch.zeros(grid[0] * grid[1] * inside.shape[0], size[0] * size[1], dtype=torch.float64)
            for i in range(grid[0] * grid[1]):
                tokens[i * inside.shape[0] : (i + 1) * inside.shape[0], ids[i]] = inside
        per = tokens.shape[0] // (grid[0] * grid[1])
        patches = row_normalise(rearrange(tokens, "(n m) hw -> n m hw", m=per).sum(dim=1))
        return tokens, patches


FAMILY = Family(
    name="tnt",
    description=TNT_FAMILY,
    refusal=AdaptedTNT.refusal,
    build=AdaptedTNT,
    example=tiny(TNT, img_size=32, patch_size=8, embed_dim=32, inner_dim=8, depth=2, num_heads_inner=2,
        num_heads_outer=2),
    timm_modules=("tnt",),
    speed_model="tnt_s_patch16_224",
    class_token=True,
)
