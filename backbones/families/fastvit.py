"""Adapter for timm's FastViT (``fastvit_*``, MobileCLIP's ``fastvit_mci*``): reparameterisable convs, RepMixer, attention.

TL-Align Table 10 and Appendix D, applied to FastViT's parts. A reparameterisable block (MobileOne's
kxk + 1x1 + identity branches, each with its batch norm; the large-kernel conv's 7x7 + 3x3) is,
once reparameterised, ONE convolution: its label rule is that conv's, with the kernel timm's own
``reparameterize`` would write (``_get_kernel_bias``: branches' kernels scaled by their norms'
``gamma / sqrt(running_var + eps)`` and summed, the identity as a centre tap; folded here with
``backbones._reparam``, the same sums, every norm's scale of a forward in one pass). The rule is then
the same for a model trained with branches and the same model reparameterised for inference.
The label kernels of a forward's convs (RepCPE, RepMixer, ConvMlp, the final conv) are computed
together (``_convnet.Kernels``).
Events, ``layer`` counting every RepCPE, RepMixer block and attention block:

- the stem (two 3x3 stride-2 MobileOne blocks, then a 1x1 one) and each stage's ``PatchEmbed``
  (a stride-2 large-kernel conv, then a 1x1 MobileOne block): strided windows ``aggregate``
  (the labels start on the pixels; a MixToken map starts on the stem's grid), 1x1s are channel ops.
- ``RepConditionalPosEnc``: ``x + pe(x)`` with a depthwise conv: ``residual`` with the conv's
  normalised |kernel| mix.
- ``RepMixer``: ``x + s * (mixer(x) - norm(x))``, both depthwise (``norm`` is the identity branch
  alone): the branch is one depthwise conv with kernel ``s (K_mixer - K_norm)``; per-channel
  ``s`` cancels in each channel's normalisation, so ``residual`` mixes by ``|K_mixer - K_norm|``.
- ``Attention`` (``AttentionBlock``, after a batch norm): ``mean_h(A_h) Y`` fused into the call.
- ``ConvMlp`` (every block's second branch): its depthwise 7x7 conv mixes (``residual`` with
  ``mixed``), its 1x1s are channel ops.
- ``final_conv`` (a depthwise 3x3 MobileOne block with squeeze-excite, no residual): the map is that
  conv's output, so the labels are its mix (``aggregate``).
- readout: ``pool("mean", 0)`` (global average pooling; no class token: TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` tokens, ``l`` label channels.
"""

from __future__ import annotations

from functools import partial
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.layers.classifier import ClassifierHead
from timm.layers.norm import LayerNorm2d
from timm.models.fastvit import (
    Attention,
    AttentionBlock,
    ConvMlp,
    FastVit,
    MobileOneBlock,
    PatchEmbed,
    RepConditionalPosEnc,
    RepMixer,
    RepMixerBlock,
    ReparamLargeKernelConv,
)
from torch import Tensor, nn

from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap
from mixlabels.backbones._attention import attention_with_labels, explicit_mix
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import (
    AdaptedBase,
    branch,
    check_static_conv,
    conv_aggregate,
    mix_token_space,
    start_on_convs,
)
from mixlabels.backbones._dense import DenseRules, conv_matrix, kernel_reference, row_normalise
from mixlabels.backbones._dense import drop_path_reference as _drop
from mixlabels.backbones._convnet import KernelBatch, KernelConv, Kernels, apply_path, fold_labels
from mixlabels.backbones._family import Family
from mixlabels.backbones._reparam import Scales, add_centre, folded, joined, parted, scales_of

__all__ = ["AdaptedFastViT", "FASTVIT_FAMILY", "fastvit_refusal", "tiny_fastvit", "fused_kernel", "identity_kernel"]

FASTVIT_FAMILY = (
    "timm FastViT (fastvit_*, MobileCLIP's fastvit_mci*): reparameterisable blocks by the kernel they reparameterise "
    "into (MobileOne, large-kernel convs); strided stem and patch-embedding convs as aggregation; RepMixer as a "
    "residual depthwise mix by |K_mixer - K_norm|; RepCPE and the ConvMlp depthwise convs as residual mixes; "
    "attention over the grid; the final depthwise conv as a mix; 1x1s, batch norms, SE, layer scale as channel ops; "
    "global average pooling; stochastic depth"
)


# ---------------------------------------------------------------------------------------------- kernels
def _conv_branches(b: Any) -> list[Any]:
    return [] if b.conv_kxk is None else list(b.conv_kxk)


def fused_norms(block: nn.Module) -> tuple[nn.Module, ...]:
    """The batch norms ``fused_kernel`` folds (none where the block is reparameterised)."""
    b: Any = block
    if b.reparam_conv is not None:
        return ()
    if type(block) is ReparamLargeKernelConv:
        small = getattr(b, "small_conv", None)  # timm sets it only with a small kernel
        return (b.large_conv.bn, *(() if small is None else (small.bn,)))
    return (*(c.bn for c in _conv_branches(b)), *(() if b.conv_scale is None else (b.conv_scale.bn,)),
            *(() if b.identity is None else (b.identity,)))


def fused_kernel(block: nn.Module, scales: Scales | None = None) -> Tensor:
    """The kernel a reparameterisable block (``MobileOneBlock``, ``ReparamLargeKernelConv``) is one conv with:
    its ``reparam_conv`` when reparameterised, else the branches fused as timm's ``reparameterize`` fuses them
    (``_get_kernel_bias``, ``get_kernel_bias``: the same sums in the same order; the bias is not needed).
    ``scales``: the norms' fold scales where computed together with others' (``_reparam``)."""
    s = scales_of(fused_norms(block)) if scales is None else scales
    return _fused_joined([block], s)


def _fused_joined(blocks: Sequence[nn.Module], s: Scales) -> Tensor:
    """``fused_kernel`` of blocks of one structure (``_structure``), joined along the output channels: the same
    elementwise operations on their weights and scales joined, so the same bits as one by one."""
    bs: list[Any] = list(blocks)
    b = bs[0]
    with torch.no_grad():
        if b.reparam_conv is not None:
            return joined([x.reparam_conv.weight for x in bs]).detach()

        def fold(branches: Sequence[Any]) -> Tensor:
            return folded([c.conv.weight for c in branches], [c.bn for c in branches], s)

        if type(blocks[0]) is ReparamLargeKernelConv:  # asked of the argument: ``b`` stays untyped
            k = fold([x.large_conv for x in bs])
            if getattr(b, "small_conv", None) is not None:
                pad = (b.kernel_size - b.small_kernel) // 2
                k = k + F.pad(fold([x.small_conv for x in bs]), [pad] * 4)
            return k
        k: Tensor | None = None  # type: ignore[no-redef]
        for i in range(len(_conv_branches(b))):
            term = fold([_conv_branches(x)[i] for x in bs])
            k = term if k is None else k + term
        if b.conv_scale is not None:
            pad = b.kernel_size // 2
            one = F.pad(fold([x.conv_scale for x in bs]), [pad] * 4)
            k = one if k is None else k + one
        if k is None:  # the identity alone (RepMixer's norm)
            w = b.identity.weight
            k = w.new_zeros(sum(x.out_chs for x in bs), b.in_chs // b.groups, b.kernel_size, b.kernel_size)
        # k is a new tensor (a product, a sum, a padding or zeros): the identity adds at its centre taps in place
        return k if b.identity is None else add_centre(k, joined([s[x.identity] for x in bs]))


def _structure(block: Any) -> tuple[Any, ...]:
    """What ``_fused_joined`` needs alike of the blocks it fuses together: their kind, branches and kernel shape."""
    if type(block) is MobileOneBlock and block.reparam_conv is None:  # perhaps the identity alone: no conv to ask
        shape: tuple[int, ...] = (block.in_chs // block.groups, block.kernel_size, block.kernel_size)
        branches: Any = (len(_conv_branches(block)), block.conv_scale is None, block.identity is None)
    else:
        shape, branches = tuple(_conv(block).weight.shape[1:]), getattr(block, "small_conv", None) is not None
    return (type(block).__name__, block.reparam_conv is None, branches, shape)


def identity_kernel(weight: Tensor) -> Tensor:
    """The depthwise identity ``(c, 1, kh, kw)`` as a kernel: 1 at the centre tap."""
    eye = torch.zeros_like(weight)
    eye[:, :, weight.shape[-2] // 2, weight.shape[-1] // 2] = 1.0
    return eye


def repmixer_norms(mixer: Any) -> tuple[nn.Module, ...]:
    """The batch norms ``_repmixer_kernel`` folds (none where the RepMixer is reparameterised)."""
    return () if mixer.reparam_conv is not None else (*fused_norms(mixer.mixer), *fused_norms(mixer.norm))


def _repmixer_kernel(mixer: Any, scales: Scales | None = None) -> Tensor:
    """``s (K_mixer - K_norm)``'s per-channel direction: the kernel of RepMixer's residual branch."""
    return _repmixer_kernels([mixer], scales)[0]


def _repmixer_kernels(mixers: Sequence[nn.Module], scales: Scales | None = None) -> list[Tensor]:
    """``_repmixer_kernel`` of RepMixers alike (``_repmixer_key``) in one pass over their weights and scales joined
    along the channels (the same elementwise operations: the same bits)."""
    ms: list[Any] = list(mixers)
    first = ms[0]
    sizes = [int(m.dim) for m in ms]
    with torch.no_grad():
        if first.reparam_conv is not None:  # x + s (M - N) folded into one conv: take the identity out
            w = joined([m.reparam_conv.weight for m in ms]).detach()
            return parted(w - identity_kernel(w), sizes)
        s = scales_of(n for m in ms for n in repmixer_norms(m)) if scales is None else scales
        k = _fused_joined([m.mixer for m in ms], s)
        if _norm_is_identity(first):  # K_norm is the identity alone: subtracted at k's centre taps, in place (k is new)
            return parted(add_centre(k, joined([s[m.norm.identity] for m in ms]), alpha=-1.0), sizes)
        return parted(k - _fused_joined([m.norm for m in ms], s), sizes)


def _norm_is_identity(mixer: Any) -> bool:
    norm = mixer.norm
    return bool(mixer.mixer.reparam_conv is None and norm.reparam_conv is None and norm.conv_kxk is None and norm.conv_scale is None)


def _repmixer_key(mixer: Any) -> tuple[Any, ...]:
    """What ``_repmixer_kernels`` needs alike of the RepMixers it builds together."""
    w = (mixer.reparam_conv if mixer.reparam_conv is not None else _conv(mixer.mixer)).weight
    inner = () if mixer.reparam_conv is not None else (_structure(mixer.mixer), _structure(mixer.norm), _norm_is_identity(mixer))
    return ("repmixer", mixer.reparam_conv is None, inner, tuple(w.shape[1:]), w.dtype, w.device)


def _cpe_kernel(cpe: Any) -> Tensor:
    with torch.no_grad():
        if cpe.reparam_conv is not None:
            w = cpe.reparam_conv.weight.detach()
            return w - identity_kernel(w)  # type: ignore[no-any-return]
        return cpe.pos_enc.weight.detach()  # type: ignore[no-any-return]


def _conv(block: Any) -> Any:
    """The nn.Conv2d carrying a block's geometry (kernel, stride, padding, dilation)."""
    if type(block) is MobileOneBlock:
        return block.reparam_conv if block.reparam_conv is not None else block.conv_kxk[0].conv
    if type(block) is ReparamLargeKernelConv:
        return block.reparam_conv if block.reparam_conv is not None else block.large_conv.conv
    return block


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


# ---------------------------------------------------------------------------------------------- refusals
def _mobileone_refusal(block: Any, where: str, depthwise: bool | None = None) -> str | None:
    if type(block) is not MobileOneBlock:
        return f"{where} is {type(block).__name__}, not timm's MobileOneBlock"
    if block.reparam_conv is None and block.conv_kxk is None:
        return f"{where} has no kxk conv branch (num_conv_branches=0), only its identity"
    if block.groups not in (1, block.in_chs):
        return f"{where} is a grouped conv that is neither full nor depthwise"
    conv = _conv(block)
    if type(conv) is not nn.Conv2d or isinstance(conv.padding, str) or conv.padding_mode != "zeros":
        return f"{where}'s conv is not a plain zero-padded nn.Conv2d"
    return None


def fastvit_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm FastViT this adapter carries labels through (``None``: it is)."""
    if type(model) is not FastVit:
        return f"{type(model).__name__} is not a timm FastVit"
    m: Any = model
    if m.fork_feat:
        return "a FastVit built with fork_feat=True returns feature maps, no logits to align"
    if not isinstance(m.head, ClassifierHead) or m.head.global_pool.pool_type != "avg":
        return "only global average pooling ('avg') has a label readout"
    stem = list(m.stem)
    if len(stem) != 3 or any(type(b) is not MobileOneBlock for b in stem) or [b.kernel_size for b in stem] != [3, 3, 1]:
        return "the stem is not timm's two 3x3 MobileOne blocks then a 1x1 one"
    for i, s in enumerate(m.stages):
        if not isinstance(s.downsample, (nn.Identity, PatchEmbed)):
            return f"stage {i}'s downsample is {type(s.downsample).__name__}, not timm's PatchEmbed"
        if isinstance(s.downsample, PatchEmbed):
            lk = s.downsample.proj[0]
            if type(lk) is not ReparamLargeKernelConv or type(s.downsample.proj[1]) is not MobileOneBlock:
                return f"stage {i}'s PatchEmbed is not a large-kernel conv then a 1x1 MobileOne block"
            why = check_static_conv(_conv(lk), f"stage {i}'s patch-embedding conv", depthwise=False) if lk.groups == 1 else None
            if why is not None:
                return why
        if not isinstance(s.pos_emb, (nn.Identity, RepConditionalPosEnc)):
            return f"stage {i}'s position embedding is {type(s.pos_emb).__name__}; only RepCPE or none is supported"
        for j, blk in enumerate(s.blocks):
            where = f"stage {i} block {j}"
            if type(blk) is RepMixerBlock:
                if type(blk.token_mixer) is not RepMixer:
                    return f"{where}'s token mixer is not timm's RepMixer"
            elif type(blk) is AttentionBlock:
                if type(blk.token_mixer) is not Attention or not isinstance(blk.norm, (nn.BatchNorm2d, LayerNorm2d)):
                    return f"{where} is not timm's attention block (a batch or per-position layer norm, then Attention)"
            else:
                return f"{where} is {type(blk).__name__}; only RepMixerBlock and AttentionBlock are supported"
            if type(blk.mlp) is not ConvMlp:
                return f"{where}'s MLP is not timm's ConvMlp"
    for i, b in enumerate(stem):
        why = _mobileone_refusal(b, f"stem block {i}")
        if why is not None:
            return why
    why = _mobileone_refusal(m.final_conv, "the final conv")
    if why is None and m.final_conv.stride != 1:
        why = "the final conv is strided"
    return why


# ---------------------------------------------------------------------------------------------- forward pieces
def _embed(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int], tuple[int, int]]:
    grid = check_batch(images, label_map, (4, 4))  # two stride-2 stem blocks
    x = m.stem(images)
    if (int(x.shape[2]), int(x.shape[3])) != grid:
        raise ValueError(f"the stem made a {tuple(x.shape[2:])} grid, not {grid}; use an image size divisible by 4")
    if label_map.token_space:
        return mix_token_space(x, label_map, channels_last=False), grid, grid
    return x, grid, (label_map.image_size[0], label_map.image_size[1])


def _attend(attn: Any, x: Tensor, labels: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """timm's FastViT ``Attention`` on ``(b, c, h, w)``: output, mixed labels, and the matrix where it was built."""
    b, c, h, w = x.shape
    t = rearrange(x, "b c h w -> b (h w) c")
    q, k, v = rearrange(attn.qkv(t), "b n (three n_h d) -> three b n_h n d", three=3, n_h=attn.num_heads)
    mixed, a = None, None
    if attn.fused_attn:
        dropout_p = attn.attn_drop.p if attn.training else 0.0
        if labels is not None:
            o, mixed = attention_with_labels(q, k, v, labels, attn.scale, dropout_p)
        else:
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    else:
        a = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        mixed = None if labels is None else explicit_mix(a, labels)
        o = attn.attn_drop(a) @ v
    out = attn.proj_drop(attn.proj(rearrange(o, "b n_h n d -> b n (n_h d)")))
    return rearrange(out, "b (h w) c -> b c h w", h=h), mixed, a


def _mix(labels: Tensor, grid: tuple[int, int], kernels: Kernels, op: Any) -> Tensor:
    """Labels through one of the forward's label convs (``apply_path``: its kernel expanded with the others of its
    shape, and its in-grid tap weights computed with theirs, one conv of ones per grid)."""
    assert kernels.get(op) is not None, "a conv the labels mix by is missing from the forward's kernels"
    return apply_path((op,), labels, grid, kernels)[0]


def _label_convs(m: Any, tracker: LabelTracker) -> dict[nn.Module, Any]:
    """Every conv the labels mix by in this forward, by the module it stands for (RepCPE, RepMixer, ConvMlp, the
    final conv): a plain conv, or a ``KernelConv`` with the fused kernel and the norms it folds. Their label kernels
    are computed together (``Kernels``), and every norm's fold scale in one pass."""
    ops: dict[nn.Module, Any] = {}
    layer = 0
    for s in m.stages:
        if isinstance(s.pos_emb, RepConditionalPosEnc):
            pe = s.pos_emb
            if tracker.labels_for(layer) is not None:
                rc = pe.reparam_conv
                ops[pe] = pe.pos_enc if rc is None else KernelConv(partial(_cpe_kernel, pe), _pair(rc.padding), _pair(rc.dilation))
            layer += 1
        for blk in s.blocks:
            if tracker.labels_for(layer) is not None:
                if type(blk) is RepMixerBlock:
                    mixer = blk.token_mixer
                    conv = _conv(mixer.mixer) if mixer.reparam_conv is None else mixer.reparam_conv
                    ops[mixer] = KernelConv(partial(_repmixer_kernel, mixer), _pair(conv.padding), _pair(conv.dilation), repmixer_norms(mixer),
                                            KernelBatch(_repmixer_key(mixer), mixer, _repmixer_kernels))
                ops[blk.mlp] = blk.mlp.conv.conv
            layer += 1
    fc, conv = m.final_conv, _conv(m.final_conv)
    ops[fc] = KernelConv(partial(fused_kernel, fc), _pair(conv.padding), _pair(conv.dilation), fused_norms(fc))
    return ops


def _mix_matrix(grid: tuple[int, int], kernel: Tensor, conv: Any) -> Tensor:
    k = kernel_reference(kernel)
    return row_normalise(conv_matrix(grid, k, padding=_pair(conv.padding), dilation=_pair(conv.dilation))[0])


def _depth(m: Any) -> int:
    return sum(len(s.blocks) + isinstance(s.pos_emb, RepConditionalPosEnc) for s in m.stages)


class AdaptedFastViT(AdaptedBase):
    """A timm FastViT returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = FASTVIT_FAMILY
    refusal = staticmethod(fastvit_refusal)

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        tracker = start_on_convs(self.scheme, label_map, start, grid, _depth(m), [_conv(b) for b in list(m.stem)[:2]])
        ops = _label_convs(m, tracker)
        kernels = Kernels(ops.values())
        layer = 0
        for s in m.stages:
            if isinstance(s.downsample, PatchEmbed):
                grid = conv_aggregate(tracker, grid, _conv(s.downsample.proj[0]))
                x = s.downsample(x)
            if isinstance(s.pos_emb, RepConditionalPosEnc):
                y = fold_labels(tracker, layer, grid)
                x = s.pos_emb(x)
                tracker.residual(layer, None, mixed=None if y is None else _mix(y, grid, kernels, ops[s.pos_emb]))
                layer += 1
            for blk in s.blocks:
                x = self._block(blk, x, layer, tracker, grid, kernels, ops)
                layer += 1
        fc, last = m.final_conv, grid
        tracker.aggregate(lambda y: _mix(y, last, kernels, ops[fc]))
        x = fc(x)
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    @staticmethod
    def _block(blk: Any, x: Tensor, layer: int, tracker: LabelTracker, grid: tuple[int, int], kernels: Kernels,
               ops: dict[nn.Module, Any]) -> Tensor:
        y, mixed = fold_labels(tracker, layer, grid), None  # position-major where the CPU's folded convs pay
        if type(blk) is RepMixerBlock:
            mixer = blk.token_mixer
            if y is not None:
                mixed = _mix(y, grid, kernels, ops[mixer])
            x = mixer(x)  # timm's own: x + s (mixer(x) - norm(x)), no stochastic depth
            tracker.residual(layer, None, mixed=mixed)
            out, keep = branch(blk.drop_path, blk.layer_scale(blk.mlp(x)))
        else:
            out, mixed, _ = _attend(blk.token_mixer, blk.norm(x), y)
            out, keep = branch(blk.drop_path1, blk.layer_scale_1(out))
            tracker.residual(layer, keep, mixed=mixed)
            x = x + out
            out, keep = branch(blk.drop_path2, blk.layer_scale_2(blk.mlp(x)))
        # ConvMlp's depthwise 7x7 (its norm scales whole channels: no label effect)
        y = fold_labels(tracker, layer, grid)
        tracker.residual(layer, keep, mixed=None if y is None else _mix(y, grid, kernels, ops[blk.mlp]))
        return x + out

    # ------------------------------------------------------------------------------------------ reference
    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit matrices of every window and conv (fused kernels) on dense labels."""
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        rules = DenseRules(self.scheme, label_map, start, 0, _depth(m))
        rules.aggregate_convs(start, grid, [_conv(b) for b in list(m.stem)[:2]])
        layer = 0
        for s in m.stages:
            if isinstance(s.downsample, PatchEmbed):
                conv = _conv(s.downsample.proj[0])
                merge, grid = conv_matrix(grid, torch.ones(conv.kernel_size), conv.stride, conv.padding)
                rules.aggregate(merge)
                x = s.downsample(x)
            if isinstance(s.pos_emb, RepConditionalPosEnc):
                pe = s.pos_emb
                rules.mix(layer, _mix_matrix(grid, _cpe_kernel(pe), pe.pos_enc if pe.reparam_conv is None else pe.reparam_conv).unsqueeze(0), None)
                x = pe(x)
                layer += 1
            for blk in s.blocks:
                if type(blk) is RepMixerBlock:
                    mixer = blk.token_mixer
                    matrix = _mix_matrix(grid, _repmixer_kernel(mixer), _conv(mixer.mixer) if mixer.reparam_conv is None else mixer.reparam_conv)
                    rules.mix(layer, matrix.unsqueeze(0), None)
                    x = mixer(x)
                    out, keep = _drop(blk.drop_path, blk.layer_scale(blk.mlp(x)))
                else:
                    attn = blk.token_mixer
                    h = blk.norm(x)
                    t = rearrange(h, "b c h w -> b (h w) c")
                    q, k, v = rearrange(attn.qkv(t), "b n (three n_h d) -> three b n_h n d", three=3, n_h=attn.num_heads)
                    a = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
                    o = attn.proj(rearrange(F.dropout(a, attn.attn_drop.p, attn.training) @ v, "b n_h n d -> b n (n_h d)"))
                    out, keep = _drop(blk.drop_path1, blk.layer_scale_1(rearrange(o, "b (h w) c -> b c h w", h=grid[0])))
                    rules.mix(layer, a.detach().double().mean(dim=1), keep)
                    x = x + out
                    out, keep = _drop(blk.drop_path2, blk.layer_scale_2(blk.mlp(x)))
                conv = blk.mlp.conv.conv
                rules.mix(layer, _mix_matrix(grid, conv.weight.detach(), conv).unsqueeze(0), keep)
                x = x + out
                layer += 1
        fc = m.final_conv
        rules.aggregate(_mix_matrix(grid, fused_kernel(fc), _conv(fc)))
        x = fc(x)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        return rules.result(output, output, "mean", token_logits)


def _token_logits(m: Any, x: Tensor) -> Tensor:
    """The classifier on every final position ``(b, h*w, classes)`` (timm's head without the pooling)."""
    t = rearrange(x, "b c h w -> b (h w) c")
    return m.head.fc(m.head.drop(t))  # type: ignore[no-any-return]


def tiny_fastvit(num_classes: int = 10, **kwargs: Any) -> FastVit:
    """A seeded FastViT for 32x32 images: a RepMixer stage on the 8x8 grid, then a patch embedding, RepCPE and an
    attention block on the 4x4 grid (FastViT-SA's pattern), all with timm's training-time branches."""
    torch.manual_seed(0)
    cpe: Any = partial(RepConditionalPosEnc, spatial_shape=(3, 3))  # timm's type says Module; it calls the partial
    return FastVit(layers=(1, 1), embed_dims=(16, 32), mlp_ratios=(2.0, 2.0), downsamples=(False, True),
                   token_mixers=("repmixer", "attention"), pos_embs=(None, cpe), num_classes=num_classes, **kwargs)  # fmt: skip


FAMILY = Family(
    name="fastvit",
    description=FASTVIT_FAMILY,
    refusal=AdaptedFastViT.refusal,
    build=AdaptedFastViT,
    example=tiny_fastvit,
    timm_modules=("fastvit",),
    speed_model="fastvit_t8",
)
