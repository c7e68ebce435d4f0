"""Adapter for timm's XCiT: cross-covariance attention, local patch interaction, then class attention.

TL-Align Table 10 and Appendix D extended by the same reasoning as for CaiT and ConvNeXt. The
class token joins only in the class-attention stage but carries a label from the start (the
image weights, as CaiT's), so the layout has one prefix token throughout. Events per layer
(``len(blocks)`` XCA blocks, then the class-attention ones):

- XCA: the softmax is over channels (a ``d x d`` cross-covariance per head), applied within
  every token: a channel op, ``residual(layer, keep, mixed=None)``;
- LPI: ``dwconv3x3 -> GELU -> BatchNorm -> dwconv3x3``: two spatial mixes in turn, each
  ``Norm(T(K)) Y`` with its channel-averaged normalised absolute kernel, border-renormalised
  (``backbones._convnet.apply_path``): ``residual(layer, keep, mixed=Norm(T(K2)) Norm(T(K1)) Y)``
  on the patch rows (the class token is not in the stream yet);
- MLP: ``residual(layer, keep, mixed=None)``;
- class attention: only the class token moves: its head-mean attention row over
  ``[cls; patches]`` applied to the labels (fused into the attention call when timm fuses);
  the patch tokens add their own normalised features (``x + gamma1 * norm1(x)``) and
  themselves again in the MLP residual: channel ops; ``class_attention`` in TransMix's layer;
- the convolutional patch embedding (stride-2 3x3 convs with BatchNorm, 8 or 16 px in all):
  the labels start on its token grid, every token with the exact area fractions of its
  ``patch_size`` cell (the paper's patch-embedding rule; the stem's wider, overlapping
  receptive field is not followed, so that TransMix's area and the class token share the
  token grid); the Fourier positional encoding is added per position: a channel op;
- BatchNorms normalise each channel with statistics shared by all tokens: channel ops;
- readout: ``pool("token", 0)`` (or ``"mean"`` over the patches for ``global_pool='avg'``).

Shapes: ``b`` batch, ``h`` heads, ``n`` tokens, ``d`` head dim, ``c`` channels, ``l`` label channels.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.layers.mlp import Mlp
from timm.models.cait import ClassAttn
from timm.models.xcit import LPI, XCA, ClassAttentionBlock, ConvPatchEmbed, PositionalEncodingFourier, XCABlock, Xcit
from torch import Tensor, nn

from mixlabels.backbones._attention import attention_with_labels, class_attention
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import AdaptedBase, branch, check_static_conv, explicit_mix, stride_grid
from mixlabels.backbones._convnet import Kernels, apply_path, read_kernels
from mixlabels.backbones._dense import DenseRules, conv_matrix, kernel_reference, row_normalise
from mixlabels.backbones._dense import drop_path_reference as _drop
from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap, TokenLayout
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._fsdp import through_hooks

__all__ = ["AdaptedXCiT", "XCIT_FAMILY"]

XCIT_FAMILY = (
    "timm Xcit (cross-covariance attention as a channel op, LPI's two depthwise convs as spatial mixes in turn, "
    "class-attention layers moving only the class token; labels start on the patch grid; Fourier positional "
    "encoding; 'token' or 'avg' readout; layer scale; stochastic depth)"
)


def _xcit_refusal(model: nn.Module) -> str | None:
    if type(model) is not Xcit:
        return f"{type(model).__name__} is not a timm Xcit"
    m: Any = model
    if m.global_pool not in ("token", "avg"):
        return f"global_pool={m.global_pool!r} has no label readout; use 'token' or 'avg'"
    if m.global_pool == "token" and not len(m.cls_attn_blocks):
        return "an Xcit without class-attention layers (cls_attn_layers=0) never lets its class token attend; use global_pool='avg'"
    if type(m.patch_embed) is not ConvPatchEmbed:
        return f"the patch embedding is {type(m.patch_embed).__name__}, not timm's ConvPatchEmbed"
    if m.pos_embed is not None and type(m.pos_embed) is not PositionalEncodingFourier:
        return f"the positional encoding is {type(m.pos_embed).__name__}, not timm's PositionalEncodingFourier"
    for i, blk in enumerate(m.blocks):
        if type(blk) is not XCABlock or type(blk.attn) is not XCA or type(blk.local_mp) is not LPI or type(blk.mlp) is not Mlp:
            return f"block {i} is not timm's XCABlock with XCA, LPI and Mlp"
        for name in ("conv1", "conv2"):
            why = check_static_conv(getattr(blk.local_mp, name), f"block {i}'s LPI {name}", depthwise=True)
            if why is not None:
                return why
    for i, blk in enumerate(m.cls_attn_blocks):
        if type(blk) is not ClassAttentionBlock or type(blk.attn) is not ClassAttn:
            return f"class-attention block {i} is not timm's xcit ClassAttentionBlock with ClassAttn"
    return None


def _embed(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int]]:
    """timm's ``forward_features`` up to the XCA blocks: tokens ``(b, n, c)`` and their grid."""
    p = m.patch_embed.patch_size
    grid = check_batch(images, label_map, (p, p))
    x, size = m.patch_embed(images)
    if tuple(size) != grid:
        raise ValueError(f"the patch embedding made a {tuple(size)} grid, not {grid}; use an image size divisible by {p}")
    if label_map.token_space:
        x = label_map.mix_tokens(x, grid)
    if m.pos_embed is not None:
        x = x + rearrange(m.pos_embed(x.shape[0], grid[0], grid[1]), "b c h w -> b (h w) c")
    return m.pos_drop(x), grid


def _lpi_mix(lpi: Any, labels: Tensor, grid: tuple[int, int], kernels: Kernels | None) -> Tensor:
    """Patch labels through LPI's two depthwise convs, one after the other ``(b, n, l)``: both on one layout view
    (``apply_path``), their label kernels and in-grid tap weights read from ``kernels`` (every block's, computed
    together; ``None``: this block's two, under FSDP2's per-block sharding)."""
    return apply_path((lpi.conv1, lpi.conv2), labels, grid, kernels)[0]


def _lpi_matrix(lpi: Any, grid: tuple[int, int]) -> Tensor:
    """``Norm(T(K2)) Norm(T(K1))`` ``(n, n)`` float64 written out."""
    matrix = torch.eye(grid[0] * grid[1], dtype=torch.float64)
    for conv in (lpi.conv1, lpi.conv2):
        kernel = kernel_reference(conv.weight)
        matrix = row_normalise(conv_matrix(grid, kernel, padding=conv.padding, dilation=conv.dilation)[0]) @ matrix
    return matrix


def _gamma(g: Any, x: Tensor) -> Tensor:
    return g * x  # type: ignore[no-any-return]


def _class_qkv(attn: Any, u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    q = rearrange(attn.q(u[:, :1]), "b 1 (h d) -> b h 1 d", h=attn.num_heads)
    k = rearrange(attn.k(u), "b n (h d) -> b h n d", h=attn.num_heads)
    v = rearrange(attn.v(u), "b n (h d) -> b h n d", h=attn.num_heads)
    return q, k, v


def _class_block_rest(blk: Any, x: Tensor, branch1: Tensor) -> tuple[Tensor, Tensor | None]:
    """timm's ``ClassAttentionBlock.forward`` after the attention branch ``branch1`` (drop-path
    applied): ``(x, keep of the MLP branch)``."""
    x = x + branch1
    if blk.tokens_norm:
        x = blk.norm2(x)
    else:
        x = torch.cat([blk.norm2(x[:, :1]), x[:, 1:]], dim=1)
    cls = _gamma(blk.gamma2, blk.mlp(x[:, :1]))
    out, keep = branch(blk.drop_path2, torch.cat([cls, x[:, 1:]], dim=1))
    return x + out, keep


def _head(m: Any, x: Tensor, token_logits: bool) -> tuple[Tensor, Tensor | None]:
    output = m.forward_head(x)
    return output, (m.head(m.head_drop(x[:, 1:])) if token_logits else None)


class AdaptedXCiT(AdaptedBase):
    """A timm XCiT whose forward also returns the scheme's aligned targets."""

    family = XCIT_FAMILY
    refusal = staticmethod(_xcit_refusal)

    def reference_grid(self, label_map: TokenLabelMap) -> tuple[int, int]:
        """The reference's labels start on the patch grid (see ``AdaptedBase.reference_bytes``)."""
        m: Any = self.model
        return stride_grid(label_map, int(m.patch_embed.patch_size))

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid = _embed(m, images, label_map)
        depth = len(m.blocks) + len(m.cls_attn_blocks)
        reads_token = m.global_pool == "token"
        tracker = self.scheme.start(label_map, TokenLayout(grid=grid, num_prefix=1, depth=depth, class_token=reads_token))
        kernels = read_kernels(list(m.blocks), tracker, lambda blk: (blk.local_mp.conv1, blk.local_mp.conv2))
        for layer, blk in enumerate(m.blocks):
            step = functools.partial(self._xca_block, blk, layer=layer, tracker=tracker, grid=grid, kernels=kernels)
            x = through_hooks(blk, step, x)
        x = torch.cat((m.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        for i, blk in enumerate(m.cls_attn_blocks):
            step = functools.partial(self._class_attention_block, blk, layer=len(m.blocks) + i, tracker=tracker)
            x = through_hooks(blk, step, x)
        x = m.norm(x)
        tracker.pool("token", 0) if reads_token else tracker.pool("mean", 1)
        output, token_logits = _head(m, x, self.scheme.needs_token_logits)
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        m: Any = self.model
        return (*m.blocks, *m.cls_attn_blocks)

    def _xca_block(
        self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker, grid: tuple[int, int], kernels: Kernels | None
    ) -> Tensor:
        out, keep = branch(blk.drop_path1, _gamma(blk.gamma1, blk.attn(blk.norm1(x))))
        tracker.residual(layer, keep, mixed=None)  # XCA mixes channels within each token
        x = x + out
        out, keep = branch(blk.drop_path3, _gamma(blk.gamma3, blk.local_mp(blk.norm3(x), grid[0], grid[1])))
        y, mixed = tracker.labels_for(layer), None
        if y is not None:  # the class token is not in the stream yet: its row stays
            mixed = torch.cat((y[:, :1], _lpi_mix(blk.local_mp, y[:, 1:], grid, kernels)), dim=1)
        tracker.residual(layer, keep, mixed=mixed)
        x = x + out
        out, keep = branch(blk.drop_path2, _gamma(blk.gamma2, blk.mlp(blk.norm2(x))))
        tracker.residual(layer, keep, mixed=None)
        return x + out

    def _class_attention_block(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker) -> Tensor:
        attn = blk.attn
        u = blk.norm1(x)  # b (1 + n) c
        q, k, v = _class_qkv(attn, u)
        if tracker.wants_class_attention(layer):
            tracker.class_attention(layer, class_attention(q, k, attn.scale))  # b (1 + n)
        y, mixed = tracker.labels_for(layer), None
        if attn.fused_attn:
            dropout_p = attn.attn_drop.p if attn.training else 0.0
            if y is not None:
                out, mixed = attention_with_labels(q, k, v, y, attn.scale, dropout_p)  # b 1 l
            else:
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        else:
            a = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)  # b h 1 n
            if y is not None:
                mixed = explicit_mix(a, y)
            out = attn.attn_drop(a) @ v
        if y is not None and mixed is not None:
            mixed = torch.cat((mixed, y[:, 1:]), dim=1)  # only the class token moves
        cls_out = attn.proj_drop(attn.proj(rearrange(out, "b h 1 d -> b 1 (h d)")))
        drawn = branch(blk.drop_path1, _gamma(blk.gamma1, torch.cat([cls_out, u[:, 1:]], dim=1)))
        tracker.residual(layer, drawn[1], mixed=mixed)
        x, keep = _class_block_rest(blk, x, drawn[0])
        tracker.residual(layer, keep, mixed=None)
        return x

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit ``(b|1, 1 + n, 1 + n)`` label matrices per layer on dense labels."""
        m: Any = self.model
        x, grid = _embed(m, images, label_map)
        n = grid[0] * grid[1]
        depth = len(m.blocks) + len(m.cls_attn_blocks)
        rules = DenseRules(self.scheme, label_map, grid, 1, depth, class_token=m.global_pool == "token")
        eye = torch.eye(1 + n, dtype=torch.float64).expand(x.shape[0], -1, -1)
        for layer, blk in enumerate(m.blocks):
            x = x + _drop(blk.drop_path1, _gamma(blk.gamma1, blk.attn(blk.norm1(x))))[0]
            out, keep = _drop(blk.drop_path3, _gamma(blk.gamma3, blk.local_mp(blk.norm3(x), grid[0], grid[1])))
            matrix = torch.eye(1 + n, dtype=torch.float64)
            matrix[1:, 1:] = _lpi_matrix(blk.local_mp, grid)
            rules.mix(layer, matrix.unsqueeze(0), keep)
            x = x + out
            x = x + _drop(blk.drop_path2, _gamma(blk.gamma2, blk.mlp(blk.norm2(x))))[0]
        x = torch.cat((m.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        for i, blk in enumerate(m.cls_attn_blocks):
            attn, layer = blk.attn, len(m.blocks) + i
            u = blk.norm1(x)
            q, k, v = _class_qkv(attn, u)
            a = torch.softmax(q @ k.transpose(-2, -1) * attn.scale, dim=-1)  # b h 1 (1 + n)
            row = a.detach().double().mean(dim=1)[:, 0]  # b (1 + n)
            if rules.wants_class_attention(layer):
                rules.attend_class(row)
            matrix = eye.clone()
            matrix[:, 0] = row
            cls_out = attn.proj_drop(attn.proj(rearrange(F.dropout(a, attn.attn_drop.p, attn.training) @ v, "b h 1 d -> b 1 (h d)")))
            drawn = _drop(blk.drop_path1, _gamma(blk.gamma1, torch.cat([cls_out, u[:, 1:]], dim=1)))
            rules.mix(layer, matrix, drawn[1])
            x, _ = _class_block_rest(blk, x, drawn[0])
        x = m.norm(x)
        output, token_logits = _head(m, x, self.scheme.needs_token_logits)
        return rules.result(output, output, "token" if m.global_pool == "token" else "mean", token_logits)


FAMILY = Family(
    name="xcit",
    description=XCIT_FAMILY,
    refusal=AdaptedXCiT.refusal,
    build=AdaptedXCiT,
    example=tiny("xcit_nano_12_p8_224", img_size=32, embed_dim=32, depth=2, num_heads=2, cls_attn_layers=1),
    timm_modules=("xcit",),
    speed_model="xcit_nano_12_p16_224",
    class_token=True,
)
