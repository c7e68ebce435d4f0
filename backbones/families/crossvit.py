"""Adapter for timm's CrossViT: two ViT branches of different patch sizes, fused by cross-attention.

Labels live per branch, on one sequence: ``[cls_0, patches_0, cls_1, patches_1]``. Both
branches embed the same mixed image, so their patch labels come from the same pixel labels:

- a branch whose image is rescaled (``img_scale != 1``: timm resizes bicubically, or crops
  with ``crop_scale``) moves its pixels' labels by the resampling's normalised absolute
  weights, ``Norm(|R|)`` (bicubic taps are signed); a crop selects pixels;
- the patch embedding (one strided conv, or the ``multi_conv`` stack of "dagger" models)
  aggregates: every conv sums its window's labels and renormalises.

Both are separable, so each branch's start is ``(M_h (x) M_w) Y_pixels`` with per-axis
row-stochastic ``M``: the mask weighs its boxes or cells under both branches' windows at
once, without a per-pixel label map (``_Start``; annotator token targets start on the
pixels, one ``aggregate`` event from there). Class tokens start on the
image target (the sum over all pixels). A branch's self-attention ``Block`` mixes its own
segment by the head-mean attention (Eq. 9); the channel projections of the class tokens
(``projs``, ``revert_projs``) leave labels alone; a fusion ``CrossAttentionBlock`` lets
``cls_i`` attend to ``[cls_i, patches_j]`` of the other branch: ``cls_i``'s labels get the
head-mean attention row over those tokens' labels (a residual), so labels cross branches
only through the class tokens, as content does. The logits average the branches' heads, so
the readout averages the branches' class tokens (``global_pool='avg'``: their patch means):
a last ``aggregate`` writes that average into the prefix rows read by ``pool("token", 0)``.

Layers: in each ``MultiScaleBlock``, block ``j`` of every branch is layer ``base + j`` (the
branches run side by side), then each fusion block one layer (both branches). TransMix
reads the class tokens' attention in the last layer, the final fusion (its first block: later
ones attend to the class token alone): each ``cls_i``'s row over the other branch's patches, spread back onto the pixels those patches come from, the
two branches averaged (as their logits are).

Shapes: ``b`` batch, ``n`` tokens, ``h w`` pixels, ``p q`` a branch's patch grid, ``l`` label channels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.layers.attention import Attention
from timm.models.crossvit import CrossAttention, CrossAttentionBlock, CrossVit, MultiScaleBlock
from timm.models.vision_transformer import Block
from torch import Tensor, nn

from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap, TokenLayout
from mixlabels._label_map import fp32_labels
from mixlabels._shape_cache import shape_cache
from mixlabels.backbones._attention import attention_with_labels
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._windows import apply_separable
from mixlabels.backbones._common import AdaptedBase, branch
from mixlabels.backbones._dense import DenseRules, conv_matrix, drop_path_reference as _drop, row_normalise
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._fsdp import through_hooks

__all__ = ["AdaptedCrossViT", "CROSSVIT_FAMILY", "branch_start_matrices"]

CROSSVIT_FAMILY = (
    "timm CrossVit (two branches with their own class tokens and patch sizes, labels per branch from the same "
    "pixels through each branch's rescale (Norm|bicubic| or crop) and patch embedding (conv or multi_conv "
    "aggregate); self-attention per branch; cross-attention moves labels into the class tokens; the readout "
    "averages the branches as the logits do; token or avg pooling; stochastic depth)"
)


def _fusion_blocks(fusion: nn.Module) -> list[Any]:
    return list(fusion) if isinstance(fusion, nn.Sequential) else [fusion]


def _stem_convs(patch_embed: Any) -> list[Any]:
    proj = patch_embed.proj
    return [mod for mod in proj if isinstance(mod, nn.Conv2d)] if isinstance(proj, nn.Sequential) else [proj]


def _crossvit_refusal(model: nn.Module) -> str | None:
    if type(model) is not CrossVit:
        return f"{type(model).__name__} is not a timm CrossVit"
    m: Any = model
    if m.num_branches != 2:
        return f"{m.num_branches} branches; timm's CrossVit forward (and this adapter) takes 2"
    if m.global_pool not in ("token", "avg") or isinstance(m.head[0], nn.Identity):
        return f"global_pool={m.global_pool!r} with no classifier has no label readout; keep num_classes > 0"
    for i, embed in enumerate(m.patch_embed):
        for conv in _stem_convs(embed):
            if type(conv) is not nn.Conv2d or isinstance(conv.padding, str) or conv.groups != 1 or conv.dilation != (1, 1):
                return f"branch {i}'s patch embedding has a conv that is not a plain zero-padded nn.Conv2d"
        if isinstance(embed.proj, nn.Sequential) and any(not isinstance(mod, (nn.Conv2d, nn.ReLU)) for mod in embed.proj):
            return f"branch {i}'s multi_conv patch embedding holds modules other than Conv2d and ReLU"
    for k, ms in enumerate(m.blocks):
        if type(ms) is not MultiScaleBlock or ms.blocks is None or len(ms.blocks) != 2:
            return f"multi-scale block {k} lacks a branch's transformer blocks (a zero branch depth shifts timm's branches); give every branch depth >= 1"
        branches: Any = ms.blocks  # an nn.ModuleList of nn.Sequential: untyped iteration
        for d, seq in enumerate(branches):
            for j, blk in enumerate(seq):
                if type(blk) is not Block or type(blk.attn) is not Attention:
                    return f"multi-scale block {k} branch {d} block {j} is not timm's ViT Block with its Attention"
        for d, fusion in enumerate(ms.fusion):
            if any(type(f) is not CrossAttentionBlock or type(f.attn) is not CrossAttention for f in _fusion_blocks(fusion)):
                return f"multi-scale block {k}'s fusion {d} is not timm's CrossAttentionBlock"
    return None


# ---------------------------------------------------------------------------------------------- label starts


def _resample_axis(size: int, target: int, crop: bool) -> Tensor:
    """``(target, size)`` float64: one axis of timm's ``scale_image``, as normalised absolute weights."""
    if size == target:
        return torch.eye(size, dtype=torch.float64)
    if crop and target <= size:
        start = int(round((size - target) / 2.0))
        return torch.eye(size, dtype=torch.float64)[start : start + target]
    basis = rearrange(torch.eye(size, dtype=torch.float64), "i (s one) -> i 1 s one", one=1)  # every pixel alone
    out = F.interpolate(basis, size=(target, 1), mode="bicubic", align_corners=False)  # size 1 t 1
    return row_normalise(rearrange(out, "i 1 t 1 -> t i").abs())


def _conv_axis(size: int, kernel: int, stride: int, padding: int) -> Tensor:
    """``(out, size)`` float64: a conv's window sums along one axis, rows renormalised (the aggregate rule)."""
    out = (size + 2 * padding - kernel) // stride + 1
    starts = torch.arange(out)[:, None] * stride - padding
    taps = torch.arange(size)[None, :]
    return row_normalise(((taps >= starts) & (taps < starts + kernel)).double())


def branch_start_matrices(m: Any, image_size: tuple[int, int]) -> list[tuple[Tensor, Tensor]]:
    """Per branch, ``(M_h, M_w)`` float64, row-stochastic: pixels to patch tokens along each axis."""
    return [(mh.clone(), mw.clone()) for mh, mw in _start_matrices(_start_geometry(m), image_size)]


_Geometry = tuple[tuple[tuple[int, int], bool, tuple[tuple[tuple[int, int, int], tuple[int, int, int]], ...]], ...]
"""Per branch: the scaled image size, ``crop_scale``, and every patch-embedding conv's (kernel, stride, padding) per
axis: all the label starts depend on."""


def _start_geometry(m: Any) -> _Geometry:
    def axis(c: Any, a: int) -> tuple[int, int, int]:
        return int(c.kernel_size[a]), int(c.stride[a]), int(c.padding[a])

    return tuple(
        ((int(m.img_size_scaled[i][0]), int(m.img_size_scaled[i][1])), bool(m.crop_scale),
         tuple((axis(c, 0), axis(c, 1)) for c in _stem_convs(embed)))
        for i, embed in enumerate(m.patch_embed)
    )  # fmt: skip


@shape_cache(maxsize=16)
def _start_matrices(geometry: _Geometry, image_size: tuple[int, int]) -> tuple[tuple[Tensor, Tensor], ...]:
    """``branch_start_matrices`` of a model of ``geometry`` (``_start_geometry``), built once per image size."""
    starts = []
    for scaled, crop, convs in geometry:
        axes = [_resample_axis(image_size[a], scaled[a], crop) for a in (0, 1)]
        for conv in convs:
            axes = [_conv_axis(int(ax.shape[0]), *conv[a]) @ ax for a, ax in enumerate(axes)]
        starts.append((axes[0], axes[1]))
    return tuple(starts)


@shape_cache(maxsize=16)
def _pixel_starts(geometry: _Geometry, image_size: tuple[int, int], device: torch.device) -> tuple[tuple[Tensor, Tensor], ...]:
    """``_start_matrices`` fp32 on ``device``."""
    return tuple((mh.to(device, torch.float32), mw.to(device, torch.float32)) for mh, mw in _start_matrices(geometry, image_size))


@shape_cache(maxsize=16)
def _window_starts(geometry: _Geometry, image_size: tuple[int, int], device: torch.device) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, ...]]:
    """The branches' start matrices stacked, ``(p_0 + p_1, H)`` and ``(q_0 + q_1, W)`` fp32 on ``device``; the
    gather of ``[img, img, cls_0, patches_0, cls_1, patches_1]`` from ``[img, img, grid]`` over their
    ``(p_0 + p_1) x (q_0 + q_1)`` grid; and each branch's positions in that grid (its diagonal block)."""
    mats = _start_matrices(geometry, image_size)
    width = sum(int(mw.shape[0]) for _, mw in mats)
    blocks, gather, top, left = [], [torch.tensor([0, 1])], 0, 0
    for i, (mh, mw) in enumerate(mats):
        p, q = int(mh.shape[0]), int(mw.shape[0])
        block = ((torch.arange(top, top + p) * width)[:, None] + torch.arange(left, left + q)).reshape(-1)
        blocks.append(block.to(device))
        gather += [torch.tensor([i]), block + 2]  # the class token: the image's row
        top, left = top + p, left + q
    rows = torch.cat([mh for mh, _ in mats]).to(device, torch.float32)
    cols = torch.cat([mw for _, mw in mats]).to(device, torch.float32)
    return rows, cols, torch.cat(gather).to(device), tuple(blocks)


@dataclass(frozen=True)
class _Start:
    """Where a forward's labels start (``layout``) and how they reach the branches' tokens.

    Without annotator token targets, on the branches' tokens at once: the layout's ``pixel_windows`` are the
    branches' start matrices stacked, so the mask weighs its boxes or cells under every pair of their rows
    (``TokenLabelMap.window_weights``: no per-pixel label map; CrossViT-Ti's 240x240 one and the branches' products
    from it took about 6 ms of a batch of 8's forward, profiled operator by operator), and branch ``i``'s tokens are
    that grid's ``i``-th diagonal block (the cross blocks' few rows go unread). With them (they start on the
    pixels), each branch from the pixels by its two matrices."""

    layout: TokenLayout
    pixels: tuple[tuple[Tensor, Tensor], ...] | None  # per branch (M_h, M_w), on the pixels
    gather: Tensor | None  # on the stacked windows: the merge's gather
    blocks: tuple[Tensor, ...]  # on the stacked windows: each branch's positions in the layout's grid

    def merge(self, y: Tensor) -> Tensor:
        """``[img, img, start grid] -> [img, img, cls_0, patches_0, cls_1, patches_1]`` (the prefix rows stay:
        read only by the final readout merge)."""
        if self.pixels is None:
            assert self.gather is not None
            return y.index_select(1, self.gather)  # one gather
        parts = []
        for i, (mh, mw) in enumerate(self.pixels):
            parts += [y[:, i : i + 1], apply_separable(y[:, 2:], self.layout.grid, mh, mw)]  # two matmuls, no (b, p, w, l) temporary
        return torch.cat([y[:, :2]] + parts, dim=1)

    def spread(self, row: Tensor, branch: int) -> Tensor:
        """A class token's attention over branch ``branch``'s patches ``(b, p*q)``, renormalised, spread over the
        start grid's positions each patch's labels came from (``row @ (M_h (x) M_w)``): ``(b, h*w)``."""
        row = row / row.sum(dim=-1, keepdim=True)
        if self.pixels is None:
            n = self.layout.grid[0] * self.layout.grid[1]
            return row.new_zeros(row.shape[0], n).index_copy_(1, self.blocks[branch], row)  # its own block
        mh, mw = self.pixels[branch]
        row = rearrange(row, "b (p q) -> b p q", p=mh.shape[0])
        return rearrange(mh.T @ (row @ mw), "b h w -> b (h w)")  # two matmuls


def _start(m: Any, label_map: TokenLabelMap, image_size: tuple[int, int]) -> tuple[_Start, list[int]]:
    """The forward's ``_Start`` and each branch's token count."""
    geometry, depth = _start_geometry(m), _depth(m)
    if label_map.token_targets is None:
        rows, cols, gather, blocks = _window_starts(geometry, image_size, label_map.device)
        grid = (int(rows.shape[0]), int(cols.shape[0]))
        layout = TokenLayout(grid=grid, num_prefix=2, depth=depth, class_token=True, pixel_windows=(rows, cols))
        return _Start(layout, None, gather, blocks), [int(b.shape[0]) for b in blocks]
    pixels = _pixel_starts(geometry, image_size, label_map.device)
    layout = TokenLayout(grid=image_size, num_prefix=2, depth=depth, class_token=True)
    return _Start(layout, pixels, None, ()), [int(mh.shape[0] * mw.shape[0]) for mh, mw in pixels]


def _segments(sizes: list[int]) -> list[tuple[int, int]]:
    """``(first, end)`` rows of each branch's ``[cls, patches]`` in the label sequence."""
    out, first = [], 2
    for n in sizes:
        out.append((first, first + 1 + n))
        first += 1 + n
    return out


def _depth(m: Any) -> int:
    return sum(max(len(seq) for seq in ms.blocks) + len(_fusion_blocks(ms.fusion[0])) for ms in m.blocks)


def _refuse_inputs(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[int, int]:
    size = check_batch(images, label_map, (1, 1))
    if label_map.token_space:
        raise ValueError(
            "a token-space map (MixToken) mixes the patch embeddings of one patch grid, but CrossViT embeds the "
            f"image twice, on {len(m.patch_embed)} grids (patch sizes {[e.patch_size for e in m.patch_embed]}); "
            "mix the pixels instead (CutMix, RandomPatchMix, TokenMix ...)"
        )
    if size != tuple(m.img_size):
        raise ValueError(f"CrossViT takes {m.img_size[0]}x{m.img_size[1]} images only, got {size[0]}x{size[1]}")
    return size


def _qkv(attn: Any, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = rearrange(attn.qkv(x), "b n (three h d) -> three b h n d", three=3, h=attn.num_heads)
    return attn.q_norm(q), attn.k_norm(k), v


def _attn_out(attn: Any, out: Tensor) -> Tensor:
    return attn.proj_drop(attn.proj(attn.norm(rearrange(out, "b h n d -> b n (h d)"))))  # type: ignore[no-any-return]


def _cross_scores(attn: Any, x: Tensor) -> tuple[Tensor, Tensor]:
    """timm's ``CrossAttention``: the class token's softmax row ``(b, h, 1, n)`` and the values."""
    q = rearrange(attn.wq(x[:, :1]), "b one (h d) -> b h one d", h=attn.num_heads)
    k, v = (rearrange(lin(x), "b n (h d) -> b h n d", h=attn.num_heads) for lin in (attn.wk, attn.wv))
    return ((q @ k.transpose(-2, -1)) * attn.scale).softmax(dim=-1), v


def _cross_out(attn: Any, a: Tensor, v: Tensor) -> Tensor:
    return attn.proj_drop(attn.proj(rearrange(attn.attn_drop(a) @ v, "b h one d -> b one (h d)")))  # type: ignore[no-any-return]


def _heads(m: Any, xs: list[Tensor]) -> Tensor:
    """Every patch token through its branch's classifier: ``(b, n_0 + n_1, classes)``."""
    return torch.cat([head(m.head_drop(x[:, 1:])) for head, x in zip(m.head, xs)], dim=1)


class AdaptedCrossViT(AdaptedBase):
    """A timm CrossViT returning the scheme's aligned targets (the two class tokens' labels averaged)."""

    family = CROSSVIT_FAMILY
    refusal = staticmethod(_crossvit_refusal)

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        size = _refuse_inputs(m, images, label_map)
        start, sizes = _start(m, label_map, size)
        segs = _segments(sizes)
        tracker = self.scheme.start(label_map, start.layout)
        tracker.aggregate(start.merge)
        xs = m._embed(images)
        base = 0
        for ms in m.blocks:
            outs = []
            for d, seq in enumerate(ms.blocks):
                x = xs[d]
                for j, blk in enumerate(seq):
                    x = through_hooks(blk, functools.partial(self._block, blk, layer=base + j, tracker=tracker, seg=segs[d]), x)
                outs.append(x)
            base += max(len(seq) for seq in ms.blocks)
            xs, base = self._fuse(ms, outs, base, tracker, segs, start), base + len(_fusion_blocks(ms.fusion[0]))
        xs = [norm(x) for norm, x in zip(m.norm, xs)]
        tracker.aggregate(lambda y: self._readout_merge(y, segs))
        tracker.pool("token", 0)
        output = m.forward_head(xs)
        token_logits = _heads(m, xs) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def _readout_merge(self, y: Tensor, segs: list[tuple[int, int]]) -> Tensor:
        """``[read, read, patches_0, patches_1]``: the prefix rows become the branches' readouts summed
        (renormalised after: their average), the class rows go."""
        reads_token = self.model.global_pool == "token"
        read = sum(y[:, first] if reads_token else y[:, first + 1 : end].mean(dim=1) for first, end in segs)
        assert isinstance(read, Tensor)
        patches = [y[:, first + 1 : end] for first, end in segs]  # the class rows go: token targets are patches'
        return torch.cat([read[:, None], read[:, None], *patches], dim=1)

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        m: Any = self.model
        return tuple(blk for ms in m.blocks for seq in ms.blocks for blk in seq)  # the fusion (cross-attention) blocks: the root's

    def _block(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker, seg: tuple[int, int]) -> Tensor:
        y, mixed = tracker.labels_for(layer), None
        attn = blk.attn
        q, k, v = _qkv(attn, blk.norm1(x))
        dropout_p = attn.attn_drop.p if attn.training else 0.0
        if not attn.fused_attn:
            a = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)  # timm's explicit path
            if y is not None:
                with fp32_labels(y.device):
                    mixed = a.detach().float().mean(dim=1) @ y[:, seg[0] : seg[1]]
            out = attn.attn_drop(a) @ v
        elif y is not None:
            out, mixed = attention_with_labels(q, k, v, y[:, seg[0] : seg[1]], attn.scale, dropout_p)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        out, keep = branch(blk.drop_path1, blk.ls1(_attn_out(attn, out)))
        if y is not None and mixed is not None:
            mixed = torch.cat([y[:, : seg[0]], mixed, y[:, seg[1] :]], dim=1)  # the other branch: unchanged
        tracker.residual(layer, keep, mixed=mixed)
        x = x + out
        out, keep = branch(blk.drop_path2, blk.ls2(blk.mlp(blk.norm2(x))))
        tracker.residual(layer, keep, mixed=None)  # channel mixing
        return x + out

    def _fuse(self, ms: Any, outs: list[Tensor], base: int, tracker: LabelTracker, segs: list[tuple[int, int]],
              start: _Start) -> list[Tensor]:  # fmt: skip
        """The fusion: each branch's class token attends to the other branch's patches."""
        fused, rows = [], []
        wanted = [base + f for f in range(len(_fusion_blocks(ms.fusion[0]))) if tracker.wants_class_attention(base + f)]
        for i, (proj, fusion, revert) in enumerate(zip(ms.projs, ms.fusion, ms.revert_projs)):
            j = (i + 1) % 2
            seq = torch.cat([proj(outs[i][:, :1]), outs[j][:, 1:]], dim=1)
            for f, blk in enumerate(_fusion_blocks(fusion)):
                layer = base + f
                y = tracker.labels_for(layer)
                a, v = _cross_scores(blk.attn, blk.norm1(seq))  # b h 1 n
                mean = a.detach().float().mean(dim=1)  # b 1 n
                out, keep = branch(blk.drop_path, _cross_out(blk.attn, a, v))
                if f == 0 and wanted:  # later fusion blocks attend to the class token alone
                    rows.append(start.spread(mean[:, 0, 1:], j))
                mixed = None
                if y is not None:
                    (ci, _), (cj, ej) = segs[i], segs[j]
                    source = torch.cat([y[:, ci : ci + 1], y[:, cj + 1 : ej]], dim=1) if f == 0 else y[:, ci : ci + 1]
                    with fp32_labels(y.device):
                        cls = mean[..., : source.shape[1]] @ source  # b 1 l
                    mixed = torch.cat([y[:, :ci], cls, y[:, ci + 1 :]], dim=1)
                tracker.residual(layer, keep, mixed=mixed)
                seq = seq[:, :1] + out
            fused.append(torch.cat([revert(seq), outs[i][:, 1:]], dim=1))
        if rows:
            tracker.class_attention(wanted[0], self._class_row(rows))
        return fused

    @staticmethod
    def _class_row(rows: list[Tensor]) -> Tensor:
        pixels = torch.stack(rows).mean(dim=0)  # b h*w: the branches averaged, as their logits are
        return torch.cat([pixels.new_zeros(pixels.shape[0], 2), pixels], dim=1)  # the prefix rows: never read

    # ------------------------------------------------------------------------------------------ reference
    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit ``(n, n)`` matrices on the whole label sequence; the starts built as 2-D matrices
        (resampling every pixel's basis image in 2-D, convs by ``conv_matrix``)."""
        m: Any = self.model
        size = _refuse_inputs(m, images, label_map)
        rules = DenseRules(self.scheme, label_map, size, 2, _depth(m), class_token=True)
        starts = [self._start_2d(m, i, size) for i in range(2)]
        sizes = [int(s.shape[0]) for s in starts]
        segs = _segments(sizes)
        n_pix, total = size[0] * size[1], segs[-1][1]
        merge = torch.zeros(total, 2 + n_pix, dtype=torch.float64)
        merge[0, 0] = merge[1, 1] = 1.0
        for i, ((first, end), start) in enumerate(zip(segs, starts)):
            merge[first, i] = 1.0  # cls_i: the image target
            merge[first + 1 : end, 2:] = start
        rules.aggregate(merge)
        xs = m._embed(images)
        base = 0
        for ms in m.blocks:
            outs = []
            for d, seq in enumerate(ms.blocks):
                x, (first, end) = xs[d], segs[d]
                for j, blk in enumerate(seq):
                    attn = blk.attn
                    q, k, v = _qkv(attn, blk.norm1(x))
                    a = torch.softmax(q @ k.transpose(-2, -1) * attn.scale, dim=-1)  # b h n n
                    out, keep = _drop(blk.drop_path1, blk.ls1(_attn_out(attn, F.dropout(a, attn.attn_drop.p, attn.training) @ v)))
                    matrix = torch.eye(total, dtype=torch.float64).repeat(x.shape[0], 1, 1)
                    matrix[:, first:end, first:end] = a.detach().double().mean(dim=1)
                    rules.mix(base + j, matrix, keep)
                    x = x + out
                    x = x + _drop(blk.drop_path2, blk.ls2(blk.mlp(blk.norm2(x))))[0]
                outs.append(x)
            base += max(len(seq) for seq in ms.blocks)
            fused, rows = [], []
            wanted = any(rules.wants_class_attention(base + f) for f in range(len(_fusion_blocks(ms.fusion[0]))))
            for i, (proj, fusion, revert) in enumerate(zip(ms.projs, ms.fusion, ms.revert_projs)):
                j = (i + 1) % 2
                seq_x = torch.cat([proj(outs[i][:, :1]), outs[j][:, 1:]], dim=1)
                cols = [segs[i][0]] + list(range(segs[j][0] + 1, segs[j][1]))
                for f, blk in enumerate(_fusion_blocks(fusion)):
                    a, v = _cross_scores(blk.attn, blk.norm1(seq_x))
                    out, keep = _drop(blk.drop_path, _cross_out(blk.attn, a, v))
                    matrix = torch.eye(total, dtype=torch.float64).repeat(seq_x.shape[0], 1, 1)
                    matrix[:, segs[i][0]] = 0.0
                    matrix[:, segs[i][0], cols[: seq_x.shape[1]]] = a.detach().double().mean(dim=1)[:, 0]
                    rules.mix(base + f, matrix, keep)
                    if f == 0 and wanted:
                        patches = a.detach().double().mean(dim=1)[:, 0, 1:]
                        rows.append((patches / patches.sum(-1, keepdim=True)) @ starts[j])  # b h*w
                    seq_x = seq_x[:, :1] + out
                fused.append(torch.cat([revert(seq_x), outs[i][:, 1:]], dim=1))
            if rows:
                pixels = torch.stack(rows).mean(dim=0)
                rules.attend_class(torch.cat([pixels.new_zeros(pixels.shape[0], 2), pixels], dim=1))
            xs, base = fused, base + len(_fusion_blocks(ms.fusion[0]))
        xs = [norm(x) for norm, x in zip(m.norm, xs)]
        readout = torch.zeros(2 + sum(sizes), total, dtype=torch.float64)  # [read, read, patches_0, patches_1]
        row = 2
        for first, end in segs:
            if m.global_pool == "token":
                readout[:2, first] = 1.0
            else:
                readout[:2, first + 1 : end] = 1.0 / (end - first - 1)
            readout[row : row + end - first - 1, first + 1 : end] = torch.eye(end - first - 1, dtype=torch.float64)
            row += end - first - 1
        rules.aggregate(readout)
        output = m.forward_head(xs)
        token_logits = _heads(m, xs) if self.scheme.needs_token_logits else None
        return rules.result(output, output, "token", token_logits)

    @staticmethod
    def _start_2d(m: Any, i: int, size: tuple[int, int]) -> Tensor:
        """Branch ``i``'s ``(p*q, h*w)`` pixels-to-patches matrix, written out in 2-D."""
        scaled = tuple(m.img_size_scaled[i])
        basis = rearrange(torch.eye(size[0] * size[1], dtype=torch.float64), "n (h w) -> n 1 h w", h=size[0])
        if scaled == size:
            resampled = basis
        elif m.crop_scale and scaled[0] <= size[0] and scaled[1] <= size[1]:
            top, left = int(round((size[0] - scaled[0]) / 2.0)), int(round((size[1] - scaled[1]) / 2.0))
            resampled = basis[:, :, top : top + scaled[0], left : left + scaled[1]]
        else:
            resampled = F.interpolate(basis, size=scaled, mode="bicubic", align_corners=False)
        matrix = row_normalise(rearrange(resampled, "n 1 h w -> (h w) n").abs())  # scaled pixels x pixels
        grid = scaled
        for conv in _stem_convs(m.patch_embed[i]):
            window, grid = conv_matrix(grid, torch.ones(conv.kernel_size), conv.stride, conv.padding)
            matrix = row_normalise(window) @ matrix
        return matrix


FAMILY = Family(
    name="crossvit",
    description=CROSSVIT_FAMILY,
    refusal=AdaptedCrossViT.refusal,
    build=AdaptedCrossViT,
    example=tiny(CrossVit, img_size=32, img_scale=(1.0, 0.75), patch_size=(4, 8), embed_dim=(16, 32),
        depth=((1, 1, 0),), num_heads=(2, 2), mlp_ratio=(2, 2, 1)),
    timm_modules=("crossvit",),
    speed_model="crossvit_tiny_240",
    class_token=True,
)
