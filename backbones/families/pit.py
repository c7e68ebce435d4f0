"""Adapter for timm's PiT (``PoolingVisionTransformer``, ``pit_*``): ViT stages joined by depthwise pooling.

Built on ``vit``: every stage's blocks are timm's ``Block`` with ``Attention``, run by ``AdaptedViT``'s block
(head-mean attention on the labels, the MLP a channel op, stochastic depth's keep) and, in the reference, by
``_vit_reference.reference_block``'s explicit matrices. Between stages PiT's ``Pooling`` and the embedding are
TL-Align's spatial aggregation (Table 10), the prefix tokens passing as in ``vit_hybrid`` (its ``_Patches`` view
and ``_with_prefix`` matrix). Events, ``layer`` counting the blocks over all stages:

- ``ConvEmbedding`` (a conv of kernel ``patch_size``, stride ``stride``: 16/8 or 14/7, overlapping): the patch
  labels start on the pixels summed over each conv window (``start_on_convs``: exact area fractions where the
  windows tile); the class (and distillation) tokens start with the image target. A MixToken map starts on the
  stem's grid, which must tile the image. The position embedding is added per position: no label moves.
- ``Pooling``: the patch grid through a strided depthwise conv (kernel ``stride + 1``, padding ``stride // 2``):
  ``aggregate`` sums each output position's in-grid window; the prefix tokens go through a linear layer (a
  channel op: their labels stay).
- readout: ``pool("token", 0)``: the head reads the class token. The distilled names (a distillation token,
  ``head_dist``) follow ``vit``'s DeiT: the target is the class token's label; in distilled training timm returns
  both heads and the logits are ``head``'s (the class token's). TransMix reads the class token's attention row
  over the patch grid of the stage it is in: the area weights of that grid's cells, which must tile the image.
- token labelling: ``head`` on every final patch token after the final norm (as ``vit``'s LV-ViT logits).

Shapes: ``b`` batch, ``c`` channels, ``h w`` the patch grid, ``n`` tokens, ``p`` prefix tokens, ``l`` labels.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from einops import rearrange
from timm.layers.attention import Attention
from timm.models.pit import ConvEmbedding, Pooling, PoolingVisionTransformer, Transformer
from timm.models.vision_transformer import Block
from torch import Tensor, nn

from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import check_static_conv, mix_token_space, start_on_convs, stride_grid
from mixlabels.backbones._convnet import Window, apply_path, merge_matrix, path_of, path_refusal
from mixlabels.backbones._dense import DenseRules, conv_matrix
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._fsdp import through_hooks
from mixlabels.backbones._vit_reference import reference_block
from mixlabels.backbones.families.vit import AdaptedViT
from mixlabels.backbones.families.vit_hybrid import _Patches, _with_prefix

__all__ = ["AdaptedPiT", "PIT_FAMILY", "pit_refusal"]

PIT_FAMILY = (
    "timm PoolingVisionTransformer (PiT, pit_*; distilled names with their distillation token): the overlapping "
    "conv patch embedding as aggregation from the pixels; ViT stages of timm Block + Attention (class token "
    "readout, TransMix where the stage's grid tiles the image); Pooling's strided depthwise conv as aggregation over "
    "its windows, its linear layer on the class tokens a channel op; stochastic depth"
)


def pit_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot be adapted as a PiT (``None`` if it can)."""
    if type(model) is not PoolingVisionTransformer:
        return f"{type(model).__name__} is not a timm PoolingVisionTransformer"
    m: Any = model
    if m.global_pool != "token":
        return f"global_pool={m.global_pool!r} has no label readout; use 'token' (the class token)"
    if type(m.patch_embed) is not ConvEmbedding:
        return f"patch_embed is {type(m.patch_embed).__name__}, not timm's ConvEmbedding"
    why = check_static_conv(m.patch_embed.conv, "patch_embed.conv")
    if why is None and m.patch_embed.conv.dilation != (1, 1):
        why = "patch_embed.conv is dilated; only undilated windows aggregate here"
    if why is not None:
        return why
    for i, stage in enumerate(m.transformers):
        if type(stage) is not Transformer:
            return f"stage {i} is {type(stage).__name__}, not timm's PiT Transformer"
        if not isinstance(stage.norm, (nn.Identity, nn.LayerNorm)):
            return f"stage {i}'s norm is {type(stage.norm).__name__}; only a per-token LayerNorm (or none) has a rule here"
        pool = stage.pool
        if pool is not None:
            if type(pool) is not Pooling or type(pool.fc) is not nn.Linear:
                return f"stage {i}'s pool is {type(pool).__name__}; only timm's Pooling (depthwise conv, linear) is supported"
            why = path_refusal([pool.conv], f"stage {i}'s Pooling")
            if why is not None:
                return why
            if pool.conv.stride == (1, 1):
                return f"stage {i}'s Pooling conv has stride 1; only a strided (aggregating) pooling conv is supported"
        for j, blk in enumerate(stage.blocks):
            if type(blk) is not Block or type(blk.attn) is not Attention:
                what = f"{type(blk).__name__} with {type(getattr(blk, 'attn', None)).__name__}"
                return f"stage {i} block {j} is {what}; only timm's Block with its Attention is supported"
    return None


def _pool_window(pool: Any) -> Window:
    """The windows of a ``Pooling``'s strided depthwise conv (``pit_refusal``: one strided window op)."""
    (op,) = path_of([pool.conv])
    assert isinstance(op, Window)
    return op


def _depth(m: Any) -> int:
    return sum(len(stage.blocks) for stage in m.transformers)


def _stage_layers(m: Any) -> list[range]:
    """The layers (block indices over all stages) of every stage."""
    out, first = [], 0
    for stage in m.transformers:
        out.append(range(first, first + len(stage.blocks)))
        first += len(stage.blocks)
    return out


def _check_tiles(m: Any, label_map: TokenLabelMap, grid: tuple[int, int], stage: int) -> None:
    """TransMix weighs the class row by its patches' areas: the stage's grid must tile the image in cells of its
    stride (the embedding's times every pooling's), else those patches have no exact area weights."""
    stride = int(m.patch_embed.conv.stride[0])
    for s in m.transformers[1 : stage + 1]:
        stride *= _pool_window(s.pool).stride[0] if s.pool is not None else 1
    hh, ww = label_map.image_size
    if (grid[0] * stride, grid[1] * stride) != (hh, ww):
        raise ValueError(
            f"the class attention of stage {stage} reads a {grid[0]}x{grid[1]} patch grid of {stride}-pixel strides, which "
            f"does not tile the {hh}x{ww} image, so its patches have no exact area weights for this scheme's target "
            f"(TransMix); use an image size whose grids tile it (e.g. the model's img_size of 224), or TLAlign()"
        )


class AdaptedPiT(AdaptedViT):
    """A timm PiT whose forward also returns the scheme's aligned targets (``adapted(images)`` is the model's)."""

    family = PIT_FAMILY
    refusal = staticmethod(pit_refusal)  # type: ignore[assignment]  # vit's takes the embedding's class too

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        m: Any = self.model
        return tuple(blk for stage in m.transformers for blk in stage.blocks)  # Pooling: the root's

    def reference_grid(self, label_map: TokenLabelMap) -> tuple[int, int]:
        """The reference's labels start on the pixels (the stem's grid for a token-space map)."""
        m: Any = self.model
        if label_map.token_space:
            return stride_grid(label_map, tuple(m.patch_embed.conv.stride))
        return label_map.image_size[0], label_map.image_size[1]

    def _embed(self, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int], tuple[int, int]]:
        """The embedded patches ``(b, c, h, w)`` with the position embedding, their grid, and the grid labels start on."""
        m: Any = self.model
        pixels = check_batch(images, label_map, tuple(m.patch_embed.conv.stride))
        x = m.patch_embed(images)
        grid = (int(x.shape[2]), int(x.shape[3]))
        if grid != tuple(m.pos_embed.shape[2:]):
            raise ValueError(
                f"{images.shape[-2]}x{images.shape[-1]} images give a {grid[0]}x{grid[1]} patch grid but the position "
                f"embedding is {m.pos_embed.shape[2]}x{m.pos_embed.shape[3]}; feed the model's img_size or create it with yours"
            )
        start = (label_map.image_size[0], label_map.image_size[1])
        if label_map.token_space:
            if pixels != grid:
                raise ValueError(
                    f"MixToken needs the patch embedding's {grid} grid to tile the image ({pixels} cells of its stride); "
                    "its windows overlap: mix the pixels instead (token_space=False)"
                )
            x, start = mix_token_space(x, label_map, channels_last=False), grid
        return m.pos_drop(x + m.pos_embed), grid, start

    def _class_attention_tiles(self, label_map: TokenLabelMap, wants: Any, grids: list[tuple[int, int]]) -> None:
        m: Any = self.model
        for i, layers in enumerate(_stage_layers(m)):
            if any(wants(layer) for layer in layers):
                _check_tiles(m, label_map, grids[i], i)

    def _grids(self, grid: tuple[int, int]) -> list[tuple[int, int]]:
        """Every stage's patch grid from the embedding's."""
        m: Any = self.model
        out = []
        for stage in m.transformers:
            if stage.pool is not None:
                grid = _pool_window(stage.pool).out_grid(grid)
            out.append(grid)
        return out

    def _head(self, cls: Tensor, x: Tensor) -> tuple[Any, Tensor, Tensor | None]:
        """timm's head on the class tokens (output, logits) and, for token labelling, ``head`` on every patch."""
        m: Any = self.model
        output = m.forward_head(m.norm(cls))  # a tensor, or (cls, dist) when training distilled
        logits = output[0] if isinstance(output, tuple) else output
        token_logits = None
        if self.scheme.needs_token_logits:
            token_logits = m.head(m.head_drop(m.norm(rearrange(x, "b c h w -> b (h w) c"))))  # b n classes
        return output, logits, token_logits

    # ------------------------------------------------------------------ fast path
    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid, start = self._embed(images, label_map)
        p = m.num_tokens
        tracker = start_on_convs(self.scheme, label_map, start, grid, _depth(m), [m.patch_embed.conv], p, class_token=True)
        self._class_attention_tiles(label_map, tracker.wants_class_attention, self._grids(grid))
        cls = m.cls_token.expand(x.shape[0], -1, -1)  # b p c
        layer = 0
        for stage in m.transformers:
            if stage.pool is not None:
                x, cls = stage.pool(x, cls)
                path, before = (_pool_window(stage.pool),), grid
                tracker.aggregate(lambda y: torch.cat([y[:, :p], apply_path(path, y[:, p:], before)[0]], dim=1))
                grid = (int(x.shape[2]), int(x.shape[3]))
            t = stage.norm(torch.cat((cls, rearrange(x, "b c h w -> b (h w) c")), dim=1))  # b (p + h w) c
            view: LabelTracker = _Patches(tracker, 0, grid)  # the class row over this stage's grid (TransMix)
            for blk in stage.blocks:
                t = through_hooks(blk, functools.partial(self._block, blk, layer=layer, tracker=view), t)
                layer += 1
            cls, x = t[:, :p], rearrange(t[:, p:], "b (h w) c -> b c h w", h=grid[0])
        tracker.pool("token", 0)
        output, logits, token_logits = self._head(cls, x)
        r = tracker.finish()
        return AlignedOutput(output, logits, r.target, r.weights, token_logits, r.token_target, r.token_loss_weight)

    # ------------------------------------------------------------------ reference
    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """timm's modules for the output; explicit window and attention matrices on dense labels."""
        m: Any = self.model
        x, grid, start = self._embed(images, label_map)
        p = m.num_tokens
        rules = DenseRules(self.scheme, label_map, start, p, _depth(m), class_token=True)
        self._class_attention_tiles(label_map, rules.wants_class_attention, self._grids(grid))
        if start != grid:
            conv = m.patch_embed.conv
            rules.aggregate(_with_prefix(conv_matrix(start, torch.ones(conv.kernel_size), conv.stride, conv.padding)[0], p))
        cls = m.cls_token.expand(x.shape[0], -1, -1)
        layer = 0
        for stage in m.transformers:
            if stage.pool is not None:
                merge, grid = merge_matrix(grid, _pool_window(stage.pool))
                rules.aggregate(_with_prefix(merge, p))
                x, cls = stage.pool(x, cls)
            t = stage.norm(torch.cat((cls, rearrange(x, "b c h w -> b (h w) c")), dim=1))
            for blk in stage.blocks:
                t = reference_block(blk, layer, t, rules, grid)
                layer += 1
            cls, x = t[:, :p], rearrange(t[:, p:], "b (h w) c -> b c h w", h=grid[0])
        output, logits, token_logits = self._head(cls, x)
        return rules.result(output, logits, "token", token_logits)


FAMILY = Family(
    name="pit",
    description=PIT_FAMILY,
    refusal=pit_refusal,
    build=AdaptedPiT,
    example=tiny("pit_ti_224", img_size=32, patch_size=4, stride=4, base_dims=(8, 8), depth=(1, 1), heads=(2, 4)),
    timm_modules=("pit",),
    speed_model="pit_ti_224",
    class_token=True,
)
