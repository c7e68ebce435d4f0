"""Adapter for timm's MViTv2: pooling attention, query pooling into coarser grids, decomposed rel-pos bias.

TL-Align Table 10 and Appendix D extended by the same reasoning as for PVT v2's
spatial-reduction attention and Swin's patch merging. Events per block ``layer`` (blocks
counted over all stages), ``Y = labels_for(layer)`` on the block's input grid:

- attention: ``q``, ``k``, ``v`` are pooled from the grid by ``pool_q``/``pool_k``/``pool_v``
  (a depthwise conv, or a max/avg pool; the class token, if any, passes unpooled). The
  value tokens' labels are pooled as the values are: a strided pool or conv (and any max
  or average pool) aggregates, ``Norm(sum_i Y_i)`` over each window (a max picks one tap
  per channel, different taps for different channels: the window as a whole is what it
  reads); a stride-1 depthwise conv mixes by its normalised absolute kernel averaged over
  channels (``apply_path``, as ConvNeXt's). The attention ``A`` (softmax of ``q k^T * scale``
  plus the decomposed relative position bias, timm's own ``cal_rel_pos_type``) mixes those:
  ``mean_h(A_h) Y_kv``, one row per pooled query. With ``residual_pooling`` the branch adds
  the pooled query ``q``, whose labels ``Y_q`` are ``Y`` pooled by ``pool_q`` the same way; the
  branch's rows are the two row-stochastic mixes' normalised sum ``(mean_h(A_h) Y_kv + Y_q) / 2``.
  Keys and queries only set the weights (as in every attention).
- the shortcut of a block with query stride is timm's ``shortcut_pool_attn`` max pool (window
  ``stride + 1``): ``aggregate`` sums the labels under its windows, so the residual
  ``residual(layer, keep, mixed=...)`` (with stochastic depth's keep) combines labels on the
  coarser grid; ``shortcut_proj_attn``/``shortcut_proj_mlp`` and the norms are channel ops.
- MLP: ``residual(layer, keep, mixed=None)``.
- patch embedding (7x7 stride 4 padding 3, overlapping): labels start on the pixels and are
  summed under every window (as PVT v2's); a MixToken map starts on the patch grid.
- readout: ``pool("mean", p)`` for ``global_pool="avg"``; the class token for ``"token"``.
  TransMix reads a class token's attention over the patch grid's area weights; MViTv2 pools
  the keys, so it is refused (TLAlign aligns the class token's labels instead).

Shapes: ``b`` batch, ``h`` heads, ``n`` tokens, ``m`` pooled keys, ``d`` head dim, ``l`` label channels.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from einops import rearrange
from timm.models.mvitv2 import MultiScaleAttention, MultiScaleBlock, MultiScaleVit, cal_rel_pos_type, reshape_post_pool, reshape_pre_pool
from torch import Tensor, nn

from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import AdaptedBase, branch, explicit_mix, mean_pool_merge, mix_token_space, start_on_convs
from mixlabels.backbones._dense import DenseRules, conv_matrix, kernel_reference, row_normalise
from mixlabels.backbones._dense import drop_path_reference as _drop
from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap, TokenLayout
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._windows import window_means
from mixlabels.backbones._fsdp import through_hooks
from mixlabels.backbones._convnet import Kernels, apply_path, read_kernels
from timm.models.mvitv2 import MultiScaleVitCfg

__all__ = ["AdaptedMViTv2", "MVITV2_FAMILY", "pooled_labels"]

MVITV2_FAMILY = (
    "timm MultiScaleVit (MViTv2, with or without class token): pooling attention (keys/values pooled by strided "
    "depthwise conv or max/avg pool: their labels aggregated, a stride-1 conv as normalised-absolute-kernel mix), "
    "decomposed relative position bias in the softmax, residual pooling, query pooling with the max-pooled shortcut "
    "as aggregation; overlapping patch embedding as aggregation; average or class-token readout; stochastic depth"
)

_POOLS = (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _pool_why(op: Any, what: str) -> str | None:
    if op is None:
        return None
    if type(op) not in _POOLS:
        return f"{what} is {type(op).__name__}; only nn.Conv2d, nn.MaxPool2d and nn.AvgPool2d pool tokens here"
    if type(op) is nn.Conv2d and (op.groups != op.in_channels or isinstance(op.padding, str) or op.padding_mode != "zeros"):
        return f"{what} must be a depthwise nn.Conv2d with static zero padding"
    if type(op) is not nn.Conv2d and (op.ceil_mode or _pair(getattr(op, "dilation", 1)) != (1, 1)):
        return f"{what} uses ceil_mode or dilation; only floor-mode undilated pools are supported"
    return None


def _mvitv2_refusal(model: nn.Module) -> str | None:
    if type(model) is not MultiScaleVit:
        return f"{type(model).__name__} is not a timm MultiScaleVit"
    m: Any = model
    if m.global_pool not in ("avg", "token"):
        return f"global_pool={m.global_pool!r} has no label readout; use 'avg' or 'token'"
    proj = m.patch_embed.proj
    if type(proj) is not nn.Conv2d or isinstance(proj.padding, str) or proj.padding_mode != "zeros" or proj.groups != 1:
        return "the patch embedding must be a plain nn.Conv2d with static zero padding"
    for i, stage in enumerate(m.stages):
        for j, blk in enumerate(stage.blocks):
            where = f"stage {i} block {j}"
            if type(blk) is not MultiScaleBlock:
                return f"{where} is {type(blk).__name__}, not a MultiScaleBlock"
            if type(blk.attn) is not MultiScaleAttention:
                return (f"{where}'s attention is {type(blk.attn).__name__} (pool_first=True: q, k, v pooled before their "
                        "projection) and is not supported; use pool_first=False")
            if blk.attn.unshared:
                return f"{where} uses mode='conv_unshared'; only 'conv', 'max' and 'avg' pooling are supported"
            for name in ("pool_q", "pool_k", "pool_v"):
                why = _pool_why(getattr(blk.attn, name), f"{where}'s {name}")
                if why is not None:
                    return why
            why = _pool_why(blk.shortcut_pool_attn, f"{where}'s shortcut pool")
            if why is not None:
                return why
    return None


def pooled_labels(
    op: Any, labels: Tensor, grid: tuple[int, int], prefix: int, kernels: Kernels | None = None
) -> tuple[Tensor, tuple[int, int]]:
    """Labels ``(b, p + h*w, l)`` of the tokens ``op`` pools from ``grid`` (prefix tokens pass), rows normalised.

    A stride-1 conv mixes by its normalised absolute kernel (``apply_path``: read from ``kernels`` where they hold
    it, else computed here); any other pool or conv sums each window (padding adds nothing) and renormalises.
    ``op=None``: the labels unchanged.
    """
    if op is None:
        return labels, grid
    tokens = labels[:, prefix:]
    if type(op) is nn.Conv2d and op.stride == (1, 1):
        mixed, out = apply_path((op,), tokens, grid, kernels)[0], grid
    else:
        mixed, out = window_means(tokens, grid, _pair(op.kernel_size), _pair(op.stride), _pair(op.padding))
    return torch.cat([labels[:, :prefix].float(), mixed.float()], dim=1), out


def _label_pools(attn: Any) -> list[nn.Conv2d]:
    """The stride-1 conv pools whose kernels mix an attention's labels (``pooled_labels``): v's, and q's where the
    pooled q is added back (``residual_pooling``)."""
    ops = (attn.pool_v, attn.pool_q if attn.residual_pooling else None)
    return [op for op in ops if type(op) is nn.Conv2d and op.stride == (1, 1)]


def _pool(attn: Any, t: Tensor, op: Any, norm: Any, feat: tuple[int, int]) -> tuple[Tensor, tuple[int, int]]:
    """timm's pooling of q, k or v ``(b, h, n, d)``: reshape, pool, reshape, norm."""
    size = feat
    if op is not None:
        t, tok = reshape_pre_pool(t, list(feat), attn.has_cls_token)
        t, pooled = reshape_post_pool(op(t), attn.num_heads, tok)
        size = (int(pooled[0]), int(pooled[1]))
    return (t if norm is None else norm(t)), size


def _check_rel_pos(attn: Any, q_size: tuple[int, int], k_size: tuple[int, int]) -> None:
    """Refuse a query grid whose relative positions reach past the tables timm sized from ``img_size`` (timm's
    ``cal_rel_pos_type`` would fail with an IndexError deep inside)."""
    for q, k, table, axis in ((q_size[0], k_size[0], attn.rel_pos_h, "height"), (q_size[1], k_size[1], attn.rel_pos_w, "width")):
        reach = int((q - 1) * max(k / q, 1.0) + (k - 1) * max(q / k, 1.0))  # cal_rel_pos_type's largest distance index
        if reach >= int(table.shape[0]):
            raise ValueError(
                f"a {q_size[0]}x{q_size[1]} query grid over {k_size[0]}x{k_size[1]} keys needs {reach + 1} relative "
                f"positions along the {axis}, but this MViTv2 has {int(table.shape[0])}: timm sizes them from img_size at "
                "construction; feed images of the model's img_size, or create the model with img_size set to yours"
            )


def _scores(attn: Any, x: Tensor, feat: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor, tuple[int, int]]:
    """timm's ``MultiScaleAttention`` up to the softmax: weights ``(b, h, n_q, m)``, pooled q, v, and the q grid."""
    q, k, v = rearrange(attn.qkv(x), "b n (three h d) -> three b h n d", three=3, h=attn.num_heads)
    q, q_size = _pool(attn, q, attn.pool_q, attn.norm_q, feat)
    k, k_size = _pool(attn, k, attn.pool_k, attn.norm_k, feat)
    v, _ = _pool(attn, v, attn.pool_v, attn.norm_v, feat)
    a = (q * attn.scale) @ k.transpose(-2, -1)
    if attn.rel_pos_type == "spatial":
        _check_rel_pos(attn, q_size, k_size)
        a = cal_rel_pos_type(a, q, attn.has_cls_token, list(q_size), list(k_size), attn.rel_pos_h, attn.rel_pos_w)
    return a.softmax(dim=-1), q, v, q_size


def _embed(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int], tuple[int, int]]:
    """Patch tokens (with class token and position embedding) ``(b, p + n, c)``, the patch grid, the start grid."""
    proj = m.patch_embed.proj
    grid = check_batch(images, label_map, tuple(proj.stride))
    x = proj(images)  # b c h w
    if (int(x.shape[2]), int(x.shape[3])) != grid:
        raise ValueError(f"the patch embedding made a {tuple(x.shape[2:])} grid, not {grid}; use an image size divisible by {proj.stride[0]}")
    start = (label_map.image_size[0], label_map.image_size[1])
    if label_map.token_space:
        x, start = mix_token_space(x, label_map, channels_last=False), grid
    x = rearrange(x, "b c h w -> b (h w) c")
    if m.cls_token is not None:
        x = torch.cat((m.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
    if m.pos_embed is not None:
        x = x + m.pos_embed
    return x, grid, start


def _refuse_class_attention(wants: bool) -> None:
    if wants:
        raise ValueError(
            "this scheme's target reads the class token's attention over the patch grid's area weights (TransMix), "
            "but MViTv2 pools the keys, so that row is over a coarser grid with no area weights; use TLAlign() or NoAlign()"
        )


def _readout(m: Any) -> tuple[str, int]:
    return ("token", 0) if m.global_pool == "token" else ("mean", m.num_prefix_tokens)


def _token_logits(m: Any, x: Tensor) -> Tensor:
    return m.head(x[:, m.num_prefix_tokens :])  # type: ignore[no-any-return]


class AdaptedMViTv2(AdaptedBase):
    """A timm MViTv2 returning the scheme's aligned targets."""

    family = MVITV2_FAMILY
    refusal = staticmethod(_mvitv2_refusal)

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        p = m.num_prefix_tokens
        depth = sum(len(stage.blocks) for stage in m.stages)
        # pixel labels summed over every patch-embedding window; the class token passes
        tracker = start_on_convs(self.scheme, label_map, start, grid, depth, [m.patch_embed.proj], p, m.global_pool == "token")
        _refuse_class_attention(any(tracker.wants_class_attention(i) for i in range(depth)))
        kernels = read_kernels([blk for stage in m.stages for blk in stage.blocks], tracker, lambda blk: _label_pools(blk.attn))
        layer = 0
        for stage in m.stages:
            for blk in stage.blocks:
                step = functools.partial(self._block, blk, layer=layer, tracker=tracker, grid=grid, p=p, kernels=kernels)
                x, grid = through_hooks(blk, step, x)
                layer += 1
        x = m.norm(x)
        how, first = _readout(m)
        tracker.pool("token" if how == "token" else "mean", first)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        m: Any = self.model
        return tuple(blk for stage in m.stages for blk in stage.blocks)

    @staticmethod
    def _block(
        blk: Any, x: Tensor, layer: int, tracker: LabelTracker, grid: tuple[int, int], p: int, kernels: Kernels | None
    ) -> tuple[Tensor, tuple[int, int]]:
        attn, labels, mixed = blk.attn, tracker.labels_for(layer), None
        x_norm = blk.norm1(x)
        shortcut = blk._shortcut_pool(x if blk.shortcut_proj_attn is None else blk.shortcut_proj_attn(x_norm), list(grid))
        a, q, v, q_size = _scores(attn, x_norm, grid)
        out = a @ v
        if attn.residual_pooling:
            out = out + q
        out = attn.proj(rearrange(out, "b h n d -> b n (h d)"))
        if labels is not None:
            mixed = explicit_mix(a, pooled_labels(attn.pool_v, labels, grid, p, kernels)[0])
            if attn.residual_pooling:
                mixed = (mixed + pooled_labels(attn.pool_q, labels, grid, p, kernels)[0]) / 2
        if blk.shortcut_pool_attn is not None:
            op = blk.shortcut_pool_attn
            merge, _ = mean_pool_merge(grid, _pair(op.kernel_size), _pair(op.stride), _pair(op.padding))
            tracker.aggregate(lambda y: torch.cat([y[:, :p], merge(y[:, p:])], dim=1), normalised=True)
        out, keep = branch(blk.drop_path1, out)
        tracker.residual(layer, keep, mixed=mixed)
        x = shortcut + out
        x_norm = blk.norm2(x)
        shortcut = x if blk.shortcut_proj_mlp is None else blk.shortcut_proj_mlp(x_norm)
        out, keep = branch(blk.drop_path2, blk.mlp(x_norm))
        tracker.residual(layer, keep, mixed=None)  # channel mixing
        return shortcut + out, q_size

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """timm's attention modules for the output; explicit pooling, attention and merge matrices on dense labels."""
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        p = m.num_prefix_tokens
        depth = sum(len(stage.blocks) for stage in m.stages)
        rules = DenseRules(self.scheme, label_map, start, p, depth, class_token=m.global_pool == "token")
        _refuse_class_attention(any(rules.wants_class_attention(i) for i in range(depth)))
        if start != grid:
            proj = m.patch_embed.proj
            rules.aggregate(_with_prefix(conv_matrix(start, torch.ones(proj.kernel_size), proj.stride, proj.padding)[0], p))
        layer = 0
        for stage in m.stages:
            for blk in stage.blocks:
                attn = blk.attn
                x_norm = blk.norm1(x)
                shortcut = blk._shortcut_pool(x if blk.shortcut_proj_attn is None else blk.shortcut_proj_attn(x_norm), list(grid))
                with torch.no_grad():  # first: it refuses a grid the relative positions do not reach
                    a = _scores(attn, x_norm, grid)[0].double().mean(dim=1)  # b n_q m
                out, q_size = attn(x_norm, list(grid))  # timm's own attention
                matrix = a @ _pool_matrix(attn.pool_v, grid, p)
                if attn.residual_pooling:
                    matrix = (matrix + _pool_matrix(attn.pool_q, grid, p)) / 2
                mixed = matrix @ rules.y
                if blk.shortcut_pool_attn is not None:
                    op = blk.shortcut_pool_attn
                    rules.aggregate(_with_prefix(conv_matrix(grid, torch.ones(_pair(op.kernel_size)), _pair(op.stride), _pair(op.padding))[0], p))
                out, keep = _drop(blk.drop_path1, out)
                if rules.rules.wants_labels(layer):  # the branch maps the fine grid to the coarse one
                    rules.y = rules.rules.residual(rules.y, mixed, keep)
                x = shortcut + out
                x_norm = blk.norm2(x)
                shortcut = x if blk.shortcut_proj_mlp is None else blk.shortcut_proj_mlp(x_norm)
                x = shortcut + _drop(blk.drop_path2, blk.mlp(x_norm))[0]
                grid = (int(q_size[0]), int(q_size[1]))
                layer += 1
        x = m.norm(x)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        how, first = _readout(m)
        return rules.result(output, output, "token" if how == "token" else "mean", token_logits, first)


def _with_prefix(matrix: Tensor, p: int) -> Tensor:
    """A grid matrix ``(n', n)`` extended by ``p`` prefix tokens that map to themselves."""
    out = torch.zeros(p + matrix.shape[0], p + matrix.shape[1], dtype=matrix.dtype)
    out[:p, :p] = torch.eye(p, dtype=matrix.dtype)
    out[p:, p:] = matrix
    return out


def _pool_matrix(op: Any, grid: tuple[int, int], p: int) -> Tensor:
    """The explicit row-normalised ``(p + n', p + n)`` matrix of a q/k/v pooling op (identity for none)."""
    if op is None:
        return torch.eye(p + grid[0] * grid[1], dtype=torch.float64)
    if type(op) is nn.Conv2d and op.stride == (1, 1):
        kernel = kernel_reference(op.weight)
        matrix = conv_matrix(grid, kernel, padding=_pair(op.padding), dilation=_pair(op.dilation))[0]
    else:
        matrix = conv_matrix(grid, torch.ones(_pair(op.kernel_size)), _pair(op.stride), _pair(op.padding))[0]
    return _with_prefix(row_normalise(matrix), p)


FAMILY = Family(
    name="mvitv2",
    description=MVITV2_FAMILY,
    refusal=AdaptedMViTv2.refusal,
    build=AdaptedMViTv2,
    example=tiny(MultiScaleVit, img_size=32, cfg=MultiScaleVitCfg(depths=(1, 1), embed_dim=16, num_heads=1, stride_kv_adaptive=(2, 2))),
    timm_modules=("mvitv2",),
    speed_model="mvitv2_tiny",
)
