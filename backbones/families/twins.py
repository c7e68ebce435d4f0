"""Adapter for timm's Twins (PCPVT and SVT): locally-grouped and global sub-sampled attention, PEG.

TL-Align Table 10 and Appendix D extended by the reasoning used for PVT v2 and Swin.
Events per block ``layer`` (blocks counted over all stages):

- LSA (``LocallyGroupedAttn``, SVT's even blocks): attention inside non-overlapping
  ``ws x ws`` windows; ``residual(layer, keep, mixed=mean_h(A_h) Y)`` computed window by window.
  timm pads the grid at the right and bottom with zero tokens that take part in the softmax
  (they are keys, with the qkv bias as content) and are cropped afterwards: they carry no
  label, so every row is renormalised over the real tokens (border-aware, as ``conv_mix``);
- GSA (``GlobalSubSampleAttn``, PCPVT's blocks and SVT's odd blocks): keys and values come
  from a ``sr_ratio`` strided, non-overlapping conv of the grid; each key's labels are the
  average of its window's (PVT v2's spatial reduction), then ``mean_h(A_h) Y_kv``;
- MLP: ``residual(layer, keep, mixed=None)`` (channel mixing);
- PEG (``PosConv`` after the first block of every stage): ``x + dwconv3x3(x)``, a residual
  whose branch is a depthwise conv: ``residual(layer, None, mixed=Norm(T(K)) Y)`` with the
  channel-averaged normalised absolute kernel (``backbones._common.conv_mix``), counted in
  the first block's ``layer``;
- patch embeddings (``kernel = stride`` convs, 4 then 2 per stage): the first stage's labels
  start on its token grid (exact area fractions); later ones ``aggregate`` (sum over each
  window, renormalised);
- per-token LayerNorms, dropouts: channel ops; readout ``pool("mean", 0)`` (global average
  pooling; no class token: TransMix refuses).

Shapes: ``b`` batch, ``h w`` grid, ``nh nw`` windows, ``wh ww`` window size, ``n`` tokens,
``m`` reduced keys, ``c`` channels, ``l`` label channels.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.layers.mlp import Mlp
from timm.models.twins import Block, GlobalSubSampleAttn, LocallyGroupedAttn, PatchEmbed, PosConv, Twins
from torch import Tensor, nn

from mixlabels.backbones._attention import attention_with_labels
from mixlabels.backbones._checks import check_batch
from mixlabels._routes import eager_cpu_routes, eager_launch_routes
from mixlabels.backbones._convnet import Kernels
from mixlabels.backbones._common import AdaptedBase, branch, check_static_conv, conv_aggregate, conv_label_kernel, conv_mix, explicit_mix, mix_token_space, stride_grid
from mixlabels.backbones._dense import DenseRules, conv_matrix, kernel_reference, row_normalise, window_matrix
from mixlabels.backbones._dense import drop_path_reference as _drop
from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap, TokenLayout
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._fsdp import through_hooks

__all__ = ["AdaptedTwins", "TWINS_FAMILY"]

TWINS_FAMILY = (
    "timm Twins (PCPVT, SVT): locally-grouped window attention (rows renormalised over real tokens where timm "
    "pads), global sub-sampled attention with averaged reduced-key labels, PEG depthwise conv as a spatial mix, "
    "patch embeddings as aggregation; global average pooling; stochastic depth"
)

WINDOWS = "(b nh nw) (wh ww)"


def _twins_refusal(model: nn.Module) -> str | None:
    if type(model) is not Twins:
        return f"{type(model).__name__} is not a timm Twins"
    m: Any = model
    if m.global_pool != "avg":
        return f"global_pool={m.global_pool!r} has no label readout; use 'avg'"
    for i, embed in enumerate(m.patch_embeds):
        if type(embed) is not PatchEmbed:
            return f"stage {i}'s patch embedding is {type(embed).__name__}, not timm's twins PatchEmbed"
        why = check_static_conv(embed.proj, f"stage {i}'s patch embedding")
        if why is not None:
            return why
    for i, peg in enumerate(m.pos_block):
        if type(peg) is not PosConv or peg.stride != 1 or len(peg.proj) != 1:
            return f"stage {i}'s position block is not timm's stride-1 PosConv (a single depthwise conv)"
        why = check_static_conv(peg.proj[0], f"stage {i}'s PosConv", depthwise=True)
        if why is not None:
            return why
    for i, stage in enumerate(m.blocks):
        for j, blk in enumerate(stage):
            attn: Any = getattr(blk, "attn", None)  # timm types Block.attn as the ViT Attention it may hold
            if type(blk) is not Block or type(attn) not in (LocallyGroupedAttn, GlobalSubSampleAttn) or type(blk.mlp) is not Mlp:
                return (
                    f"stage {i} block {j} is not timm's twins Block with LocallyGroupedAttn or GlobalSubSampleAttn "
                    f"and an Mlp (got attention {type(attn).__name__}); build the model with "
                    "timm's Twins blocks"
                )
            if type(attn) is GlobalSubSampleAttn and attn.sr is not None:
                sr = attn.sr
                why = check_static_conv(sr, f"stage {i} block {j}'s sub-sampling conv")
                if why is None and (sr.kernel_size != sr.stride or sr.padding != (0, 0)):
                    why = f"stage {i} block {j}'s sub-sampling conv overlaps (kernel != stride or padded)"
                if why is not None:
                    return why
    return None


def _padded(grid: tuple[int, int], ws: int) -> tuple[int, int]:
    return (-(-grid[0] // ws) * ws, -(-grid[1] // ws) * ws)


def _to_windows(t: Tensor, grid: tuple[int, int], ws: int) -> Tensor:
    """``(b, h*w, c)`` zero-padded at the right and bottom as timm does, then ``(b nh nw, ws*ws, c)``."""
    hp, wp = _padded(grid, ws)
    t = rearrange(t, "b (h w) c -> b h w c", h=grid[0])
    t = F.pad(t, (0, 0, 0, wp - grid[1], 0, hp - grid[0]))
    return rearrange(t, f"b (nh wh) (nw ww) c -> {WINDOWS} c", wh=ws, ww=ws)


def _from_windows(t: Tensor, grid: tuple[int, int], ws: int, b: int) -> Tensor:
    """``(b nh nw, ws*ws, c)`` back to ``(b, h*w, c)``, the padding cropped."""
    hp, _ = _padded(grid, ws)
    t = rearrange(t, f"{WINDOWS} c -> b (nh wh) (nw ww) c", b=b, nh=hp // ws, wh=ws)
    return rearrange(t[:, : grid[0], : grid[1]], "b h w c -> b (h w) c")


def _needs_mass(grid: tuple[int, int], ws: int, device: torch.device) -> bool:
    """Whether ``_lsa``'s labels carry one more channel that marks the real tokens (its mix is each row's real mass,
    which the mixed labels are divided by): where the windows pad the grid, so that padded keys take part in the
    softmax. On a grid the windows tile every row's mass is its softmax's sum, 1, and the channel, its concatenation
    and the division are left out (three operators a block; SVT-S at 224 px: 27), except on the CPU's eager route,
    whose bits the targets digest holds."""
    return _padded(grid, ws) != tuple(grid) or eager_cpu_routes(device)


def _lsa(attn: Any, x: Tensor, grid: tuple[int, int], labels: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """timm's ``LocallyGroupedAttn.forward`` and ``Norm_real(mean_h(A_h)) Y`` ``(b, n, l)`` (or ``None``)."""
    ws, b = attn.ws, x.shape[0]
    q, k, v = rearrange(attn.qkv(_to_windows(x, grid, ws)), "b n (three h d) -> three b h n d", three=3, h=attn.num_heads)
    y = None
    massed = labels is not None and _needs_mass(grid, ws, labels.device)
    if labels is not None:
        y = labels.float()
        if massed:
            y = torch.cat([y, labels.new_ones(labels.shape[0], labels.shape[1], 1)], dim=-1)
        y = _to_windows(y, grid, ws)
    mixed = None
    if attn.fused_attn:
        dropout_p = attn.attn_drop.p if attn.training else 0.0
        if y is not None:
            out, mixed = attention_with_labels(q, k, v, y, attn.scale, dropout_p)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    else:
        a = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        if y is not None:
            mixed = explicit_mix(a, y)
        out = attn.attn_drop(a) @ v
    out = _from_windows(rearrange(out, "b h n d -> b n (h d)"), grid, ws, b)
    out = attn.proj_drop(attn.proj(out))
    if mixed is not None:
        mixed = _from_windows(mixed, grid, ws, b)
        if massed:
            mixed = mixed[..., :-1] / mixed[..., -1:]
    return out, mixed


def _gsa_qkv(attn: Any, x: Tensor, grid: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
    """timm's ``GlobalSubSampleAttn.forward`` up to ``q, k, v`` ``(b, h, n|m, d)``."""
    q = rearrange(attn.q(x), "b n (h d) -> b h n d", h=attn.num_heads)
    if attn.sr is not None:
        x = attn.norm(rearrange(attn.sr(rearrange(x, "b (h w) c -> b c h w", h=grid[0])), "b c h w -> b (h w) c"))
    k, v = rearrange(attn.kv(x), "b m (two h d) -> two b h m d", two=2, h=attn.num_heads)
    return q, k, v


def _reduced_labels(attn: Any, labels: Tensor, grid: tuple[int, int]) -> Tensor:
    """The keys' labels: the average over each sub-sampling window ``(b, n, l) -> (b, m, l)``."""
    if attn.sr is None:
        return labels
    y = rearrange(labels, "b (h w) l -> b l h w", h=grid[0])
    return rearrange(F.avg_pool2d(y, attn.sr.kernel_size, attn.sr.stride), "b l h w -> b (h w) l")


def _gsa(attn: Any, x: Tensor, grid: tuple[int, int], labels: Tensor | None) -> tuple[Tensor, Tensor | None]:
    q, k, v = _gsa_qkv(attn, x, grid)
    y = _reduced_labels(attn, labels, grid) if labels is not None else None
    mixed = None
    if attn.fused_attn:
        dropout_p = attn.attn_drop.p if attn.training else 0.0
        if y is not None:
            out, mixed = attention_with_labels(q, k, v, y, attn.scale, dropout_p)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    else:
        a = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)  # b h n m
        if y is not None:
            mixed = explicit_mix(a, y)
        out = attn.attn_drop(a) @ v
    return attn.proj_drop(attn.proj(rearrange(out, "b h n d -> b n (h d)"))), mixed


def _embed(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int]]:
    """The first stage's tokens ``(b, n, c)`` (MixToken applied for a token-space map) and grid."""
    grid = check_batch(images, label_map, tuple(m.patch_embeds[0].proj.stride))
    x, _ = m.patch_embeds[0](images)
    if label_map.token_space:
        x = rearrange(mix_token_space(rearrange(x, "b (h w) c -> b h w c", h=grid[0]), label_map, channels_last=True), "b h w c -> b (h w) c")
    return m.pos_drops[0](x), grid


def _next_embed(m: Any, i: int, x: Tensor, grid: tuple[int, int]) -> tuple[Tensor, tuple[int, int]]:
    x, size = m.patch_embeds[i](rearrange(x, "b (h w) c -> b c h w", h=grid[0]))
    return m.pos_drops[i](x), (int(size[0]), int(size[1]))


def _peg(peg: Any, x: Tensor, grid: tuple[int, int]) -> Tensor:
    """timm's ``PosConv``: ``x + dwconv(x)`` on the grid."""
    out: Tensor = peg(x, grid)
    return out


def _peg_kernels(m: Any, device: torch.device) -> Kernels | None:
    """The position convs' label kernels of one forward, read together at the first stage that needs them (one
    ``label_kernels`` call: six operators for all stages, where each conv's ``kernel_labels`` took six), where every
    operator is a launch (a GPU's eager route, ``launch_routes``); ``None`` elsewhere: the CPU's eager route reads
    each conv's own (its bits, which the targets digest holds), and so does a compiled graph, whose compiler fuses
    each conv's reductions."""
    return Kernels([peg.proj[0] for peg in m.pos_block]) if eager_launch_routes(device) else None


class AdaptedTwins(AdaptedBase):
    """A timm Twins (PCPVT, SVT) whose forward also returns the scheme's aligned targets (pooled readout)."""

    family = TWINS_FAMILY
    refusal = staticmethod(_twins_refusal)

    def reference_grid(self, label_map: TokenLabelMap) -> tuple[int, int]:
        """The reference's labels start on the patch grid (see ``AdaptedBase.reference_bytes``)."""
        m: Any = self.model
        return stride_grid(label_map, tuple(m.patch_embeds[0].proj.stride))

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid = _embed(m, images, label_map)
        depth = sum(len(stage) for stage in m.blocks)
        tracker = self.scheme.start(label_map, TokenLayout(grid=grid, num_prefix=0, depth=depth, class_token=False))
        pegs = _peg_kernels(m, x.device)
        layer = 0
        for i, (stage, peg) in enumerate(zip(m.blocks, m.pos_block)):
            if i > 0:
                grid_in = grid
                grid = conv_aggregate(tracker, grid, m.patch_embeds[i].proj)
                x, _ = _next_embed(m, i, x, grid_in)
            for j, blk in enumerate(stage):
                x = through_hooks(blk, functools.partial(self._block, blk, layer=layer, tracker=tracker, grid=grid), x)
                if j == 0:
                    labels = tracker.labels_for(layer)
                    conv = peg.proj[0]
                    x = _peg(peg, x, grid)
                    if labels is not None:
                        kernel = conv_label_kernel(conv.weight) if pegs is None else pegs.label_kernel(conv)
                        tracker.residual(layer, None, mixed=conv_mix(labels, grid, kernel, conv.padding, conv.dilation))
                layer += 1
        x = m.norm(x)
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        token_logits = m.head(m.head_drop(x)) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        m: Any = self.model
        return tuple(blk for stage in m.blocks for blk in stage)  # the position convs (pos_block) stay with the root

    def _block(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker, grid: tuple[int, int]) -> Tensor:
        labels = tracker.labels_for(layer)
        mix = _lsa if type(blk.attn) is LocallyGroupedAttn else _gsa
        out, mixed = mix(blk.attn, blk.norm1(x), grid, labels)
        out, keep = branch(blk.drop_path1, out)
        tracker.residual(layer, keep, mixed=mixed)
        x = x + out
        out, keep = branch(blk.drop_path2, blk.mlp(blk.norm2(x)))
        tracker.residual(layer, keep, mixed=None)  # channel mixing
        return x + out

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit attention (windows scattered into ``(b, n, n)``), reduction, conv and merge matrices."""
        m: Any = self.model
        x, grid = _embed(m, images, label_map)
        depth = sum(len(stage) for stage in m.blocks)
        rules = DenseRules(self.scheme, label_map, grid, 0, depth)
        layer = 0
        for i, (stage, peg) in enumerate(zip(m.blocks, m.pos_block)):
            if i > 0:
                conv = m.patch_embeds[i].proj
                rules.aggregate(conv_matrix(grid, torch.ones(conv.kernel_size), conv.stride, conv.padding)[0])
                x, grid = _next_embed(m, i, x, grid)
            for j, blk in enumerate(stage):
                attn = blk.attn
                h = blk.norm1(x)
                if type(attn) is LocallyGroupedAttn:
                    out, matrix = _lsa_reference(attn, h, grid)
                else:
                    q, k, v = _gsa_qkv(attn, h, grid)
                    a = torch.softmax(q @ k.transpose(-2, -1) * attn.scale, dim=-1)  # b h n m
                    out = attn.proj_drop(attn.proj(rearrange(F.dropout(a, attn.attn_drop.p, attn.training) @ v, "b h n d -> b n (h d)")))
                    matrix = a.detach().double().mean(dim=1) @ _reduction_matrix(attn, grid)
                out, keep = _drop(blk.drop_path1, out)
                rules.mix(layer, matrix, keep)
                x = x + out
                x = x + _drop(blk.drop_path2, blk.mlp(blk.norm2(x)))[0]
                if j == 0:
                    conv = peg.proj[0]
                    kernel = kernel_reference(conv.weight)
                    rules.mix(layer, row_normalise(conv_matrix(grid, kernel, padding=conv.padding, dilation=conv.dilation)[0]), None)
                    x = _peg(peg, x, grid)
                layer += 1
        x = m.norm(x)
        output = m.forward_head(x)
        token_logits = m.head(m.head_drop(x)) if self.scheme.needs_token_logits else None
        return rules.result(output, output, "mean", token_logits)


def _lsa_reference(attn: Any, x: Tensor, grid: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """LSA with explicit softmax; the head-mean window matrices scattered over the padded grid, then
    restricted to the real tokens and row-normalised: ``(b, n, n)`` float64."""
    ws, b = attn.ws, x.shape[0]
    hp, wp = _padded(grid, ws)
    q, k, v = rearrange(attn.qkv(_to_windows(x, grid, ws)), "b n (three h d) -> three b h n d", three=3, h=attn.num_heads)
    a = torch.softmax(q @ k.transpose(-2, -1) * attn.scale, dim=-1)  # (b nh nw) h n n
    out = _from_windows(rearrange(F.dropout(a, attn.attn_drop.p, attn.training) @ v, "b h n d -> b n (h d)"), grid, ws, b)
    ids = rearrange(torch.arange(hp * wp).view(hp, wp), "(nh wh) (nw ww) -> (nh nw) (wh ww)", wh=ws, ww=ws)
    mean = rearrange(a.detach().double().mean(dim=1), "(b nw) n m -> b nw n m", b=b)
    full = window_matrix(mean, ids, hp * wp)
    real = torch.arange(hp * wp).view(hp, wp)[: grid[0], : grid[1]].flatten()
    return attn.proj_drop(attn.proj(out)), row_normalise(full[:, real][:, :, real])


def _reduction_matrix(attn: Any, grid: tuple[int, int]) -> Tensor:
    """``(m, n)`` rows on the simplex: which tokens every reduced key averages."""
    if attn.sr is None:
        return torch.eye(grid[0] * grid[1], dtype=torch.float64)
    return row_normalise(conv_matrix(grid, torch.ones(attn.sr.kernel_size), attn.sr.stride, attn.sr.padding)[0])


FAMILY = Family(
    name="twins",
    description=TWINS_FAMILY,
    refusal=AdaptedTwins.refusal,
    build=AdaptedTwins,
    example=tiny("twins_svt_small", depths=(2, 1), embed_dims=(16, 32), num_heads=(1, 2), mlp_ratios=(2, 2),
        wss=(4, 4), sr_ratios=(2, 1)),
    timm_modules=("twins",),
    speed_model="twins_svt_small",
)
