"""Adapter for timm's CaiT: talking-heads self-attention on the patches, then class attention.

The class token joins only in the class-attention stage, but carries a label from
the start (Eq. 5: the image weights), so the layout has one prefix token throughout.
Events per layer (``len(blocks)`` self-attention layers, then the class-attention ones):

- talking-heads self-attention: the matrix that multiplies ``V`` in head ``h`` is the
  post-softmax head mix ``A'_h = sum_g W[h, g] softmax(L_g) + b_h`` (``proj_w``), which
  may be negative and whose rows need not sum to 1. The label rule is Table 10's
  ``Norm(W^s)`` per head on absolute values, averaged over heads like attention:
  ``mixed = mean_h(Norm(|A'_h|)) Y`` over the patch tokens (with ``proj_w = I`` it is
  the ordinary rule); the class row is passed through unchanged (it does not exist
  yet). timm materialises ``A'`` anyway (there is no fused talking-heads kernel), so
  the labels reuse it. ``residual(layer, keep, mixed=...)`` after attention and
  ``residual(layer, keep, mixed=None)`` after the MLP.
- class attention: only the class token moves: ``mixed`` is the class token's head-mean
  attention row over ``[cls; patches]`` applied to the labels (fused into timm's
  ``scaled_dot_product_attention`` when that is on), the patch rows unchanged;
  ``class_attention`` in the last layer (TransMix); ``residual`` with ``mixed``, then
  without (the MLP).
- readout: ``pool("token", 0)`` (or ``"mean"`` over the patches for ``global_pool='avg'``).

Shapes: ``b`` batch, ``h`` heads, ``n m`` tokens, ``d`` head dim, ``l`` label channels.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange, reduce
from timm.models.cait import Cait, ClassAttn, LayerScaleBlock, LayerScaleBlockClassAttn, TalkingHeadAttn
from torch import Tensor, nn

from mixlabels._label_map import fp32_labels
from mixlabels.backbones._attention import attention_with_labels, class_attention
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import _READS_NOTHING, AdaptedBase, branch, eager_cpu_routes, explicit_mix, mixing_rows, stride_grid
from mixlabels.backbones._dense import DenseRules, drop_path_reference as _drop, row_normalise
from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap, TokenLayout
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._fsdp import through_hooks

__all__ = ["AdaptedCaiT", "CAIT_FAMILY", "label_matrix", "talking_heads_label_mix"]

CAIT_FAMILY = (
    "timm Cait (talking-heads self-attention with normalised absolute post-softmax head mix, then "
    "class-attention layers moving only the class token; 'token' or 'avg' readout; layer scale; stochastic depth)"
)


def _cait_refusal(model: nn.Module) -> str | None:
    if type(model) is not Cait:
        return f"{type(model).__name__} is not a timm Cait"
    m: Any = model
    if m.global_pool not in ("token", "avg"):
        return f"global_pool={m.global_pool!r} has no label readout; use 'token' or 'avg'"
    if not m.blocks_token_only:
        return "a Cait without class-attention layers never reads its class token"
    for blk in m.blocks:
        if type(blk) is not LayerScaleBlock or type(blk.attn) is not TalkingHeadAttn:
            return f"self-attention block {type(blk).__name__} is not timm's LayerScaleBlock with TalkingHeadAttn"
    for blk in m.blocks_token_only:
        if type(blk) is not LayerScaleBlockClassAttn or type(blk.attn) is not ClassAttn:
            return f"class-attention block {type(blk).__name__} is not timm's LayerScaleBlockClassAttn with ClassAttn"
    return None


def talking_heads(attn: Any, x: Tensor) -> tuple[Tensor, Tensor]:
    """timm's ``TalkingHeadAttn`` up to the matrix that multiplies ``V``: ``(A' (b, h, n, n), v)``."""
    q, k, v = rearrange(attn.qkv(x), "b n (three h d) -> three b h n d", three=3, h=attn.num_heads)
    scores = (q * attn.scale) @ k.transpose(-2, -1)
    scores = rearrange(attn.proj_l(rearrange(scores, "b h n m -> b n m h")), "b n m h -> b h n m")  # pre-softmax head mix
    a = scores.softmax(dim=-1)
    return rearrange(attn.proj_w(rearrange(a, "b h n m -> b n m h")), "b n m h -> b h n m"), v  # post-softmax head mix


def label_matrix(a: Tensor) -> Tensor:
    """``mean_h(Norm(|A'_h|))`` ``(b, n, n)`` fp32: each head's mixing weights made a distribution (``mixing_rows``: a row
    of zeros is the identity's)."""
    return reduce(mixing_rows(a.detach().float().abs()), "b h n m -> b n m", "mean")


def talking_heads_label_mix(a: Tensor, labels: Tensor) -> Tensor:
    """``label_matrix(a) @ labels`` ``(b, n, l)`` fp32 without building the normalised matrix.

    ``mean_h(|A'_h| / s_h) Y = mean_h((|A'_h| Y) / s_h)`` with ``s_h`` the row sums of ``|A'_h|``,
    and appending a ones column to ``Y`` makes one product give both ``|A'_h| Y`` and ``s_h``. ``|A'|``
    is written by one ``abs`` pass in the head-mixing linear's own layout ``(b, n, m, h)``, and each
    query row's product is ``[Y 1]^T |A'_n|``: ``(l + 1, m) x (m, h)``, the labels shared by every row
    (expanded: on the CPU one batch of products per sample reads them with a batch stride of 0; one batch
    of all samples' rows, a GPU's route, copies them, ``(l + 1) / h`` of ``|A'|``'s size). Taken the
    other way round, ``|A'_n|^T [Y 1]``, the product reads the matrix transposed: 4 heads at batch 8 and
    196 tokens, 1.14 ms a layer against 1.02 this way, 8 heads 2.23 against 1.23 (2 CPU cores); in a
    TL-Align forward at batch 8, CaiT-XXS24's 24 mixes took 41.7 ms against 35.9, CaiT-S24's 75.3 against
    42.7 (both with one batch of products). The results may differ from that order's in the last bit (the
    head mean runs over the innermost axis here).
    """
    b, h, n, m = (int(d) for d in a.shape)
    w = torch.abs(rearrange(a.detach(), "b h n m -> b n m h").float())  # proj_w's own layout: one streaming pass
    y = torch.cat((labels.float(), labels.new_ones(b, m, 1, dtype=torch.float32)), dim=-1)  # b m (l + 1)
    shared = rearrange(y, "b m l -> b 1 l m").expand(b, n, -1, m)  # every query row's [Y 1]^T
    if eager_cpu_routes(a.device):
        # a product per sample reads the labels through a batch of stride 0, where the batch of all samples' rows
        # copies them once per query row: 0.86 against 1.04 ms at 4 heads and batch 8, 3.8 against 4.6 at batch 32
        # (2 CPU cores; the same bits); in a TL-Align forward at batch 8, CaiT-XXS24's 24 mixes 31.3 ms against
        # 33.0, CaiT-S24's 41.3 against 48.4. A GPU pays per launch (``launch_routes``): one product
        both = y.new_empty(b, n, int(y.shape[-1]), h)
        for i in range(b):
            torch.bmm(shared[i], w[i], out=both[i])
    else:
        both = torch.bmm(shared.flatten(0, 1), w.flatten(0, 1)).view(b, n, -1, h)  # b n (l + 1) h: |A'_h| [Y 1] per row
    # the self tap (``mixing_rows``): a head whose row reads nothing (all of A'_h's row zero: a zeroed proj_w) leaves
    # the token its own labels, where a clamped division gave it none; any other row's bits are unchanged
    both.add_(y.unsqueeze(-1), alpha=_READS_NOTHING)
    return (both[:, :, :-1] / both[:, :, -1:]).mean(dim=-1)


def _embed(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int]]:
    grid = check_batch(images, label_map, tuple(m.patch_embed.patch_size))
    x = m.patch_embed(images)  # b n c
    if label_map.token_space:
        x = label_map.mix_tokens(x, grid)
    return m.pos_drop(x + m.pos_embed), grid


def _head(m: Any, x: Tensor, token_logits: bool) -> tuple[Tensor, Tensor | None]:
    output = m.forward_head(x)
    return output, (m.head(m.head_drop(x[:, 1:])) if token_logits else None)


class AdaptedCaiT(AdaptedBase):
    """A timm CaiT whose forward also returns the scheme's aligned targets."""

    family = CAIT_FAMILY
    refusal = staticmethod(_cait_refusal)

    def reference_grid(self, label_map: TokenLabelMap) -> tuple[int, int]:
        """The reference's labels start on the patch grid (see ``AdaptedBase.reference_bytes``)."""
        m: Any = self.model
        return stride_grid(label_map, tuple(m.patch_embed.patch_size))

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid = _embed(m, images, label_map)
        depth = len(m.blocks) + len(m.blocks_token_only)
        reads_token = m.global_pool == "token"
        tracker = self.scheme.start(label_map, TokenLayout(grid=grid, num_prefix=1, depth=depth, class_token=reads_token))
        for layer, blk in enumerate(m.blocks):
            x = through_hooks(blk, functools.partial(self._self_attention_block, blk, layer=layer, tracker=tracker), x)
        cls = m.cls_token.expand(x.shape[0], -1, -1)
        for i, blk in enumerate(m.blocks_token_only):
            step = functools.partial(self._class_attention_block, blk, layer=len(m.blocks) + i, tracker=tracker)
            cls = through_hooks(blk, step, x, cls)
        x = m.norm(torch.cat((cls, x), dim=1))
        tracker.pool("token", 0) if reads_token else tracker.pool("mean", 1)
        output, token_logits = _head(m, x, self.scheme.needs_token_logits)
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        m: Any = self.model
        return (*m.blocks, *m.blocks_token_only)

    def _self_attention_block(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker) -> Tensor:
        attn = blk.attn
        a, v = talking_heads(attn, blk.norm1(x))
        y, mixed = tracker.labels_for(layer), None
        if y is not None:
            with fp32_labels(y.device):
                patches = talking_heads_label_mix(a, y[:, 1:])
            mixed = torch.cat((y[:, :1], patches), dim=1)  # the class token is not here yet
        out = rearrange(attn.attn_drop(a) @ v, "b h n d -> b n (h d)")
        out, keep = branch(blk.drop_path, blk.gamma_1 * attn.proj_drop(attn.proj(out)))
        tracker.residual(layer, keep, mixed=mixed)
        x = x + out
        out, keep = branch(blk.drop_path, blk.gamma_2 * blk.mlp(blk.norm2(x)))
        tracker.residual(layer, keep, mixed=None)
        return x + out

    def _class_attention_block(self, blk: Any, x: Tensor, cls: Tensor, layer: int, tracker: LabelTracker) -> Tensor:
        attn = blk.attn
        u = blk.norm1(torch.cat((cls, x), dim=1))  # b (1 + n) c
        q = rearrange(attn.q(u[:, 0]), "b (h d) -> b h 1 d", h=attn.num_heads)
        k = rearrange(attn.k(u), "b n (h d) -> b h n d", h=attn.num_heads)
        v = rearrange(attn.v(u), "b n (h d) -> b h n d", h=attn.num_heads)
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
        out = attn.proj_drop(attn.proj(rearrange(out, "b h 1 d -> b 1 (h d)")))
        out, keep = branch(blk.drop_path, blk.gamma_1 * out)
        tracker.residual(layer, keep, mixed=mixed)
        cls = cls + out
        out, keep = branch(blk.drop_path, blk.gamma_2 * blk.mlp(blk.norm2(cls)))
        tracker.residual(layer, keep, mixed=None)
        return cls + out

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit ``(b, 1 + n, 1 + n)`` label matrices per layer on dense labels."""
        m: Any = self.model
        x, grid = _embed(m, images, label_map)
        n = grid[0] * grid[1]
        depth = len(m.blocks) + len(m.blocks_token_only)
        rules = DenseRules(self.scheme, label_map, grid, 1, depth, class_token=m.global_pool == "token")
        eye = torch.eye(1 + n, dtype=torch.float64).expand(x.shape[0], -1, -1)
        for layer, blk in enumerate(m.blocks):
            a, v = talking_heads(blk.attn, blk.norm1(x))
            w = a.detach().double().abs()
            matrix = eye.clone()
            matrix[:, 1:, 1:] = row_normalise(w).mean(dim=1)
            out = blk.attn.proj(rearrange(F.dropout(a, blk.attn.attn_drop.p, blk.training) @ v, "b h n d -> b n (h d)"))
            out, keep = _drop(blk.drop_path, blk.gamma_1 * out)
            rules.mix(layer, matrix, keep)
            x = x + out
            x = x + _drop(blk.drop_path, blk.gamma_2 * blk.mlp(blk.norm2(x)))[0]
        cls = m.cls_token.expand(x.shape[0], -1, -1)
        for i, blk in enumerate(m.blocks_token_only):
            attn, layer = blk.attn, len(m.blocks) + i
            u = blk.norm1(torch.cat((cls, x), dim=1))
            q = rearrange(attn.q(u[:, :1]), "b 1 (h d) -> b h 1 d", h=attn.num_heads)
            k = rearrange(attn.k(u), "b n (h d) -> b h n d", h=attn.num_heads)
            v = rearrange(attn.v(u), "b n (h d) -> b h n d", h=attn.num_heads)
            a = torch.softmax(q @ k.transpose(-2, -1) * attn.scale, dim=-1)  # b h 1 (1 + n)
            row = a.detach().double().mean(dim=1)[:, 0]  # b (1 + n)
            if rules.wants_class_attention(layer):
                rules.attend_class(row)
            matrix = eye.clone()
            matrix[:, 0] = row
            out = attn.proj(rearrange(F.dropout(a, attn.attn_drop.p, blk.training) @ v, "b h 1 d -> b 1 (h d)"))
            out, keep = _drop(blk.drop_path, blk.gamma_1 * out)
            rules.mix(layer, matrix, keep)
            cls = cls + out
            cls = cls + _drop(blk.drop_path, blk.gamma_2 * blk.mlp(blk.norm2(cls)))[0]
        x = m.norm(torch.cat((cls, x), dim=1))
        output, token_logits = _head(m, x, self.scheme.needs_token_logits)
        return rules.result(output, output, "token" if m.global_pool == "token" else "mean", token_logits)


FAMILY = Family(
    name="cait",
    description=CAIT_FAMILY,
    refusal=AdaptedCaiT.refusal,
    build=AdaptedCaiT,
    example=tiny("cait_xxs24_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, depth_token_only=1),
    timm_modules=("cait",),
    speed_model="cait_xxs24_224",
    class_token=True,
)
