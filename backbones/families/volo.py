"""Adapter for timm's VOLO: outlook attention, then self-attention, then class attention (with the aux head).

TL-Align Table 10 and Appendix D, by the reasoning used for the other families. The class token
joins only in the class-attention layers but carries a label from the start (the image weights,
Eq. 5), so the layout has one prefix token throughout (as CaiT's). Events, ``layer`` counting every
``Outlooker``, ``Transformer`` and ``ClassBlock``:

- the patch embedding (a 7x7 stride-2 conv, two stride-1 3x3 convs, then the strided ``proj``):
  the labels start on the pixels, are summed over the first conv's windows, mixed by each 3x3
  conv's normalised |kernel| (``backbones._convnet``'s rule), then summed over ``proj``'s windows;
  a MixToken map starts on the patch grid instead.
- ``OutlookAttention``: for every window ``n`` (``k x k`` taps at stride ``s``, from the average-
  pooled map) each head has a softmax matrix ``A_n`` over the window's taps; output tap ``i`` of
  window ``n`` is ``sum_j A_n[i, j] v_j``, and ``fold`` sums every window's outputs onto the grid.
  Labels take the same linear map with the head-mean ``A``: ``M Y`` with
  ``M[p, q] = sum_{n, i: pos(n, i) = p} sum_{j: pos(n, j) = q} mean_h A_n[i, j]``; padding taps hold
  no token, so every row is renormalised over the in-grid taps (``M Y / M 1``).
- ``Downsample`` (a 2x2 stride-2 conv): ``aggregate``; the position embedding: a channel op.
- ``Transformer``: ``mean_h(A_h) Y`` over the patch tokens (fused into the attention call when timm
  fuses it); the class token's row passes (it does not exist yet).
- ``ClassBlock``: only the class token moves, by its head-mean attention row over ``[cls; patches]``;
  ``class_attention`` in the last one (TransMix).
- readout: ``pool("token", 0)`` (or ``"mean"`` over all tokens for ``global_pool='avg'``). With the
  token-labeling aux head, timm's logits are ``head(cls) + 0.5 * max_tokens aux_head(patches)``: the
  target is the class token's label, and token-labeling schemes read ``aux_head`` on every patch
  token (LV-ViT's dense head) as the per-token logits.

Shapes: ``b`` batch, ``h`` heads, ``n`` windows or tokens, ``t`` window taps, ``l`` label channels.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.layers.drop import DropPath
from timm.models.volo import VOLO, Attention, ClassAttention, ClassBlock, Downsample, OutlookAttention, Outlooker, Transformer
from torch import Tensor, nn

from mixlabels import AlignedOutput, LabelTracker, Readout, TokenLabelMap
from mixlabels._label_map import fp32_labels
from mixlabels.backbones._attention import attention_with_labels, class_attention, explicit_mix
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import AdaptedBase, branch, mix_token_space, start_on_windows
from mixlabels.backbones._convnet import Path, Window, apply_path, path_matrix, path_of, path_refusal, window_axes
from mixlabels.backbones._dense import DenseRules, row_normalise
from mixlabels.backbones._dense import drop_path_reference as _drop
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._fsdp import through_hooks

__all__ = ["AdaptedVOLO", "VOLO_FAMILY", "volo_refusal", "outlook_labels", "outlook_matrix"]

VOLO_FAMILY = (
    "timm VOLO: the conv patch embedding from the pixels (strided windows aggregate, stride-1 convs mix by the "
    "normalised |kernel|); outlook attention as the fold of its head-mean window attentions (renormalised over "
    "in-grid taps); downsampling as aggregation; self-attention over the patches; class attention moving only the "
    "class token; 'token' or 'avg' readout, the token-labeling aux head's max term in the logits and its per-token "
    "logits for token labeling; stochastic depth"
)


def _blocks(m: Any) -> list[Any]:
    return [blk for part in m.network if not isinstance(part, Downsample) for blk in part]


def _depth(m: Any) -> int:
    return len(_blocks(m)) + len(m.post_network)


def _stem_modules(m: Any) -> list[nn.Module]:
    conv = list(m.patch_embed.conv) if m.patch_embed.conv is not None else []
    return [*conv, m.patch_embed.proj]


def volo_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm VOLO this adapter carries labels through (``None``: it is)."""
    if type(model) is not VOLO:
        return f"{type(model).__name__} is not a timm VOLO"
    m: Any = model
    if m.post_network is None or m.cls_token is None:
        return "a VOLO without class-attention post layers has no class token to read; build it with post_layers"
    if m.global_pool not in ("token", "avg"):
        return f"global_pool={m.global_pool!r} has no label readout; use 'token' or 'avg'"
    why = path_refusal(_stem_modules(m), "the patch embedding")
    if why is not None:
        return why
    for i, part in enumerate(m.network):
        if isinstance(part, Downsample):
            continue
        for j, blk in enumerate(part):
            where = f"network {i} block {j}"
            if type(blk) not in (Outlooker, Transformer):
                return f"{where} is {type(blk).__name__}, not timm's Outlooker or Transformer"
            if type(blk) is Outlooker and type(blk.attn) is not OutlookAttention:
                return f"{where}'s attention is not timm's OutlookAttention"
            if type(blk) is Transformer and type(blk.attn) is not Attention:
                return f"{where}'s attention is not timm's VOLO Attention"
            for dp in (blk.drop_path1, blk.drop_path2):
                if type(dp) not in (nn.Identity, DropPath):
                    return f"{where}'s stochastic depth is {type(dp).__name__}, not timm's DropPath"
    for j, blk in enumerate(m.post_network):
        if type(blk) is not ClassBlock or type(blk.attn) is not ClassAttention:
            return f"post layer {j} is {type(blk).__name__}; only timm's ClassBlock (class attention) is supported"
    return None


# ---------------------------------------------------------------------------------------------- outlook attention
def _outlook(attn: Any, x: Tensor) -> tuple[Tensor, Tensor]:
    """timm's ``OutlookAttention`` step by step on ``(b, H, W, c)``: its output and the softmax ``(b, h, n, t, t)``
    (before attention dropout: the labels read the undropped weights, as for attention)."""
    b, hh, ww, c = x.shape
    v = attn.v(x).permute(0, 3, 1, 2)
    h, w = -(-hh // attn.stride), -(-ww // attn.stride)
    t = attn.kernel_size * attn.kernel_size
    v = attn.unfold(v).reshape(b, attn.num_heads, c // attn.num_heads, t, h * w).permute(0, 1, 4, 3, 2)
    a = attn.pool(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    a = attn.attn(a).reshape(b, h * w, attn.num_heads, t, t).permute(0, 2, 1, 3, 4)
    a = (a * attn.scale).softmax(dim=-1)
    out = (attn.attn_drop(a) @ v).permute(0, 1, 4, 3, 2).reshape(b, c * t, h * w)
    out = F.fold(out, output_size=(hh, ww), kernel_size=attn.kernel_size, padding=attn.padding, stride=attn.stride)
    return attn.proj_drop(attn.proj(out.permute(0, 2, 3, 1))), a


def outlook_labels(attn: Any, a: Tensor, labels: Tensor, grid: tuple[int, int]) -> Tensor:
    """``M Y / M 1``: patch labels ``(b, H*W, l)`` through outlook attention's fold of head-mean window attentions.

    One ``unfold`` of the labels with a ones channel (zero at padding taps), one batched product with
    the head-mean ``(b, n, t, t)`` attentions, one ``fold``: the ones channel's fold is each row's
    in-grid mass, the renormaliser.
    """
    with torch.no_grad(), fp32_labels(labels.device):
        b, l = labels.shape[0], labels.shape[-1]
        y = rearrange(labels.float(), "b (h w) l -> b l h w", h=grid[0])
        y = torch.cat([y, y.new_ones(b, 1, *grid)], dim=1)  # the ones channel: the in-grid mass
        k, p, s = attn.kernel_size, attn.padding, attn.stride
        taps = rearrange(F.unfold(y, k, padding=p, stride=s), "b (c t) n -> b n t c", t=k * k)
        z = a.detach().float().mean(dim=1) @ taps  # b n t (l + 1)
        folded = F.fold(rearrange(z, "b n t c -> b (c t) n"), grid, k, padding=p, stride=s)  # b (l + 1) H W
        mixed = folded[:, :l] / folded[:, l:].clamp_min(torch.finfo(torch.float32).tiny)
        return rearrange(mixed, "b l h w -> b (h w) l")


def outlook_matrix(attn: Any, a: Tensor, grid: tuple[int, int]) -> Tensor:
    """``Norm(M)`` ``(b, H*W, H*W)`` float64 written out window by window and tap by tap (the reference)."""
    hh, ww = grid
    k, p, s = attn.kernel_size, attn.padding, attn.stride
    abar = a.detach().double().mean(dim=1)  # b n t t
    h, w = (hh + 2 * p - k) // s + 1, (ww + 2 * p - k) // s + 1
    m = torch.zeros(a.shape[0], hh * ww, hh * ww, dtype=torch.float64)
    for wy in range(h):
        for wx in range(w):
            n = wy * w + wx
            pos = []
            for ty in range(k):
                for tx in range(k):
                    y, x = wy * s - p + ty, wx * s - p + tx
                    pos.append(y * ww + x if 0 <= y < hh and 0 <= x < ww else -1)
            for i, pi in enumerate(pos):
                for j, qj in enumerate(pos):
                    if pi >= 0 and qj >= 0:
                        m[:, pi, qj] += abar[:, n, i, j]
    return row_normalise(m)


# ---------------------------------------------------------------------------------------------- embedding and head
def _embed(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int], tuple[int, int], Path]:
    """Patch embedding ``(b, H, W, c)``, its grid, the grid the labels start on, and the embedding's path."""
    path = path_of(_stem_modules(m))
    stride = 1
    for op in path:
        if isinstance(op, Window):
            stride *= op.stride[0]
    grid = check_batch(images, label_map, (stride, stride))
    x = m.patch_embed(images)
    if (int(x.shape[2]), int(x.shape[3])) != grid:
        raise ValueError(f"the patch embedding made a {tuple(x.shape[2:])} grid, not {grid}; use an image size divisible by {stride}")
    if label_map.token_space:
        return mix_token_space(x, label_map, channels_last=False).permute(0, 2, 3, 1), grid, grid, path
    return x.permute(0, 2, 3, 1), grid, (label_map.image_size[0], label_map.image_size[1]), path


def _check_pos_embed(m: Any, x: Tensor, images: Tensor) -> None:
    """Refuse a grid the position embedding (``(1, h, w, c)``, sized from ``img_size`` at construction) does not fit."""
    grid, pos = tuple(int(s) for s in x.shape[1:3]), tuple(int(s) for s in m.pos_embed.shape[1:3])
    if grid != pos:
        raise ValueError(
            f"{images.shape[2]}x{images.shape[3]} images give a {grid[0]}x{grid[1]} grid where VOLO adds its position "
            f"embedding, which is {pos[0]}x{pos[1]}: timm sizes it from img_size at construction; feed images of the "
            "model's img_size, or create the model with img_size set to yours"
        )


def _token_logits(m: Any, x: Tensor) -> Tensor:
    """Per-patch-token logits: the aux head (token labeling's dense head) where the model has one, else the head."""
    t = m.head_drop(x[:, 1:])
    return (m.aux_head if m.aux_head is not None else m.head)(t)  # type: ignore[no-any-return]


def _readout(m: Any) -> tuple[Readout, int]:
    return ("token", 0) if m.global_pool == "token" else ("mean", 0)  # timm's 'avg' averages the class token too


def _total_stride(m: Any) -> int:
    """Pixels per side of a last-stage patch: the patch embedding's strides times every downsampling conv's."""
    stride = 1
    for op in path_of(_stem_modules(m)):
        if isinstance(op, Window):
            stride *= op.stride[0]
    for part in m.network:
        if isinstance(part, Downsample):
            stride *= _pair(part.proj.stride)[0]
    return stride


def _check_tiles(m: Any, label_map: TokenLabelMap, grid: tuple[int, int]) -> None:
    """The class attention's patches must tile the image for their area weights (TransMix) to be exact: where a
    downsampling conv drops a trailing row or column (a grid of odd size), they do not."""
    hh, ww = label_map.image_size
    stride = _total_stride(m)
    if (grid[0] * stride, grid[1] * stride) != (hh, ww):
        raise ValueError(
            f"the class attention reads a {grid[0]}x{grid[1]} patch grid of {stride}-pixel patches, which does not tile "
            f"the {hh}x{ww} image (a downsampling conv dropped a row or column), so its patches have no exact area "
            f"weights for this scheme's target (TransMix); use an image size divisible by {stride}, or TLAlign()"
        )


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _leading_windows(path: Path) -> int:
    lead = 0
    while lead < len(path) and isinstance(path[lead], Window):
        lead += 1
    return lead


def _with_prefix(merge: Any) -> Any:
    return lambda y: torch.cat([y[:, :1], merge(y[:, 1:])], dim=1)


class AdaptedVOLO(AdaptedBase):
    """A timm VOLO returning the scheme's aligned targets (``adapted(images)`` is the model's)."""

    family = VOLO_FAMILY
    refusal = staticmethod(volo_refusal)

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid, start, path = _embed(m, images, label_map)
        class_token = m.global_pool == "token"
        lead = 0 if start == grid else _leading_windows(path)  # a MixToken map starts on the patch grid
        windows = window_axes([w for w in path[:lead] if isinstance(w, Window)], start)
        tracker, mid = start_on_windows(self.scheme, label_map, start, _depth(m), windows, 1, class_token)
        rest = path[lead:] if start != grid else ()
        if rest:  # the stride-1 convs and the rest of the embedding's windows
            tracker.aggregate(_with_prefix(lambda y: apply_path(rest, y, mid)[0]))
        layer = 0
        for i, part in enumerate(m.network):
            if i == 2 and m.pos_embed is not None:
                _check_pos_embed(m, x, images)
                x = m.pos_drop(x + m.pos_embed)  # a channel op
            if isinstance(part, Downsample):
                down, g = path_of([part.proj]), grid
                tracker.aggregate(_with_prefix(lambda y: apply_path(down, y, g)[0]))
                x = part(x)
                grid = (int(x.shape[1]), int(x.shape[2]))
                continue
            for blk in part:
                x = through_hooks(blk, functools.partial(self._block, blk, layer=layer, tracker=tracker, grid=grid), x)
                layer += 1
        x = rearrange(x, "b h w c -> b (h w) c")
        cls = m.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1)
        if any(tracker.wants_class_attention(i) for i in range(layer, layer + len(m.post_network))):
            _check_tiles(m, label_map, grid)
        for blk in m.post_network:
            x = through_hooks(blk, functools.partial(self._class_block, blk, layer=layer, tracker=tracker, grid=grid), x)
            layer += 1
        x = m.norm(x)
        tracker.pool(*_readout(m))
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        m: Any = self.model
        return (*_blocks(m), *m.post_network)  # the downsampling between parts: the root's

    @staticmethod
    def _block(blk: Any, x: Tensor, layer: int, tracker: LabelTracker, grid: tuple[int, int]) -> Tensor:
        y, mixed = tracker.labels_for(layer), None
        h = blk.norm1(x)
        attn = blk.attn
        if isinstance(blk, Outlooker):  # not type(): fully_shard subclasses a sharded block
            out, a = _outlook(attn, h)
            if y is not None:
                mixed = outlook_labels(attn, a, y[:, 1:], grid)
        else:
            b, hh, ww, c = h.shape
            q, k, v = rearrange(attn.qkv(h), "b h w (three n d) -> three b n (h w) d", three=3, n=attn.num_heads)
            dropout_p = attn.attn_drop.p if attn.training else 0.0
            if not attn.fused_attn:
                a = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
                mixed = None if y is None else explicit_mix(a, y[:, 1:])
                o = attn.attn_drop(a) @ v
            elif y is not None:
                o, mixed = attention_with_labels(q, k, v, y[:, 1:], attn.scale, dropout_p)
            else:
                o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
            out = attn.proj_drop(attn.proj(rearrange(o, "b n (h w) d -> b h w (n d)", h=hh)))
        if y is not None and mixed is not None:
            mixed = torch.cat([y[:, :1], mixed], dim=1)  # the class token is not here yet
        out, keep = branch(blk.drop_path1, out)
        tracker.residual(layer, keep, mixed=mixed)
        x = x + out
        out, keep = branch(blk.drop_path2, blk.mlp(blk.norm2(x)))
        tracker.residual(layer, keep, mixed=None)
        return x + out

    @staticmethod
    def _class_block(blk: Any, x: Tensor, layer: int, tracker: LabelTracker, grid: tuple[int, int]) -> Tensor:
        attn = blk.attn
        u = blk.norm1(x)
        k, v = rearrange(attn.kv(u), "b n (two h d) -> two b h n d", two=2, h=attn.num_heads)
        q = rearrange(attn.q(u[:, :1]), "b 1 (h d) -> b h 1 d", h=attn.num_heads)
        if tracker.wants_class_attention(layer):
            tracker.class_attention(layer, class_attention(q, k, attn.scale), grid)  # over the last stage's patches
        a = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)  # b h 1 n, as timm computes it
        y, mixed = tracker.labels_for(layer), None
        if y is not None:
            mixed = torch.cat([explicit_mix(a, y), y[:, 1:]], dim=1)  # only the class token moves
        out = attn.proj_drop(attn.proj(rearrange(attn.attn_drop(a) @ v, "b h 1 d -> b 1 (h d)")))
        out, keep = branch(blk.drop_path1, out)
        tracker.residual(layer, keep, mixed=mixed)
        cls = x[:, :1] + out
        out, keep = branch(blk.drop_path2, blk.mlp(blk.norm2(cls)))
        tracker.residual(layer, keep, mixed=None)
        return torch.cat([cls + out, x[:, 1:]], dim=1)

    # ------------------------------------------------------------------------------------------ reference
    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit ``(b, 1 + n, 1 + n)`` matrices per layer (outlook attention written out tap by tap)."""
        m: Any = self.model
        x, grid, start, path = _embed(m, images, label_map)
        rules = DenseRules(self.scheme, label_map, start, 1, _depth(m), class_token=m.global_pool == "token")

        def with_prefix(matrix: Tensor) -> Tensor:
            """``[[1, 0], [0, matrix]]``: the class token keeps its label."""
            out = torch.zeros(matrix.shape[0] + 1, matrix.shape[1] + 1, dtype=torch.float64)
            out[0, 0] = 1.0
            out[1:, 1:] = matrix
            return out

        if start != grid:
            rules.aggregate(with_prefix(path_matrix(path, start)[0]))
        layer = 0
        for i, part in enumerate(m.network):
            if i == 2 and m.pos_embed is not None:
                _check_pos_embed(m, x, images)
                x = m.pos_drop(x + m.pos_embed)
            if isinstance(part, Downsample):
                merge, _ = path_matrix(path_of([part.proj]), grid)
                rules.aggregate(with_prefix(merge))
                x = part(x)
                grid = (int(x.shape[1]), int(x.shape[2]))
                continue
            for blk in part:
                h = blk.norm1(x)
                attn = blk.attn
                if type(blk) is Outlooker:
                    out, a = _outlook(attn, h)
                    patches = outlook_matrix(attn, a, grid)
                else:
                    b, hh, ww, c = h.shape
                    q, k, v = rearrange(attn.qkv(h), "b h w (three n d) -> three b n (h w) d", three=3, n=attn.num_heads)
                    a = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
                    o = F.dropout(a, attn.attn_drop.p, attn.training) @ v
                    out = attn.proj_drop(attn.proj(rearrange(o, "b n (h w) d -> b h w (n d)", h=hh)))
                    patches = a.detach().double().mean(dim=1)
                matrix = torch.stack([with_prefix(p) for p in patches])
                out, keep = _drop(blk.drop_path1, out)
                rules.mix(layer, matrix, keep)
                x = x + out
                x = x + _drop(blk.drop_path2, blk.mlp(blk.norm2(x)))[0]
                layer += 1
        x = rearrange(x, "b h w c -> b (h w) c")
        x = torch.cat([m.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        n = x.shape[1]
        if any(rules.wants_class_attention(i) for i in range(layer, layer + len(m.post_network))):
            _check_tiles(m, label_map, grid)
        for blk in m.post_network:
            attn = blk.attn
            u = blk.norm1(x)
            k, v = rearrange(attn.kv(u), "b n (two h d) -> two b h n d", two=2, h=attn.num_heads)
            q = rearrange(attn.q(u[:, :1]), "b 1 (h d) -> b h 1 d", h=attn.num_heads)
            a = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
            row = a.detach().double().mean(dim=1)[:, 0]  # b n
            if rules.wants_class_attention(layer):
                rules.attend_class(row, grid)
            matrix = torch.eye(n, dtype=torch.float64).expand(x.shape[0], -1, -1).clone()
            matrix[:, 0] = row
            out = attn.proj(rearrange(F.dropout(a, attn.attn_drop.p, blk.training) @ v, "b h 1 d -> b 1 (h d)"))
            out, keep = _drop(blk.drop_path1, out)
            rules.mix(layer, matrix, keep)
            cls = x[:, :1] + out
            cls = cls + _drop(blk.drop_path2, blk.mlp(blk.norm2(cls)))[0]
            x = torch.cat([cls, x[:, 1:]], dim=1)
            layer += 1
        x = m.norm(x)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        how, _ = _readout(m)
        return rules.result(output, output, how, token_logits, 0)


FAMILY = Family(
    name="volo",
    description=VOLO_FAMILY,
    refusal=AdaptedVOLO.refusal,
    build=AdaptedVOLO,
    example=tiny(VOLO, img_size=32, patch_size=4, stem_hidden_dim=16, layers=(1, 1), embed_dims=(16, 32), num_heads=(1, 2),
        downsamples=(True, False), outlook_attention=(True, False), mlp_ratio=(2.0, 2.0), post_layers=("ca",)),
    timm_modules=("volo",),
    speed_model="volo_d1_224",
    class_token=True,
)
