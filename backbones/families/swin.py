"""Adapter for timm's SwinTransformer (v1): window attention, shifted windows, patch merging.

Events per block ``layer`` (blocks counted over all stages):

- window attention: ``residual(layer, keep, mixed=mean_h(A_h) Y)`` with ``Y =
  labels_for(layer)`` and the mix computed inside every window, where ``A_h`` includes
  timm's relative position bias and, in shifted blocks, the shift mask; the labels are
  cyclically shifted and partitioned exactly like the tokens and shifted back, so
  ``mixed`` is in the stream's layout (``mixed=None`` when ``labels_for`` is ``None``);
- MLP: ``residual(layer, keep, mixed=None)`` (channel mixing);
- patch merging (start of stages 1..): ``aggregate`` summing every 2x2 group of labels;
- readout: ``pool("mean", 0)`` (global average pooling, no class token: TransMix refuses).

Shapes: ``b`` batch, ``h w`` token grid, ``nh nw`` windows, ``wh ww`` window size,
``n`` tokens in a window, ``c`` channels, ``l`` label channels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from timm.layers.classifier import ClassifierHead
from timm.models.swin_transformer import PatchMerging, SwinTransformer, SwinTransformerBlock, WindowAttention
from torch import Tensor, nn

from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._attention import attention_with_labels
from mixlabels.backbones._common import AdaptedBase, branch, explicit_mix, mix_token_space, mean_pool_merge, stride_grid
from mixlabels.backbones._dense import DenseRules, conv_matrix, drop_path_reference as _drop, window_matrix
from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap, TokenLayout
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._fsdp import through_hooks

__all__ = ["AdaptedSwin", "SWIN_FAMILY", "check_window_grids", "shifted_windows", "window_ids", "Attend"]

SWIN_FAMILY = (
    "timm SwinTransformer v1 (window attention with relative position bias and shift mask, patch merging, "
    "global average pooling; every stage's grid divisible by its window; stochastic depth)"
)

WINDOWS = "(b nh nw) (wh ww)"


def _swin_refusal(model: nn.Module) -> str | None:
    if type(model) is not SwinTransformer:
        return f"{type(model).__name__} is not a timm SwinTransformer (v1)"
    m: Any = model
    if m.global_pool != "avg" or not isinstance(m.head, ClassifierHead):
        return f"global_pool={m.global_pool!r} has no label readout; use 'avg'"
    for i, stage in enumerate(m.layers):
        if not isinstance(stage.downsample, (PatchMerging, nn.Identity)):
            return f"stage {i} downsamples with {type(stage.downsample).__name__}, not PatchMerging"
        for blk in stage.blocks:
            if type(blk) is not SwinTransformerBlock or type(blk.attn) is not WindowAttention:
                return f"stage {i} has {type(blk).__name__}; only timm's SwinTransformerBlock is supported"
    return None


def _window_grids(model: Any, grid: tuple[int, int]) -> None:
    check_window_grids(model.layers, grid, PatchMerging)


def check_window_grids(stages: Any, grid: tuple[int, int], merging: type[nn.Module]) -> None:
    """Refuse grids the windows or merges would pad: padded tokens have no labels.

    ``stages``: modules with ``downsample`` (a ``merging`` 2x2 merge or not) and ``blocks``
    (each with ``window_size``), as timm's Swin v1 and v2 stages.
    """
    h, w = grid
    for i, stage in enumerate(stages):
        if isinstance(stage.downsample, merging):
            if h % 2 or w % 2:
                raise ValueError(f"stage {i} merges a {h}x{w} grid with padding; use an image size whose grids stay even")
            h, w = h // 2, w // 2
        for blk in stage.blocks:
            wh, ww = blk.window_size
            if h % wh or w % ww:
                raise ValueError(
                    f"stage {i}'s {h}x{w} grid is not divisible by its {wh}x{ww} windows: timm would pad with "
                    "tokens that carry no label; pick an image size (or window size) that tiles every stage"
                )


# (windows (b nW, n, c), their labels (b nW, n, l) or None) -> (output (b nW, n, c), mixed labels or None)
Attend = Callable[[Tensor, Tensor | None], tuple[Tensor, Tensor | None]]


def shifted_windows(
    x: Tensor, aligned: Tensor | None, window: tuple[int, int], shift: tuple[int, int], attend: Attend
) -> tuple[Tensor, Tensor | None]:
    """Cyclic shift, window partition, ``attend``, and back, for tokens ``(b, h, w, c)`` and their labels.

    The labels ``(b, h*w, l)`` (``None``: this layer is not aligned) move with the tokens: same
    shift, same windows; the mixed labels come back in the stream's layout ``(b, h*w, l)``.
    """
    b, h, w, _ = x.shape
    (wh, ww), back = window, (-shift[0], -shift[1])
    shifted = torch.roll(x, shifts=back, dims=(1, 2)) if any(shift) else x
    windows = rearrange(shifted, f"b (nh wh) (nw ww) c -> {WINDOWS} c", wh=wh, ww=ww)
    labels = None
    if aligned is not None:
        y = rearrange(aligned, "b (h w) l -> b h w l", h=h)
        y = torch.roll(y, shifts=back, dims=(1, 2)) if any(shift) else y
        labels = rearrange(y, f"b (nh wh) (nw ww) l -> {WINDOWS} l", wh=wh, ww=ww)
    out, mixed = attend(windows, labels)
    if mixed is not None:
        y = rearrange(mixed, f"{WINDOWS} l -> b (nh wh) (nw ww) l", b=b, nh=h // wh, wh=wh)
        y = torch.roll(y, shifts=shift, dims=(1, 2)) if any(shift) else y
        mixed = rearrange(y, "b h w l -> b (h w) l")
    out = rearrange(out, f"{WINDOWS} c -> b (nh wh) (nw ww) c", b=b, nh=h // wh, wh=wh)
    return (torch.roll(out, shifts=shift, dims=(1, 2)) if any(shift) else out), mixed


def window_ids(grid: tuple[int, int], window: tuple[int, int], shift: tuple[int, int]) -> Tensor:
    """``(nW, wh*ww)``: the original token id of every row of every shifted window (the reference's scatter index)."""
    h, w = grid
    ids = torch.roll(torch.arange(h * w).view(1, h, w, 1), shifts=(-shift[0], -shift[1]), dims=(1, 2))
    return rearrange(ids, "1 (nh wh) (nw ww) 1 -> (nh nw) (wh ww)", wh=window[0], ww=window[1])


class AdaptedSwin(AdaptedBase):
    """A timm Swin (v1) whose forward also returns the scheme's aligned targets (pooled readout)."""

    family = SWIN_FAMILY
    refusal = staticmethod(_swin_refusal)
    merging: type[nn.Module] = PatchMerging  # the stages' 2x2 merge (Swin V2 has its own class)

    def reference_grid(self, label_map: TokenLabelMap) -> tuple[int, int]:
        """The reference's labels start on the patch grid (see ``AdaptedBase.reference_bytes``)."""
        m: Any = self.model
        return stride_grid(label_map, tuple(m.patch_embed.patch_size))

    # ------------------------------------------------------------------ fast path
    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        grid = check_batch(images, label_map, tuple(m.patch_embed.patch_size))
        check_window_grids(m.layers, grid, self.merging)
        x = m.patch_embed(images)  # b h w c
        if label_map.token_space:
            x = mix_token_space(x, label_map, channels_last=True)
        depth = sum(len(stage.blocks) for stage in m.layers)
        tracker = self.scheme.start(label_map, TokenLayout(grid=grid, num_prefix=0, depth=depth, class_token=False))
        layer = 0
        for stage in m.layers:
            if isinstance(stage.downsample, self.merging):  # concatenating 2x2 tokens: their labels add up
                merge, grid = mean_pool_merge(grid, (2, 2), (2, 2))
                tracker.aggregate(merge, normalised=True)
            x = stage.downsample(x)
            for blk in stage.blocks:
                x = through_hooks(blk, functools.partial(self._block, blk, layer=layer, tracker=tracker), x)
                layer += 1
        x = m.norm(x)  # b h w c
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        token_logits = None
        if self.scheme.needs_token_logits:  # the classifier on every final token
            token_logits = m.head.fc(m.head.drop(rearrange(x, "b h w c -> b (h w) c")))
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        m: Any = self.model
        return tuple(blk for stage in m.layers for blk in stage.blocks)

    def _block(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker) -> Tensor:
        h = x.shape[1]
        out, mixed = self._shifted_window_attention(blk, blk.norm1(x), layer, tracker)
        out, keep = branch(blk.drop_path1, out)
        tracker.residual(layer, keep, mixed=mixed)
        x = rearrange(x + out, "b h w c -> b (h w) c")
        out, keep = branch(blk.drop_path2, blk.mlp(blk.norm2(x)))
        tracker.residual(layer, keep, mixed=None)  # channel mixing: labels unchanged
        return rearrange(x + out, "b (h w) c -> b h w c", h=h)

    def _shifted_window_attention(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker) -> tuple[Tensor, Tensor | None]:
        """The attention branch's output and, when the scheme aligns ``layer``, its mixed labels ``(b, n, l)``."""
        mask = blk.get_attn_mask(x) if blk.dynamic_mask else blk.attn_mask  # nW n n or None (x: only its shape)

        def attend(windows: Tensor, labels: Tensor | None) -> tuple[Tensor, Tensor | None]:
            return window_attention(blk.attn, windows, mask, labels)

        return shifted_windows(x, tracker.labels_for(layer), tuple(blk.window_size), tuple(blk.shift_size), attend)

    # ------------------------------------------------------------------ reference
    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit window attention scattered into one ``(b, n, n)`` matrix per block, dense labels."""
        m: Any = self.model
        grid = check_batch(images, label_map, tuple(m.patch_embed.patch_size))
        _window_grids(m, grid)
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
                (wh, ww), shift = blk.window_size, tuple(blk.shift_size)
                ids = window_ids((h, w), (wh, ww), shift)  # where each shifted window's rows come from
                windows = rearrange(blk.norm1(x).flatten(1, 2)[:, ids], "b nw n c -> (b nw) n c")
                attn = blk.attn
                q, k, v = rearrange(attn.qkv(windows), "b n (three h d) -> three b h n d", three=3, h=attn.num_heads)
                scores = (q * attn.scale) @ k.transpose(-2, -1) + attn._get_rel_pos_bias()
                mask = blk.get_attn_mask(torch.roll(x, (-shift[0], -shift[1]), (1, 2))) if blk.dynamic_mask else blk.attn_mask
                if mask is not None:
                    scores = scores + repeat(mask, "nw n m -> (b nw) 1 n m", b=b)
                a = scores.softmax(dim=-1)  # (b nw) h n n
                out = F.dropout(a, attn.attn_drop.p, attn.training) @ v
                out = attn.proj_drop(attn.proj(rearrange(out, "b h n d -> b n (h d)")))  # (b nw) n c
                tokens = out.new_zeros(b, h * w, c)
                tokens[:, ids.flatten()] = rearrange(out, "(b nw) n c -> b (nw n) c", b=b)
                attn_out, keep = _drop(blk.drop_path1, rearrange(tokens, "b (h w) c -> b h w c", h=h))
                mean = rearrange(a.detach().float().mean(dim=1), "(b nw) n m -> b nw n m", b=b)
                rules.mix(layer, window_matrix(mean, ids, h * w), keep)
                x = (x + attn_out).flatten(1, 2)
                x = (x + _drop(blk.drop_path2, blk.mlp(blk.norm2(x)))[0]).view(b, h, w, c)
                layer += 1
        x = m.norm(x)
        output = m.forward_head(x)
        token_logits = m.head.fc(m.head.drop(x.flatten(1, 2))) if self.scheme.needs_token_logits else None
        return rules.result(output, output, "mean", token_logits)


def window_attention(attn: Any, x: Tensor, mask: Tensor | None, labels: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """timm's ``WindowAttention.forward`` on windows ``(b nW, n, c)``, plus the mixed labels.

    Args:
        attn: the block's ``WindowAttention``.
        mask: ``(nW, n, n)`` 0/-100 shift mask or ``None``.
        labels: ``(b nW, n, l)`` window labels, or ``None`` when this layer is not aligned.

    Returns:
        The module's output ``(b nW, n, c)`` and ``mean_h(A_h) @ labels`` ``(b nW, n, l)`` (or ``None``).
    """
    q, k, v = rearrange(attn.qkv(x), "b n (three h d) -> three b h n d", three=3, h=attn.num_heads)
    bias = attn._get_rel_pos_bias()  # 1 h n n
    mixed = None
    if attn.fused_attn:
        attn_mask = bias
        if mask is not None:
            attn_mask = attn_mask + repeat(mask, "nw n m -> (b nw) h n m", b=x.shape[0] // mask.shape[0], h=attn.num_heads)
        dropout_p = attn.attn_drop.p if attn.training else 0.0
        if labels is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
        else:
            out, mixed = attention_with_labels(q, k, v, labels, attn.scale, dropout_p, attn_mask=attn_mask)
    else:  # timm's default for Swin: the window matrices exist anyway
        scores = (q * attn.scale) @ k.transpose(-2, -1) + bias
        if mask is not None:
            nw = mask.shape[0]
            scores = rearrange(scores, "(b nw) h n m -> b nw h n m", nw=nw) + rearrange(mask, "nw n m -> 1 nw 1 n m")
            scores = rearrange(scores, "b nw h n m -> (b nw) h n m")
        a = attn.softmax(scores)
        if labels is not None:
            mixed = explicit_mix(a, labels)
        out = attn.attn_drop(a) @ v
    out = rearrange(out, "b h n d -> b n (h d)")
    return attn.proj_drop(attn.proj(out)), mixed


FAMILY = Family(
    name="swin",
    description=SWIN_FAMILY,
    refusal=AdaptedSwin.refusal,
    build=AdaptedSwin,
    example=tiny("swin_tiny_patch4_window7_224", img_size=32, patch_size=4, window_size=4, embed_dim=16,
        depths=(2, 2), num_heads=(2, 2)),
    timm_modules=("swin_transformer",),
    speed_model="swin_tiny_patch4_window7_224",
)
