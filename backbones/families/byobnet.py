"""Adapter for timm's ByobNet: MobileViT v1/v2, RepVGG, MobileOne and the ResNet-style ByobNets (basic and bottleneck blocks).

Every position of a feature map is a token (as in ``backbones._convnet``, whose rules the conv
blocks take). Events per ``layer`` (each conv block is one, each transformer block inside a
MobileViT block is one):

- ``BasicBlock`` / ``BottleneckBlock`` (MobileViT's inverted residuals) / ``EdgeBlock`` (a kxk
  conv then a 1x1): a stride-1 ``kxk`` conv mixes labels by its (out, in)-averaged normalised
  ``|kernel|``, a strided one aggregates; 1x1 convs, norms (EvoNorms included), activations,
  SE/ECA and GlobalContext used as a gate (``'gc'``) are channel ops (``'gca'``, which adds the
  pooled context to every position, is refused); an identity or
  downsampling shortcut joins the branch by the residual rule; a block without a shortcut
  (timm's ``downsample=''`` where the width or stride changes) ``aggregate``\\ s;
- ``RepVggBlock`` / ``MobileOneBlock`` (RepVGG, MobileOne; a rep or one stem too): kxk conv branches, a 1x1 and
  an identity batch norm summed, no shortcut around them: one conv with the kernel timm's ``reparameterize``
  writes (each branch scaled by its norm's ``gamma / sqrt(running_var + eps)``, the 1x1 and the identity as
  centre taps), as ``repvit``'s RepVggDw and ``fastvit``'s MobileOne (folded with ``backbones._reparam``): the block
  ``aggregate``\\ s by that conv's rule (strided: its windows; a 1x1: a channel op). The kernel reads the running
  statistics in training too, so a model trained with branches and the same model reparameterised have one rule.
  timm's experimental drop path around the conv branches (``drop_path_rate > 0``) is refused;
- ``MobileVitBlock`` (v1), ``conv_fusion(cat(x, proj(fold(T(unfold(conv_kxk(x)))))))``: the
  block's input ``x`` and its transformer path meet in one ``kxk`` conv, with no residual
  around the block. The labels carry both states side by side, ``(b, 2n, l)``: the input's
  labels, then the path's (one ``aggregate`` duplicates them). The path's ``conv_kxk``
  aggregates (no shortcut around it). ``unfold`` groups the pixels at one offset inside the
  ``p x p`` patches into a sequence over the patches; each timm ``Block`` is a residual
  attention over that sequence: its head-mean attention rows mix the path's labels among the
  pixels of one offset, and the residual rule joins them (``residual`` with the input half
  unchanged: ``Norm(Y + Y) = Y``). timm's drop-path draws one sample per (image, offset)
  sequence, so ``keep`` is per token ``(b, 2n)``. ``conv_fusion`` is the rule of a conv over
  two label states: every (output, input) channel pair's kernel is a distribution over its
  taps, averaged over all pairs, and a pair reads the labels of its input channel's half,
  ``Y <- Norm(T(k_x) Y_x + T(k_p) Y_p)`` with ``k_x = sum_{o, i in x} |K_oi| / sum|K_oi| / (O I)``
  (``k_p`` likewise over the path's channels): the rule of ``_convnet`` when both halves
  carry the same labels. ``no_fusion`` keeps the path's half;
- ``MobileVitV2Block``: ``proj(fold(T(unfold(dwconv(x)))))``, no shortcut: the depthwise
  conv aggregates, each ``LinearTransformerBlock`` is a residual separable self-attention,
  ``out_n = relu(V_n) * sum_m s_m K_m`` with ``s = softmax(query)`` over the patches at one
  offset. As for gMLP's gating unit (``backbones.families.gmlp``), the token-local factor gates, as a
  query does, and the mixed content is ``K_m`` with weight ``s_m``: ``mixed_n = sum_m s_m Y_m``,
  the same context labels for every pixel of the offset; the residual joins it;
- stem: its convs and pools aggregate from the pixels (a MixToken map starts on its grid);
  readout ``pool("mean", 0)`` after the 1x1 ``final_conv`` (global average pooling; TransMix
  refuses: no class token); a ``NormMlpClassifierHead`` is channel ops after that pooling (its
  per-position logits, for token labeling, only with a per-position norm: LayerNorm2d).

Refused: a map that a MobileViT block would interpolate (its side not a multiple of the patch
size): the bilinear resize has no label rule here; the error names the image size to use.

Shapes: ``b`` batch, ``c`` channels, ``n`` positions (row-major over ``h w``), ``l`` label
channels, ``p`` offsets in a patch (``ph pw``), ``m`` patches (``nh nw``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange, reduce
from timm.layers.attention import Attention
from timm.layers.classifier import ClassifierHead, NormMlpClassifierHead
from timm.layers.drop import DropPath
from timm.layers.conv_bn_act import ConvNormAct
from timm.models.byobnet import (
    BasicBlock,
    BottleneckBlock,
    ByoBlockCfg,
    ByobNet,
    ByoModelCfg,
    DownsampleAvg,
    EdgeBlock,
    MobileOneBlock,
    RepVggBlock,
)
from timm.models.mobilevit import LinearSelfAttention, LinearTransformerBlock, MobileVitBlock, MobileVitV2Block
from timm.models.vision_transformer import Block
from torch import Tensor, nn

from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap
from mixlabels._routes import eager_cpu_routes, eager_launch_routes
from mixlabels.backbones._attention import attention_with_labels, explicit_mix
from mixlabels._shape_cache import shape_cache
from mixlabels.backbones._common import AdaptedBase, branch, conv_mix_pair, kernel_labels, label_kernels
from mixlabels.backbones._convnet import (
    KernelConv,
    aggregate_path,
    Kernels,
    Path,
    Window,
    apply_path,
    block_labels,
    conv_norm_act_ops,
    run_stem,
    block_labels_reference,
    path_matrix,
    path_convs,
    path_joins,
    path_of,
    path_refusal,
    start_on_path,
)
from mixlabels.backbones._fsdp import is_sharded
from mixlabels.backbones._dense import DenseRules, conv_matrix, row_normalise, window_matrix
from mixlabels.backbones._family import Family
from mixlabels.backbones._reparam import Scales, add_centre, scaled, scales_of
from mixlabels.backbones.families.convnext import _token_logits as _head_on_positions

__all__ = ["AdaptedByobNet", "BYOBNET_FAMILY", "byobnet_refusal", "rep_kernel", "tiny_mobilevit"]

BYOBNET_FAMILY = (
    "timm ByobNet built from BasicBlock, BottleneckBlock, EdgeBlock, RepVggBlock, MobileOneBlock, MobileVitBlock and "
    "MobileVitV2Block (MobileViT v1/v2, GENet, RepVGG, MobileOne, the ResNet-*ts with SE/ECA/GlobalContext gates, EvoNorm "
    "RegNetZs): every position a token; stride-1 kxk convs mix labels by the (out, "
    "in)-averaged normalised |kernel|, RepVGG/MobileOne blocks by the kernel they reparameterise into, strided convs "
    "and pools aggregate, channel ops leave labels alone, shortcuts "
    "join by the residual rule; MobileViT's attention over the pixels at one patch offset mixes labels by its "
    "head-mean rows (v2's separable attention by its context scores), and v1's fusion conv over the block's input and "
    "its transformer path weighs each half's labels by that half's normalised |kernel|; stem from the pixels; global "
    "average pooling (a NormMlpClassifierHead's norm-MLP after it); stochastic depth"
)

_CONV_BLOCKS = (BasicBlock, BottleneckBlock, EdgeBlock)
_MOBILEVIT_BLOCKS = (MobileVitBlock, MobileVitV2Block)


def _flat(module: nn.Module | None) -> list[nn.Module]:
    """A module as the ops its forward runs in order (``DownsampleAvg``: its pool, then its 1x1 conv)."""
    if type(module) is DownsampleAvg:
        down: Any = module
        return conv_norm_act_ops(down.pool) + conv_norm_act_ops(down.conv)
    return conv_norm_act_ops(module)


def _branch_modules(blk: Any) -> list[nn.Module]:
    """A conv block's branch in timm's ``forward`` order (before drop-path and the sum)."""
    if type(blk) is BasicBlock:
        return _flat(blk.conv1_kxk) + [blk.attn] + _flat(blk.conv2_kxk) + [blk.attn_last]
    if type(blk) is EdgeBlock:  # a kxk conv then a 1x1: the bottleneck's rules without its first 1x1
        return _flat(blk.conv1_kxk) + [blk.attn] + _flat(blk.conv2_1x1) + [blk.attn_last]
    return (_flat(blk.conv1_1x1) + _flat(blk.conv2_kxk) + _flat(blk.conv2b_kxk) + [blk.attn]
            + _flat(blk.conv3_1x1) + [blk.attn_last])


def _blocks(m: Any) -> list[Any]:
    return [blk for stage in m.stages for blk in stage.children()]


def _depth(m: Any) -> int:
    return sum(len(blk.transformer) if isinstance(blk, _MOBILEVIT_BLOCKS) else 1 for blk in _blocks(m))


# ---------------------------------------------------------------------------------------------- re-parameterisable blocks
_REP_BLOCKS = (RepVggBlock, MobileOneBlock)
"""Blocks whose branches timm's ``reparameterize`` fuses into one conv: RepVGG (kxk, 1x1, identity norm) and
MobileOne (several kxk, a 1x1 scale branch, identity norm), all summed with no shortcut around them."""


def _rep_branches(blk: Any) -> tuple[list[Any], Any]:
    """A re-parameterisable block's kxk ``ConvNormAct`` branches and its 1x1 one (``None``: none)."""
    if type(blk) is RepVggBlock:
        return [blk.conv_kxk], blk.conv_1x1
    return list(blk.conv_kxk), blk.conv_scale


def _plain_norm(norm: Any) -> bool:
    """A batch norm timm's ``_fuse_bn_tensor`` folds: no activation or drop inside it (``apply_act=False``)."""
    return isinstance(norm, nn.BatchNorm2d) and all(
        isinstance(getattr(norm, name, nn.Identity()), nn.Identity) for name in ("act", "drop"))


def _rep_refusal(blk: Any, where: str) -> str | None:
    """Why a ``RepVggBlock`` / ``MobileOneBlock`` is not one conv whose kernel timm's ``reparameterize`` writes."""
    name = type(blk).__name__
    after = path_refusal([blk.attn, blk.act], f"{where}'s attn and act")
    if blk.reparam_conv is not None:
        conv = blk.reparam_conv
        (kh, kw), (dh, dw) = conv.kernel_size, conv.dilation
        if conv.padding_mode != "zeros" or isinstance(conv.padding, str) or tuple(conv.padding) != (dh * (kh // 2), dw * (kw // 2)):
            return f"{where} ({name}, reparameterised) has a conv without the centred zero padding its branches had"
        return path_refusal([conv], f"{where}'s reparam_conv") or after
    if not isinstance(blk.drop_path, nn.Identity):
        # timm's experimental drop path drops the conv branches per sample but keeps the identity norm: a kept sample
        # sees the fused conv (its branches rescaled), a dropped one the identity; no single conv rule covers both
        return (f"{where} ({name}) has drop path around its conv branches (timm's experimental drop_path_rate on "
                "RepVGG/MobileOne blocks), which has no label rule here; build the model with drop_path_rate=0")
    convs, scale = _rep_branches(blk)
    for branch_ in [*convs, *([] if scale is None else [scale])]:
        if type(branch_) is not ConvNormAct or type(branch_.conv) is not nn.Conv2d or not _plain_norm(branch_.bn):
            return f"{where} ({name}) has a branch that is not a plain nn.Conv2d and BatchNorm2d (ConvNormAct, no act)"
        if getattr(branch_, "aa", None) is not None and not isinstance(branch_.aa, nn.Identity):
            return f"{where} ({name}) has an anti-aliased branch, which timm's reparameterize does not fuse"
    first = convs[0].conv
    (kh, kw), pad = first.kernel_size, tuple(first.padding) if not isinstance(first.padding, str) else None
    geometry = {(c.conv.kernel_size, c.conv.stride, c.conv.padding, c.conv.dilation, c.conv.groups, c.conv.padding_mode) for c in convs}
    if len(geometry) != 1 or first.padding_mode != "zeros" or first.dilation != (1, 1) or kh % 2 == 0 or kw % 2 == 0 or pad != (kh // 2, kw // 2):
        return (f"{where} ({name}) is not timm's re-parameterisable block (undilated odd kxk convs of one geometry, "
                "centred zero padding)")
    if scale is not None and (scale.conv.kernel_size != (1, 1) or scale.conv.stride != first.stride
                              or scale.conv.groups != first.groups or tuple(scale.conv.padding) != (0, 0)):
        return f"{where} ({name})'s 1x1 branch does not sit at the centre tap of its kxk conv"
    if blk.identity is not None and not (_plain_norm(blk.identity) and first.stride == (1, 1)
                                         and first.in_channels == first.out_channels):
        return f"{where} ({name})'s identity branch is not a BatchNorm2d on an unchanged map"
    return after


def rep_norms(blk: nn.Module) -> tuple[nn.Module, ...]:
    """The batch norms ``rep_kernel`` folds: every kxk branch's, the 1x1's, the identity's."""
    b: Any = blk
    convs, scale = _rep_branches(b)
    return (*(c.bn for c in convs), *(() if scale is None else (scale.bn,)), *(() if b.identity is None else (b.identity,)))


def rep_kernel(blk: nn.Module, scales: Scales | None = None) -> Tensor:
    """The kernel timm's ``reparameterize`` writes for a ``RepVggBlock`` / ``MobileOneBlock``: every branch's kernel
    scaled by its norm's ``gamma / sqrt(running_var + eps)`` and summed, the 1x1 and the identity as centre taps.
    Computed here rather than by timm's ``_get_kernel_bias``, which caches an identity tensor on the module.
    ``scales``: the norms' fold scales where computed together with others' (``_reparam``)."""
    b: Any = blk
    with torch.no_grad():
        if b.reparam_conv is not None:
            return b.reparam_conv.weight.detach()  # type: ignore[no-any-return]
        s = scales_of(rep_norms(blk)) if scales is None else scales
        convs, scale = _rep_branches(b)
        k = scaled(convs[0].conv.weight, s[convs[0].bn])  # a new tensor: the sums below and the identity add to it
        for c in convs[1:]:
            k = k + scaled(c.conv.weight, s[c.bn])
        ph, pw = k.shape[-2] // 2, k.shape[-1] // 2
        if scale is not None:
            k = k + F.pad(scaled(scale.conv.weight, s[scale.bn]), [pw, pw, ph, ph])
        if b.identity is not None:
            k = add_centre(k, s[b.identity])
        return k.detach()


def _rep_path(blk: Any) -> Path:
    """A re-parameterisable block as the one conv it fuses into: a strided one's windows, a stride-1 kxk as a
    ``KernelConv`` with the fused kernel (a 1x1: a channel op)."""
    if blk.reparam_conv is not None:
        return path_of([blk.reparam_conv])
    conv = _rep_branches(blk)[0][0].conv
    geometry = (int(conv.kernel_size[0]), int(conv.kernel_size[1])), (int(conv.padding[0]), int(conv.padding[1]))
    if conv.stride != (1, 1):
        return (Window(geometry[0], (int(conv.stride[0]), int(conv.stride[1])), geometry[1]),)
    if conv.kernel_size == (1, 1):
        return ()
    return (KernelConv(functools.partial(rep_kernel, blk), geometry[1], (1, 1), rep_norms(blk)),)


def _ops_refusal(modules: list[nn.Module], where: str) -> str | None:
    """``path_refusal`` of a stem's or shortcut's modules, a re-parameterisable block among them by its own rule."""
    for i, module in enumerate(modules):
        why = (_rep_refusal(module, f"{where} module {i}") if type(module) in _REP_BLOCKS
               else path_refusal([module], f"{where} module {i}"))
        if why is not None:
            return why
    return None


def _ops(modules: list[nn.Module]) -> Path:
    """``path_of`` of modules that may hold re-parameterisable blocks (each as its fused conv)."""
    return tuple(op for module in modules for op in (_rep_path(module) if type(module) in _REP_BLOCKS else path_of([module])))


def _plain_conv(conv: Any, where: str) -> str | None:
    if type(conv) is not nn.Conv2d or isinstance(conv.padding, str) or conv.padding_mode != "zeros":
        return f"{where} is not a plain zero-padded nn.Conv2d"
    if conv.stride != (1, 1):
        return f"{where} is strided; only stride 1 keeps the block's input and path on one grid"
    return None


def _mobilevit_refusal(blk: Any, where: str) -> str | None:
    why = path_refusal(_flat(blk.conv_kxk), f"{where}'s conv_kxk") or _plain_conv(blk.conv_kxk.conv, f"{where}'s conv_kxk")
    if why is not None:
        return why
    if type(blk.conv_1x1) is not nn.Conv2d or blk.conv_1x1.kernel_size != (1, 1) or blk.conv_1x1.stride != (1, 1):
        return f"{where}'s conv_1x1 is not a 1x1 stride-1 nn.Conv2d"
    why = path_refusal(_flat(blk.conv_proj), f"{where}'s conv_proj") or path_refusal([blk.norm], f"{where}'s norm")
    if why is not None:
        return why
    if path_of(_flat(blk.conv_proj)):
        return f"{where}'s conv_proj is not a 1x1 stride-1 convolution"
    for i, t in enumerate(blk.transformer):
        tw = f"{where}'s transformer block {i}"
        if type(blk) is MobileVitBlock:
            if type(t) is not Block or type(t.attn) is not Attention:
                return f"{tw} is {type(t).__name__}; only timm's Block with its Attention is supported"
            if getattr(t.attn, "gate", None) is not None:
                return f"{tw}'s attention is gated, which has no label rule here"
        elif type(t) is not LinearTransformerBlock or type(t.attn) is not LinearSelfAttention:
            return f"{tw} is {type(t).__name__}; only timm's LinearTransformerBlock is supported"
        if not all(isinstance(d, (DropPath, nn.Identity)) for d in (t.drop_path1, t.drop_path2)):
            return f"{tw}'s drop_path is not timm's DropPath"
    fusion: Any = getattr(blk, "conv_fusion", None)
    if fusion is not None:
        why = path_refusal(_flat(fusion), f"{where}'s conv_fusion") or _plain_conv(fusion.conv, f"{where}'s conv_fusion")
        if why is not None:
            return why
        if fusion.conv.groups != 1:
            return f"{where}'s conv_fusion is grouped; only a full conv over the input and the path has a rule here"
    return None


def byobnet_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm ByobNet this adapter carries labels through (``None``: it is)."""
    if type(model) is not ByobNet:
        return f"{type(model).__name__} is not a timm ByobNet"
    m: Any = model
    head = m.head
    plain = type(head) is ClassifierHead and not head.use_conv
    if not (plain or type(head) is NormMlpClassifierHead) or head.global_pool.pool_type != "avg":
        return (f"the head ({type(head).__name__}) has no label readout; use ClassifierHead with 'avg' pooling and a "
                "linear fc, or NormMlpClassifierHead with 'avg' pooling")
    why = _ops_refusal(_flat(m.stem), "the stem") or path_refusal(_flat(m.final_conv), "the final_conv")
    if why is not None:
        return why
    if path_of(_flat(m.final_conv)):
        return "the final_conv is not a 1x1 stride-1 convolution"
    for i, blk in enumerate(_blocks(m)):
        where = f"block {i}"
        if type(blk) in _MOBILEVIT_BLOCKS:
            why = _mobilevit_refusal(blk, where)
        elif type(blk) in _CONV_BLOCKS:
            if not isinstance(blk.drop_path, (DropPath, nn.Identity)):
                return f"{where}'s drop_path is {type(blk.drop_path).__name__}, not timm's DropPath"
            why = (path_refusal(_branch_modules(blk) + [blk.act], f"{where}'s branch")
                   or path_refusal(_flat(blk.shortcut), f"{where}'s shortcut"))
        elif type(blk) in _REP_BLOCKS:
            why = _rep_refusal(blk, where)
        else:
            why = (f"{where} is {type(blk).__name__}; only BasicBlock, BottleneckBlock, EdgeBlock, RepVggBlock, "
                   "MobileOneBlock, MobileVitBlock and MobileVitV2Block have label rules here")
        if why is not None:
            return why
    return None


# ---------------------------------------------------------------------------------------------- shared pieces
def _conv_block(blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
    """timm's conv block forward with the branch's drop-path draw exposed: the output and who kept the branch (a
    re-parameterisable block: timm's own forward, no drop path)."""
    if type(blk) in _REP_BLOCKS:
        return blk(x), None
    h = x
    for module in _branch_modules(blk):
        h = module(h)
    h, keep = branch(blk.drop_path, h)
    if blk.shortcut is not None:
        h = h + blk.shortcut(x)
    return blk.act(h), keep


def _conv_paths(blk: Any) -> tuple[Path, Path | None]:
    if type(blk) in _REP_BLOCKS:
        return _rep_path(blk), None  # one conv, no shortcut: the block aggregates
    return path_of(_branch_modules(blk)), (None if blk.shortcut is None else path_of(_flat(blk.shortcut)))


def _patches(blk: Any, grid: tuple[int, int], images: tuple[int, int]) -> tuple[int, int, int, int]:
    """``(ph, pw, nh, nw)`` of a MobileViT block on ``grid``; refuses a grid timm would interpolate."""
    ph, pw = int(blk.patch_size[0]), int(blk.patch_size[1])
    if grid[0] % ph or grid[1] % pw:
        raise ValueError(
            f"a {type(blk).__name__} gets a {grid[0]}x{grid[1]} map, not a multiple of its {ph}x{pw} patches, and timm "
            f"would resize it bilinearly, which has no label rule here; use an image size for which every MobileViT "
            f"block's map divides by its patch size (images are {images[0]}x{images[1]}: 256x256 for timm's MobileViTs, "
            "or any multiple of 32 times the patch size)"
        )
    return ph, pw, grid[0] // ph, grid[1] // pw


def _to_sequences(labels: Tensor, ph: int, pw: int, nh: int, nw: int) -> Tensor:
    """``rearrange(labels, "b (nh ph nw pw) l -> b (ph pw) (nh nw) l")``, every patch offset's sequence, in one
    copy: einops' reshape of the permuted view dispatches a second operator after the copy (``_unsafe_view``)."""
    b, l = int(labels.shape[0]), int(labels.shape[-1])
    offsets = labels.view(b, nh, ph, nw, pw, l).permute(0, 2, 4, 1, 3, 5)  # splitting an axis is always a view
    return offsets.contiguous().view(b, ph * pw, nh * nw, l)


def _after(first: Tensor, sequences: Tensor, ph: int, pw: int, nh: int, nw: int) -> Tensor:
    """``torch.cat([first, rearrange(sequences, "(b ph pw) (nh nw) l -> b (nh ph nw pw) l")], dim=1)``: the
    concatenation reads the sequences through a permuted view, one copy in all, where einops' rearrangement copied
    them first (and dispatched ``_unsafe_view``)."""
    b, l = int(first.shape[0]), int(first.shape[-1])
    back = sequences.view(b, ph, pw, nh, nw, l).permute(0, 3, 1, 4, 2, 5)  # b nh ph nw pw l
    return torch.cat([first.view(b, 1, nh, ph, nw, pw, l), back.unsqueeze(1)], dim=1).view(b, -1, l)


def _local(blk: Any, x: Tensor) -> Tensor:
    return blk.conv_1x1(blk.conv_kxk(x))  # type: ignore[no-any-return]


def _fusion_halves(blk: Any) -> tuple[Tensor, Tensor]:
    """The fusion conv's weight split by the half of its input a pair reads (the block's input channels first, as
    timm concatenates them)."""
    weight, c_in = blk.conv_fusion.conv.weight, int(blk.conv_kxk.conv.in_channels)
    return weight[:, :c_in], weight[:, c_in:]


def _fusion_shares(blk: Any) -> tuple[float, float]:
    """Each ``_fusion_halves`` half's share of the fusion conv's input channels (from the shapes: no slicing)."""
    c_in, total = int(blk.conv_kxk.conv.in_channels), int(blk.conv_fusion.conv.weight.shape[1])
    return c_in / total, (total - c_in) / total


def _fusion_kernels(blk: Any) -> tuple[Tensor, Tensor]:
    """``(k_x, k_p)``: the fusion conv's per-pair normalised |kernel| averaged over all pairs, split by the half a pair
    reads (``_fusion_halves``); the two sum to 1 over their taps."""
    (w_x, w_p), (s_x, s_p) = _fusion_halves(blk), _fusion_shares(blk)
    return kernel_labels(w_x) * s_x, kernel_labels(w_p) * s_p


def _forward_kernels(blocks: list[Any], tracker: LabelTracker, device: torch.device) -> tuple[Kernels | None, FusionKernels]:
    """The forward's label kernels and MobileViT v1 fusion kernels. On a GPU's eager route (``launch_routes``) the
    label kernels of the forward's stride-1 convs are read together (``Kernels``: a few operators for all, their tap
    weights and small grids' matrices built together too): every conv block's shortcut and its branch where that
    layer's labels are read (or the block has no shortcut), every MobileViT block's local conv, which its labels
    always go through, and both halves of every fusion conv (``_fusion_half_convs``), which ``FusionKernels`` scales
    by their shares. MobileViT-XXS: 36 operators a step fewer, where each block's conv read its kernel in six and the
    fusion halves were read apart. ``None`` elsewhere, where each block reads its own as before: the CPU's eager
    route (its bits, which the targets digest holds), a compiled graph (whose compiler fuses each conv's reductions),
    and FSDP2's per-block sharding (a block's weights are whole only inside its own call)."""
    if not eager_launch_routes(device) or any(is_sharded(blk) for blk in blocks):
        return None, FusionKernels(blocks, device)
    paths: list[Path] = []
    layer = 0
    for blk in blocks:
        if isinstance(blk, _MOBILEVIT_BLOCKS):
            paths.append(path_of(_flat(blk.conv_kxk)))
            layer += len(blk.transformer)
            continue
        branch_path, shortcut = _conv_paths(blk)
        if shortcut is None or tracker.labels_for(layer) is not None:
            paths.append(branch_path)
        if shortcut:
            paths.append(shortcut)
        layer += 1
    fusion = FusionKernels(blocks, device)
    kernels = Kernels([*(c for path in paths for c in path_convs(path)), *fusion.half_convs()],
                      (op for path in paths for op in path_joins(path)))
    fusion.read_from(kernels)
    return kernels, fusion


def _fusion_half(blk: Any, half: int) -> Tensor:
    """Half ``half`` (0: the block's input's, 1: its transformer path's) of the fusion conv's weight."""
    return _fusion_halves(blk)[half]


class FusionKernels:
    """Each MobileViT v1 block's fusion ``(k_x, k_p)`` (``_fusion_kernels``) for one forward, read when a block's labels
    first need them: a scheme that tracks no labels (NoAlign) reads none, and a tracker's two label sets share them.

    On a GPU's eager route (``launch_routes``), where every operator is a launch, the halves of all blocks' fusion
    weights are read together, with the forward's other label kernels where it gives them (``read_from``: one
    ``label_kernels`` call for all), and scaled by their shares in one product: about a dozen operators for the
    forward, where each block's two ``kernel_labels`` and two scalings took fourteen (MobileViT-XXS: 42). The CPU's
    eager route reads each block's own (its bits, which the targets digest holds), and so does a compiled graph,
    whose compiler fuses each block's reductions (read together, compiled MobileViT-XXS launched 2 kernels more)."""

    def __init__(self, blocks: list[Any], device: torch.device) -> None:
        self._blocks: list[Any] = [blk for blk in blocks if type(blk) is MobileVitBlock and blk.conv_fusion is not None]
        self._together = eager_launch_routes(device)
        self._device = device
        self._kernels: dict[int, tuple[Tensor, Tensor]] = {}
        # every block's two fusion halves as convs of their own (their weights read at call time), for a ``Kernels``
        # that reads them with the forward's other convs (``half_convs``, ``read_from``)
        self._halves = {id(blk): tuple(KernelConv(functools.partial(_fusion_half, blk, half), *_pad(blk.conv_fusion.conv))
                                       for half in (0, 1)) for blk in self._blocks}
        self._read: Kernels | None = None

    def half_convs(self) -> list[KernelConv]:
        """Every block's two fusion halves as convs (``_fusion_half``), in the blocks' order."""
        return [c for pair in self._halves.values() for c in pair]

    def read_from(self, kernels: Kernels) -> None:
        """Take the halves' label kernels from ``kernels``, which holds ``half_convs()``."""
        self._read = kernels

    def of(self, blk: Any) -> tuple[Tensor, Tensor]:
        if id(blk) not in self._kernels:
            if self._together:
                self._kernels.update(self._all())
            else:
                self._kernels[id(blk)] = _fusion_kernels(blk)
        return self._kernels[id(blk)]

    def _all(self) -> dict[int, tuple[Tensor, Tensor]]:
        shares = tuple(s for blk in self._blocks for s in _fusion_shares(blk))
        if self._read is None:
            kernels = label_kernels([w for blk in self._blocks for w in _fusion_halves(blk)])
        else:  # read with the forward's other kernels
            kernels = [self._read.label_kernel(c) for blk in self._blocks for c in self._halves[id(blk)]]
        scaled = (torch.stack(kernels) * _shares(shares, self._device)).unbind()
        return {id(blk): (scaled[2 * i], scaled[2 * i + 1]) for i, blk in enumerate(self._blocks)}


@shape_cache(maxsize=16)
def _shares(shares: tuple[float, ...], device: torch.device) -> Tensor:
    """``(g, 1, 1)`` fp32: each fusion half's share of its conv's input channels (constants of the model: cached)."""
    return torch.tensor(shares, dtype=torch.float32, device=device).view(-1, 1, 1)


def _rows_sum_to_one(x: Tensor) -> bool:
    """Whether a MobileViT block's aggregations, whose rows sum to 1 already (the input beside its local path, the
    path's half, the fusion conv's mix, renormalised over both halves), skip the tracker's renormalisation: where
    every operator is a launch (three a call) and the block's activations ``x`` are fp32. The CPU's eager route keeps
    it (its bits, which the targets digest holds), and so does every route under autocast or in a half-precision
    model: there the attention's label channels round to the activations' dtype (``attention_with_labels``), the
    rows after it sum to 1 only within that rounding, and renormalising here keeps a compiled or GPU step's
    targets those of the CPU's eager one (a compiled bf16 step's moved by up to 1.4e-5 without it)."""
    return not eager_cpu_routes(x.device) and x.dtype == torch.float32


def _pad(conv: Any) -> tuple[tuple[int, int], tuple[int, int]]:
    return (int(conv.padding[0]), int(conv.padding[1])), (int(conv.dilation[0]), int(conv.dilation[1]))


def _vit_attention(attn: Any, x: Tensor, labels: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """timm ``Attention`` on ``x`` ``(s, m, c)``; with ``labels`` ``(s, m, l)`` also the head-mean mix of them and,
    on timm's explicit path, the matrix ``(s, m, m)`` (head mean)."""
    q, k, v = rearrange(attn.qkv(x), "s m (three h d) -> three s h m d", three=3, h=attn.num_heads)
    q, k = attn.q_norm(q), attn.k_norm(k)
    mixed, matrix = None, None
    if not attn.fused_attn:
        a = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        if labels is not None:
            mixed = explicit_mix(a, labels)
        matrix = reduce(a.detach(), "s h m k -> s m k", "mean")
        out = attn.attn_drop(a) @ v
    else:
        dropout_p = attn.attn_drop.p if attn.training else 0.0
        if labels is not None:
            out, mixed = attention_with_labels(q, k, v, labels, attn.scale, dropout_p)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    out = attn.norm(rearrange(out, "s h m d -> s m (h d)"))
    return attn.proj_drop(attn.proj(out)), mixed, matrix


def _attention_matrix(attn: Any, x: Tensor) -> Tensor:
    """The head-mean attention matrix ``(s, m, m)`` float64 of a timm ``Attention`` (the reference's)."""
    q, k, _ = rearrange(attn.qkv(x), "s m (three h d) -> three s h m d", three=3, h=attn.num_heads)
    q, k = attn.q_norm(q), attn.k_norm(k)
    a = ((q.double() * attn.scale) @ k.double().transpose(-2, -1)).softmax(dim=-1)
    mean: Tensor = reduce(a, "s h m k -> s m k", "mean")
    return mean.detach()


def _linear_attention(attn: Any, x: Tensor) -> tuple[Tensor, Tensor]:
    """timm ``LinearSelfAttention`` on ``x`` ``(b, c, p, m)``: its output and the context scores ``(b, p, m)``
    (the softmax before its dropout: labels see the undropped weights, as for attention)."""
    query, key, value = attn.qkv_proj(x).split([1, attn.embed_dim, attn.embed_dim], dim=1)
    scores = F.softmax(query, dim=-1)
    context = (key * attn.attn_drop(scores)).sum(dim=-1, keepdim=True)
    out = attn.out_drop(attn.out_proj(F.relu(value) * context.expand_as(value)))
    return out, scores[:, 0].detach()


def _unfold_v2(blk: Any, x: Tensor, ph: int, pw: int, nh: int, nw: int) -> Tensor:
    b, c = int(x.shape[0]), int(x.shape[1])
    if blk.coreml_exportable:
        x = F.unfold(x, kernel_size=(ph, pw), stride=(ph, pw))
    else:
        x = x.reshape(b, c, nh, ph, nw, pw).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c, -1, nh * nw)


def _fold_v2(blk: Any, x: Tensor, ph: int, pw: int, nh: int, nw: int) -> Tensor:
    b, c = int(x.shape[0]), int(x.shape[1])
    if blk.coreml_exportable:
        return F.pixel_shuffle(x.reshape(b, c * ph * pw, nh, nw), upscale_factor=ph)
    x = x.reshape(b, c, ph, pw, nh, nw).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c, nh * ph, nw * pw)


def _unfold_v1(x: Tensor, ph: int, pw: int) -> Tensor:
    """timm's v1 unfold ``(b, c, h, w) -> (b p, m, c)``, as an einops pattern (the same element order)."""
    return rearrange(x, "b c (nh ph) (nw pw) -> (b ph pw) (nh nw) c", ph=ph, pw=pw)


def _fold_v1(x: Tensor, b: int, ph: int, pw: int, nh: int) -> Tensor:
    return rearrange(x, "(b ph pw) (nh nw) c -> b c (nh ph) (nw pw)", b=b, ph=ph, pw=pw, nh=nh)


def _token_logits(m: Any, x: Tensor) -> Tensor:
    """The classifier on every final position ``(b, h*w, classes)`` (timm's head without the pooling; a
    NormMlpClassifierHead's norm and MLP per position, as convnext's)."""
    if type(m.head) is NormMlpClassifierHead and not isinstance(m.head.norm, nn.LayerNorm):
        # a BatchNorm's or EvoNorm's statistics are the pooled map's: per position they would be others
        raise ValueError(
            f"per-position logits through a NormMlpClassifierHead with {type(m.head.norm).__name__} (resnet50_mlp: "
            "BatchNorm2d) have no rule here: the norm's statistics are over the pooled features, not one position's; "
            "use a scheme without token logits (TLAlign, NoAlign), or a head norm that normalises each position "
            "(LayerNorm2d)"
        )
    return _head_on_positions(m, x)


def _offset_index(ph: int, pw: int, nh: int, nw: int) -> Tensor:
    """``(p, m)``: the row-major grid position of patch ``m``'s pixel at offset ``p``."""
    return rearrange(torch.arange(nh * ph * nw * pw), "(nh ph nw pw) -> (ph pw) (nh nw)", nh=nh, ph=ph, nw=nw)


# ---------------------------------------------------------------------------------------------- the adapter
class AdaptedByobNet(AdaptedBase):
    """A timm ByobNet (MobileViT v1/v2, basic and bottleneck blocks) returning the scheme's aligned targets."""

    family = BYOBNET_FAMILY
    refusal = staticmethod(byobnet_refusal)

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        stem = _ops(_flat(m.stem))
        x, grid, start = run_stem(m.stem, stem, images, label_map)
        tracker = start_on_path(self.scheme, label_map, start, grid, _depth(m), stem)
        size, layer = (int(images.shape[2]), int(images.shape[3])), 0
        kernels, fusion = _forward_kernels(_blocks(m), tracker, x.device)
        for blk in _blocks(m):
            if type(blk) is MobileVitBlock:
                x, layer = self._v1(blk, x, tracker, layer, grid, size, fusion, kernels)
            elif type(blk) is MobileVitV2Block:
                x, layer = self._v2(blk, x, tracker, layer, grid, size, kernels)
            else:
                x, keep = _conv_block(blk, x)
                grid = block_labels(tracker, layer, grid, *_conv_paths(blk), keep, kernels)
                layer += 1
        x = m.final_conv(x)
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    @staticmethod
    def _v1(
        blk: Any, x: Tensor, tracker: LabelTracker, layer: int, grid: tuple[int, int], size: tuple[int, int],
        fusion: FusionKernels, kernels: Kernels | None,
    ) -> tuple[Tensor, int]:
        ph, pw, nh, nw = _patches(blk, grid, size)
        n, b = grid[0] * grid[1], int(x.shape[0])
        local = path_of(_flat(blk.conv_kxk))
        whole = _rows_sum_to_one(x)
        # both states side by side: the block's input, then its path (the local conv aggregates: no shortcut)
        tracker.aggregate(lambda y: torch.cat([y, apply_path(local, y, grid, kernels)[0]], dim=1), normalised=whole)
        shortcut, t = x, _unfold_v1(_local(blk, x), ph, pw)  # (b p) m c
        for tb in blk.transformer:
            labels = tracker.labels_for(layer)
            seq = None if labels is None else _to_sequences(labels[:, n:], ph, pw, nh, nw).flatten(0, 1)  # (b p) m l
            out, mixed, _ = _vit_attention(tb.attn, tb.norm1(t), seq)
            out, keep = branch(tb.drop_path1, tb.ls1(out))
            full = None
            if labels is not None and mixed is not None:
                full = _after(labels[:, :n], mixed, ph, pw, nh, nw)
            tracker.residual(layer, None if keep is None else _token_keep(keep, b, ph, pw, nh, nw), mixed=full)
            t = t + out
            out, keep = branch(tb.drop_path2, tb.ls2(tb.mlp(tb.norm2(t))))
            tracker.residual(layer, None, mixed=None)  # channel mixing: labels unchanged
            t = t + out
            layer += 1
        x = blk.conv_proj(_fold_v1(blk.norm(t), b, ph, pw, nh))
        if blk.conv_fusion is None:
            tracker.aggregate(lambda y: y[:, n:], normalised=whole)
            return x, layer
        padding, dilation = _pad(blk.conv_fusion.conv)
        tracker.aggregate(lambda y: conv_mix_pair(y[:, :n], y[:, n:], grid, *fusion.of(blk), padding, dilation), normalised=whole)
        return blk.conv_fusion(torch.cat((shortcut, x), dim=1)), layer

    @staticmethod
    def _v2(
        blk: Any, x: Tensor, tracker: LabelTracker, layer: int, grid: tuple[int, int], size: tuple[int, int],
        kernels: Kernels | None,
    ) -> tuple[Tensor, int]:
        ph, pw, nh, nw = _patches(blk, grid, size)
        local = path_of(_flat(blk.conv_kxk))
        aggregate_path(tracker, local, grid, kernels)  # no shortcut around the block
        t = _unfold_v2(blk, _local(blk, x), ph, pw, nh, nw)  # b c p m
        for tb in blk.transformer:
            out, scores = _linear_attention(tb.attn, tb.norm1(t))
            out, keep = branch(tb.drop_path1, out)
            labels, mixed = tracker.labels_for(layer), None
            if labels is not None:
                seq = _to_sequences(labels, ph, pw, nh, nw)  # b p m l
                context = torch.einsum("bpm,bpml->bpl", scores.float(), seq)  # b p l: every offset's context label
                b = int(context.shape[0])
                spread = context.view(b, 1, ph, 1, pw, -1).expand(b, nh, ph, nw, pw, -1)  # to its nh nw tokens
                mixed = spread.contiguous().view(b, nh * ph * nw * pw, -1)
            tracker.residual(layer, keep, mixed=mixed)
            t = t + out
            out, keep = branch(tb.drop_path2, tb.mlp(tb.norm2(t)))
            tracker.residual(layer, keep, mixed=None)
            t = t + out
            layer += 1
        return blk.conv_proj(_fold_v2(blk, blk.norm(t), ph, pw, nh, nw)), layer

    # ------------------------------------------------------------------ reference
    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit float64 matrices of every path, attention and fusion on dense labels."""
        m: Any = self.model
        stem = _ops(_flat(m.stem))
        x, grid, start = run_stem(m.stem, stem, images, label_map)
        rules = DenseRules(self.scheme, label_map, start, 0, _depth(m))
        if not label_map.token_space:
            rules.aggregate(path_matrix(stem, start)[0])
        size, layer = (int(images.shape[2]), int(images.shape[3])), 0
        for blk in _blocks(m):
            if isinstance(blk, _MOBILEVIT_BLOCKS):
                x, layer = _mobilevit_reference(blk, x, rules, layer, grid, size)
            else:
                x, keep = _conv_block(blk, x)
                grid = block_labels_reference(rules, layer, grid, *_conv_paths(blk), keep)
                layer += 1
        x = m.final_conv(x)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        return rules.result(output, output, "mean", token_logits)


def _token_keep(keep: Tensor, b: int, ph: int, pw: int, nh: int, nw: int) -> Tensor:
    """A drop-path draw over the ``(b p)`` offset sequences as a per-token keep ``(b, 2n)`` (the input half kept)."""
    path = rearrange(keep.view(b, ph, pw)[:, None, :, None, :].expand(b, nh, ph, nw, pw), "b nh ph nw pw -> b (nh ph nw pw)")
    return torch.cat([torch.ones_like(path), path], dim=1)


def _block_diag(first: Tensor, second: Tensor) -> Tensor:
    """``(b|1, n, n)`` x2 -> ``(b, 2n, 2n)``: the two halves' matrices side by side."""
    b = max(first.shape[0], second.shape[0])
    n = int(first.shape[-1])
    out = first.new_zeros(b, 2 * n, 2 * n)
    out[:, :n, :n] = first
    out[:, n:, n:] = second
    return out


def _mobilevit_reference(blk: Any, x: Tensor, rules: DenseRules, layer: int, grid: tuple[int, int], size: tuple[int, int]) -> tuple[Tensor, int]:
    """A MobileViT block on dense labels: the offset attention scattered to ``(b, n, n)`` grid matrices."""
    ph, pw, nh, nw = _patches(blk, grid, size)
    n, b, v1 = grid[0] * grid[1], int(x.shape[0]), type(blk) is MobileVitBlock
    index = _offset_index(ph, pw, nh, nw)
    local, _ = path_matrix(path_of(_flat(blk.conv_kxk)), grid)
    eye = torch.eye(n, dtype=torch.float64).unsqueeze(0)
    if v1:
        rules.aggregate(torch.cat([torch.eye(n, dtype=torch.float64), local], dim=0))  # duplicate, then the local conv
        shortcut, t = x, _unfold_v1(_local(blk, x), ph, pw)
    else:
        rules.aggregate(local)
        t = _unfold_v2(blk, _local(blk, x), ph, pw, nh, nw)
    for tb in blk.transformer:
        if v1:
            a = _attention_matrix(tb.attn, tb.norm1(t))  # (b p) m m
            out, _, _ = _vit_attention(tb.attn, tb.norm1(t), None)
            out, keep = branch(tb.drop_path1, tb.ls1(out))
            grid_a = window_matrix(rearrange(a, "(b p) m k -> b p m k", b=b), index, n)
            rules.mix(layer, _block_diag(eye, grid_a), None if keep is None else _token_keep(keep, b, ph, pw, nh, nw))
            t = t + out
            t = t + branch(tb.drop_path2, tb.ls2(tb.mlp(tb.norm2(t))))[0]
        else:
            out, scores = _linear_attention(tb.attn, tb.norm1(t))  # scores: b p m
            out, keep = branch(tb.drop_path1, out)
            rows = scores.double().unsqueeze(2).expand(-1, -1, nh * nw, -1)  # b p m m: every row the context scores
            rules.mix(layer, window_matrix(rows, index, n), keep)
            t = t + out
            t = t + branch(tb.drop_path2, tb.mlp(tb.norm2(t)))[0]
        layer += 1
    if not v1:
        return blk.conv_proj(_fold_v2(blk, blk.norm(t), ph, pw, nh, nw)), layer
    x = blk.conv_proj(_fold_v1(blk.norm(t), b, ph, pw, nh))
    if blk.conv_fusion is None:
        rules.aggregate(torch.cat([torch.zeros(n, n, dtype=torch.float64), torch.eye(n, dtype=torch.float64)], dim=1))
        return x, layer
    weight = blk.conv_fusion.conv.weight.detach().double().abs()
    per_pair = weight / weight.sum(dim=(-2, -1), keepdim=True).clamp_min(1e-300)  # o i kh kw
    c_in, pairs = int(blk.conv_kxk.conv.in_channels), per_pair.shape[0] * per_pair.shape[1]
    padding, dilation = _pad(blk.conv_fusion.conv)
    halves = [conv_matrix(grid, k.sum(dim=(0, 1)) / pairs, padding=padding, dilation=dilation)[0]
              for k in (per_pair[:, :c_in], per_pair[:, c_in:])]
    fused = torch.cat(halves, dim=1)  # n x 2n: each half's taps, rows renormalised together
    share = c_in / int(per_pair.shape[1])
    eye = torch.eye(n, dtype=torch.float64)
    # a position no in-grid tap reads (a fusion weight of zeros) keeps each half's own label by its share of the
    # channels, as the fast path's self taps (_common._self_tap) weighed by the halves' shares give
    fused = torch.where(fused.sum(dim=-1, keepdim=True) == 0, torch.cat([share * eye, (1 - share) * eye], dim=1), fused)
    rules.aggregate(row_normalise(fused))
    return blk.conv_fusion(torch.cat((shortcut, x), dim=1)), layer


def tiny_mobilevit(version: int = 1, num_classes: int = 10, **kwargs: Any) -> ByobNet:
    """A seeded MobileViT for 32x32 images, built as timm's configs build theirs: a 3x3/2 stem, an inverted residual,
    a strided inverted residual to 8x8 and a MobileViT block there (2x2 patches: 4 offsets x 16 patches, two
    transformer blocks); v1 with its fusion conv and a 1x1 final conv, v2 with none."""
    torch.manual_seed(0)
    inverted = dict(bottle_in=True, linear_out=True)  # timm's inverted residual: a depthwise bottleneck
    if version == 1:
        mobile = ByoBlockCfg(type="mobilevit", d=1, c=16, s=1,
                             block_kwargs=dict(transformer_dim=16, transformer_depth=2, patch_size=2))
    else:
        mobile = ByoBlockCfg(type="mobilevit2", d=1, c=16, s=1, br=0.5, gs=1,
                             block_kwargs=dict(transformer_depth=2, patch_size=2))
    blocks = (ByoBlockCfg(type="bottle", d=1, c=8, s=1, gs=1, br=2.0, block_kwargs=inverted),
              (ByoBlockCfg(type="bottle", d=1, c=16, s=2, gs=1, br=2.0, block_kwargs=inverted), mobile))
    cfg = ByoModelCfg(blocks=blocks, stem_chs=8, stem_type="3x3", stem_pool="", downsample="", act_layer="silu",
                      num_features=32 if version == 1 else 0)
    return ByobNet(cfg, num_classes=num_classes, **kwargs)


FAMILY = Family(
    name="byobnet",
    description=BYOBNET_FAMILY,
    refusal=AdaptedByobNet.refusal,
    build=AdaptedByobNet,
    example=tiny_mobilevit,
    timm_modules=("byobnet", "mobilevit"),
    speed_model="mobilevit_xxs",
)
