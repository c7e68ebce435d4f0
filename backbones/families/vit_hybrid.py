"""Adapter for timm's hybrid ViTs (``vision_transformer_hybrid``): a CNN's feature map as the patch embedding.

The labels follow the CNN by ``backbones._convnet``'s rules, then the transformer by ``vit``'s. Events, ``layer``
counting the CNN's residual blocks, then the transformer's blocks:

- the CNN (``HybridEmbed.backbone``): timm's ResNetV2 (non-pre-activation bottlenecks, weight-standardised convs with
  TF 'same' padding: a strided one's windows are resolved on each grid, a stride-1 odd one pads statically), its stem
  alone, a ``features_only`` timm ResNet (ResNet-D), or MobileCLIP's ``ConvStem`` (strided convs only). The stem
  aggregates from the pixels (a MixToken map is mixed on the stem's grid and starts there); each residual block is
  ``resnetv2``'s or ``resnet``'s: a stride-1 kxk conv mixes by the normalised |kernel| of the weight its forward
  convolves with (standardised), strided convs and pools aggregate, the shortcut keeps or aggregates, the branch joins
  by the residual rule;
- the projection (``HybridEmbed.proj``: a ``p x p`` stride-``p`` conv) aggregates over its windows (a 1x1 conv or
  none: a channel op); the token grid is the projection's output grid;
- the prefix tokens (class, register) carry the image's label from the start (Eq. 5), as in ``vit``: through the CNN
  every label path keeps their rows (they do not exist yet);
- the transformer's blocks: ``vit``'s (head-mean attention over prefix and patch tokens; the MLP a channel op);
  TransMix's class attention reads its patches on the token grid (they must tile the image);
- readout: ``pool("token", 0)`` or the mean of the patch tokens (``global_pool='avg'``).

Shapes: ``b`` batch, ``n`` positions or tokens, ``p`` prefix tokens, ``h`` heads, ``d`` head dim, ``c`` classes,
``l`` label channels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import timm
import torch
import torch.nn.functional as F
from einops import rearrange
from timm.layers.classifier import ClassifierHead
from timm.layers.drop import DropPath
from timm.layers.format import Format, nchw_to
from timm.layers.hybrid_embed import HybridEmbed
from timm.layers.mlp import GluMlp, Mlp, SwiGLU
from timm.layers.norm_act import GroupNormAct
from timm.layers.std_conv import StdConv2dSame
from timm.models._features import FeatureListNet
from timm.models.resnetv2 import Bottleneck, DownsampleConv, ResNetStage, ResNetV2, create_resnetv2_stem
from timm.models.vision_transformer import Block, VisionTransformer
from timm.models.vitamin import GeGluMlp
from timm.models.vision_transformer_hybrid import ConvStem
from torch import Tensor, nn

from mixlabels import AlignedOutput, AlignedTargets, Fork, LabelTracker, Readout, TokenLabelMap, TokenLayout
from mixlabels.backbones._attention_pool import map_token_targets_refusal
from mixlabels.backbones._common import AdaptedBase, branch, start_on_windows
from mixlabels.backbones._convnet import (
    _op_refusal,
    KernelConv,
    Path,
    Window,
    apply_path,
    block_kernels,
    block_labels,
    conv_norm_act_ops,
    path_grid,
    path_matrix,
    path_of,
    path_refusal,
    run_stem,
    window_axes,
)
from mixlabels.backbones._dense import DenseRules
from mixlabels.backbones._family import Family
from mixlabels.backbones._fsdp import through_hooks
from mixlabels.backbones.families import resnet, resnetv2
from mixlabels.backbones.families.vit import AdaptedViT, vit_refusal

__all__ = ["AdaptedViTHybrid", "VIT_HYBRID_FAMILY", "transformer_refusal", "vit_hybrid_refusal"]

VIT_HYBRID_FAMILY = (
    "timm hybrid VisionTransformer (HybridEmbed: R26/R50 ResNetV2 or its stem alone with TF 'same' weight-standardised "
    "convs, features_only ResNet-26D/50D, MobileCLIP's ConvStem): the CNN by the CNN rules (stride-1 kxk convs mix "
    "labels by the normalised |kernel| of the weight the forward uses; strided convs, pools and the projection "
    "aggregate over their windows; residual blocks by the residual rule), the prefix tokens keeping the image's label "
    "until the transformer, whose blocks are ViT's (head-mean attention); 'token' or 'avg' readout; stochastic depth"
)


# ---------------------------------------------------------------------------------------------- the CNN's label paths
def _standardised(conv: Any) -> Tensor:
    """The weight ``StdConv2dSame``'s forward convolves with, detached: each output channel's weight standardised over
    ``i kh kw`` (timm's ``batch_norm`` call; it subclasses ``nn.Conv2d``, not ``StdConv2d``)."""
    with torch.no_grad():
        flat = conv.weight.reshape(1, conv.out_channels, -1)
        return F.batch_norm(flat, None, None, training=True, momentum=0.0, eps=conv.eps).reshape_as(conv.weight)


def _ops(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """``modules`` as the ops their forward runs (``ConvNormAct``s opened; an empty ``Sequential``, a norm a
    ``ConvNormAct`` does not apply, dropped)."""
    out: list[nn.Module] = []
    for module in modules:
        for op in conv_norm_act_ops(module):
            out.extend(conv_norm_act_ops(op) if type(op) is nn.Sequential else [op])
    return out


def _refusal(modules: Sequence[nn.Module], where: str) -> str | None:
    """``path_refusal`` with timm's ``StdConv2dSame``: strided, its TF 'same' windows are resolved on each grid; stride 1
    with an odd kernel, its padding is static (timm sets ``same_pad`` only where it is not)."""
    for i, module in enumerate(modules):
        if type(module) is StdConv2dSame:
            conv: Any = module
            if conv.padding_mode != "zeros" or conv.dilation != (1, 1) or conv.groups != 1:
                return f"{where} module {i} is a StdConv2dSame with {conv.padding_mode} padding, dilation or groups; no label rule here"
            if conv.same_pad and conv.stride == (1, 1):
                return (f"{where} module {i} is a stride-1 StdConv2dSame with kernel {tuple(conv.kernel_size)}: TF 'same' "
                        "padding pads one side more, which no label rule here follows; use an odd kernel")
            continue
        why = _op_refusal(module, f"{where} module {i}", resnetv2._MAP_NORMS)
        if why is not None:
            return why
    return None


def _path(modules: Sequence[nn.Module]) -> Path:
    """``path_of`` with timm's ``StdConv2dSame`` (checked by ``_refusal``): strided, a TF 'same' window; stride-1
    kxk, a ``KernelConv`` of its standardised weight."""
    ops: list[Any] = []
    for module in modules:
        conv: Any = module
        if type(module) is not StdConv2dSame:
            ops.extend(path_of([module]))
        elif conv.same_pad:
            ops.append(Window(tuple(conv.kernel_size), tuple(conv.stride), (0, 0), same=True))
        elif conv.stride != (1, 1):
            ops.append(Window(tuple(conv.kernel_size), tuple(conv.stride), tuple(conv.padding)))
        elif conv.kernel_size != (1, 1):
            ops.append(KernelConv(functools.partial(_standardised, conv), tuple(conv.padding), tuple(conv.dilation)))
    return tuple(ops)


@dataclass(frozen=True, eq=False)
class _CNN:
    """A hybrid's CNN as its stem, its residual blocks (each with its forward and its branch's and shortcut's paths)
    and its tail (after the last block, its spatial ops ``tail_path``: aggregated with the projection's)."""

    stem: Callable[[Tensor], Tensor]
    stem_path: Path
    blocks: tuple[nn.Module, ...]
    forward: Callable[[Any, Tensor], tuple[Tensor, Tensor | None]]
    paths: tuple[tuple[Path, Path], ...]
    tail: Callable[[Tensor], Tensor]
    tail_path: Path = ()


def _sequence(modules: Sequence[nn.Module]) -> Callable[[Tensor], Tensor]:
    def run(x: Tensor) -> Tensor:
        for module in modules:
            x = module(x)
        return x

    return run


def _v2_block(blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
    """timm's non-pre-activation ResNetV2 ``Bottleneck`` with the drop-path draw exposed."""
    shortcut = x if blk.downsample is None else blk.downsample(x)
    h = _sequence(resnetv2._branch_modules(blk))(x)
    h, keep = branch(blk.drop_path, h)
    return blk.act3(h + shortcut), keep


def _v2_paths(blk: Any) -> tuple[Path, Path]:
    return _path(resnetv2._branch_modules(blk)), _path(resnetv2._flat(blk.downsample))


def _resnet_blocks(bb: Any) -> list[nn.Module]:
    return [blk for name in ("layer1", "layer2", "layer3", "layer4") if name in bb for blk in bb[name]]


def _cnn(bb: Any) -> _CNN:
    """The parts of a backbone ``vit_hybrid_refusal`` accepts."""
    if type(bb) is ResNetV2:
        blocks = tuple(resnetv2._blocks(bb))
        stem = list(bb.stem.children())
        return _CNN(_sequence(stem), _path(stem), blocks, _v2_block, tuple(_v2_paths(b) for b in blocks), lambda x: bb.forward_head(bb.norm(x)))
    if type(bb) is FeatureListNet:
        stem = resnet._stem_modules(bb)
        blocks = tuple(_resnet_blocks(bb))
        return _CNN(_sequence(stem), path_of(stem), blocks, resnet._block, tuple(resnet._paths(b) for b in blocks), nn.Identity())
    ops = _ops([bb])  # a stem alone: ResNetV2's (a Sequential of conv, norm, pool) or MobileCLIP's ConvStem
    return _CNN(bb, _path(ops), (), _v2_block, (), nn.Identity())


def _backbone_refusal(bb: Any) -> str | None:
    """Why a ``HybridEmbed``'s backbone has no label rule here (``None``: it has)."""
    if type(bb) is ResNetV2:
        head = bb.head
        if type(head) is not ClassifierHead or not head.global_pool.is_identity() or type(head.fc) is not nn.Identity:
            return "the ResNetV2 backbone pools or classifies its map; build it with num_classes=0, global_pool=''"
        if not isinstance(head.flatten, nn.Identity):
            return "the ResNetV2 backbone's head flattens its map"
        why = path_refusal([head.drop, bb.norm], "the ResNetV2 backbone's head and norm") or _refusal(list(bb.stem.children()), "the backbone's stem")
        if why is not None:
            return why
        for i, stage in enumerate(bb.stages):
            if type(stage) is not ResNetStage:
                return f"the backbone's stage {i} is {type(stage).__name__}; only timm's ResNetStage is supported"
        for i, blk in enumerate(resnetv2._blocks(bb)):
            where = f"the backbone's block {i}"
            if type(blk) is not Bottleneck:
                return f"{where} is {type(blk).__name__}; only timm's non-pre-activation Bottleneck is supported in a hybrid"
            if type(blk.drop_path) not in (DropPath, nn.Identity):
                return f"{where}'s drop_path is {type(blk.drop_path).__name__}, not timm's DropPath"
            if blk.downsample is not None and type(blk.downsample) is not DownsampleConv:
                return f"{where}'s shortcut is {type(blk.downsample).__name__}; only DownsampleConv is supported in a hybrid"
            why = _refusal([*resnetv2._branch_modules(blk), blk.act3], f"{where}'s branch") or _refusal(resnetv2._flat(blk.downsample), f"{where}'s shortcut")
            if why is not None:
                return why
        return None
    if type(bb) is FeatureListNet:
        names = list(bb.keys())
        if names[:4] != ["conv1", "bn1", "act1", "maxpool"] or any(n not in ("layer1", "layer2", "layer3", "layer4") for n in names[4:]):
            return f"the features_only backbone's modules {names} are not a timm ResNet's"
        if names[-1] not in bb.return_layers:
            return "the features_only backbone's last feature is not its last module's output"
        return path_refusal(resnet._stem_modules(bb), "the backbone's stem") or resnet.blocks_refusal(_resnet_blocks(bb), "the backbone's block")
    if type(bb) is ConvStem or (type(bb) is nn.Sequential and all(type(m) is not nn.Sequential for m in bb)):
        return _refusal(_ops([bb]), "the backbone")
    return f"the backbone is {type(bb).__name__}; only a ResNetV2, its stem, a features_only ResNet or a ConvStem has a label rule here"


def vit_hybrid_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm hybrid ViT this adapter carries labels through (``None``: it is)."""
    m: Any = model
    return transformer_refusal(model) or _backbone_refusal(m.patch_embed.backbone)


def transformer_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm ViT over a ``HybridEmbed`` this adapter carries labels through, its backbone
    aside (``None``: it is; the ``vitamin`` family asks too)."""
    if not isinstance(model, VisionTransformer):
        return f"{type(model).__name__} is not a timm VisionTransformer"
    m: Any = model
    if type(m.patch_embed) is not HybridEmbed:
        return f"patch_embed is {type(m.patch_embed).__name__}, not timm's HybridEmbed (the vit family takes PatchEmbed)"
    why = vit_refusal(model, embed=HybridEmbed)
    if why is not None:
        return why
    if m.global_pool not in ("token", "avg"):
        return f"global_pool={m.global_pool!r} has no label readout in a hybrid; use 'token' or 'avg'"
    pe = m.patch_embed
    if not (pe.flatten or pe.output_fmt in (Format.NCHW, Format.NHWC)):
        return f"HybridEmbed's output format {pe.output_fmt} is not one the transformer reads"
    why = path_refusal([pe.proj], "HybridEmbed's projection")
    if why is None and isinstance(pe.proj, nn.Conv2d) and pe.proj.kernel_size != pe.proj.stride:
        why = "HybridEmbed's projection overlaps its windows"
    for i, blk in enumerate(m.blocks):
        # the reference walks timm's pre-norm Block (vit_refusal also takes ResPostBlock and the parallel blocks,
        # which the vit family's reference walks); a block's MLP must act on each token alone
        if why is None and type(blk) is not Block:
            why = f"block {i} is {type(blk).__name__}; only timm's Block is supported after a hybrid's CNN"
        if why is None and type(blk.mlp) not in TOKEN_MLPS:
            why = f"block {i}'s MLP is {type(blk.mlp).__name__}; only Mlp, GluMlp, SwiGLU or GeGluMlp (per-token channel mixing) has a rule here"
    return why


TOKEN_MLPS = (Mlp, GluMlp, SwiGLU, GeGluMlp)
"""Per-token MLPs (channel ops): what a hybrid's blocks may hold."""


# ---------------------------------------------------------------------------------------------- the tracker's views
class _Patches:
    """The tracker as the CNN sees it: only the patch positions (the prefix tokens, not formed yet, keep their
    labels: every merge and mix passes their rows), the class attention read on the token grid."""

    def __init__(self, tracker: LabelTracker, prefix: int, grid: tuple[int, int] | None = None) -> None:
        self.tracker, self.prefix, self.grid = tracker, prefix, grid
        self._kept: Tensor | None = None

    def labels_for(self, layer: int) -> Tensor | None:
        y = self.tracker.labels_for(layer)
        if y is None or not self.prefix:
            return y
        self._kept = y[:, : self.prefix]  # b p l: the residual's mixed labels keep them
        return y[:, self.prefix :]

    def wants_class_attention(self, layer: int) -> bool:
        return self.tracker.wants_class_attention(layer)

    def class_attention(self, layer: int, weights: Tensor, grid: tuple[int, int] | None = None) -> None:
        self.tracker.class_attention(layer, weights, grid or self.grid)

    def residual(self, layer: int, keep: Tensor | None, *, mixed: Tensor | None) -> None:
        if mixed is not None and self.prefix:
            assert self._kept is not None  # labels_for(layer) came first
            mixed = torch.cat([self._kept.to(mixed.dtype), mixed], dim=1)
        self.tracker.residual(layer, keep, mixed=mixed)

    def aggregate(self, merge: Callable[[Tensor], Tensor], *, normalised: bool = False) -> None:
        p = self.prefix
        self.tracker.aggregate(lambda y: torch.cat([y[:, :p], merge(y[:, p:])], dim=1) if p else merge(y), normalised=normalised)

    def fork(self) -> Fork:
        return self.tracker.fork()

    def join(
        self, fork: Fork, share: float, *, merge: Callable[[Tensor], Tensor] | None = None, keep: Tensor | None = None,
        normalised: bool = False,
    ) -> None:
        p = self.prefix  # the prefix rows are the same in both parts: the join keeps them
        through = None if merge is None else (lambda y: torch.cat([y[:, :p], merge(y[:, p:])], dim=1) if p else merge(y))
        self.tracker.join(fork, share, merge=through, keep=keep, normalised=normalised)

    def pool(self, how: Readout, first: int) -> None:
        self.tracker.pool(how, first)

    def finish(self) -> AlignedTargets:
        return self.tracker.finish()


def _with_prefix(matrix: Tensor, p: int) -> Tensor:
    """``[[I_p, 0], [0, matrix]]``: the prefix tokens keep their labels."""
    out = torch.zeros(matrix.shape[0] + p, matrix.shape[1] + p, dtype=torch.float64)
    out[:p, :p] = torch.eye(p, dtype=torch.float64)
    out[p:, p:] = matrix
    return out


def _stride(path: Path) -> tuple[int, int]:
    sh, sw = 1, 1
    for op in path:
        if isinstance(op, Window):
            sh, sw = sh * op.stride[0], sw * op.stride[1]
    return sh, sw


class AdaptedViTHybrid(AdaptedViT):
    """A timm hybrid ViT returning the scheme's aligned targets (``adapted(images)`` is the model's); the
    transformer's blocks are ``AdaptedViT``'s."""

    family = VIT_HYBRID_FAMILY
    refusal = staticmethod(vit_hybrid_refusal)  # type: ignore[assignment]  # vit's takes the embedding's class too
    # per-block FSDP2 sharding has not been run with the CNN embedding (tests/test_fsdp.py): the adapted root alone
    fsdp_units = AdaptedBase.fsdp_units

    def __init__(self, model: nn.Module, scheme: Any, reference: bool = False) -> None:
        super().__init__(model, scheme, reference)
        m: Any = model
        self._cnn = self._backbone(m.patch_embed.backbone)  # built once: the StdConv2dSame label kernels are ops made here
        self._proj = self._cnn.tail_path + path_of([m.patch_embed.proj])

    def _backbone(self, bb: Any) -> _CNN:
        """The parts of the embedding's backbone (the refusal accepted it)."""
        return _cnn(bb)

    def reference_grid(self, label_map: TokenLabelMap) -> tuple[int, int]:
        return label_map.image_size[0], label_map.image_size[1]  # the pixels: the stem sums them

    def _embed(self, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int], tuple[int, int]]:
        """The stem's output (MixToken-mixed for a token-space map), its grid and the grid the labels start on."""
        return run_stem(self._cnn.stem, self._cnn.stem_path, images, label_map)

    def _tokens(self, x: Tensor) -> Tensor:
        """``HybridEmbed``'s projection and layout, the position embedding and prefix tokens: ``(b, n, d)``."""
        m: Any = self.model
        pe = m.patch_embed
        x = pe.proj(self._cnn.tail(x))
        grid, built = (int(x.shape[2]), int(x.shape[3])), tuple(int(s) for s in pe.grid_size)
        if m.pos_embed is not None and not m.dynamic_img_size and grid != built:
            raise ValueError(
                f"the images give a {grid[0]}x{grid[1]} token grid, but this model's position embedding is for "
                f"{built[0]}x{built[1]} (img_size {tuple(pe.img_size)}): feed images of the model's img_size, or create the "
                "model with img_size set to yours (or dynamic_img_size=True)"
            )
        x = rearrange(x, "b d h w -> b (h w) d") if pe.flatten else nchw_to(x, pe.output_fmt)
        return m.norm_pre(m.patch_drop(m._pos_embed(x)))  # type: ignore[no-any-return]

    def _check_tiles(self, label_map: TokenLabelMap, grid: tuple[int, int], layers: range, wants: Callable[[int], bool]) -> None:
        """TransMix weighs the class attention's patches by their areas: they must tile the image."""
        if not any(wants(i) for i in layers):
            return
        path = self._cnn.stem_path + tuple(op for b, s in self._cnn.paths for op in s) + self._proj
        sh, sw = _stride(path)
        if (grid[0] * sh, grid[1] * sw) != label_map.image_size:
            raise ValueError(
                f"the class attention reads a {grid[0]}x{grid[1]} token grid of {sh}x{sw}-pixel patches, which does not "
                f"tile the {label_map.image_size[0]}x{label_map.image_size[1]} image, so its patches have no exact area "
                f"weights for this scheme's target (TransMix); use an image size divisible by {sh}x{sw}, or TLAlign()"
            )

    def _readout(self) -> tuple[Readout, int]:
        m: Any = self.model
        if m.global_pool == "token":
            return "token", 0
        return "mean", 0 if m.pool_include_prefix else m.num_prefix_tokens

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        cnn, p = self._cnn, m.num_prefix_tokens
        x, grid, start = self._embed(images, label_map)
        first = len(cnn.blocks)
        depth, class_token = first + len(m.blocks), m.global_pool == "token"
        if start == grid:  # a MixToken map: on the stem's grid
            tracker = self.scheme.start(label_map, TokenLayout(grid=grid, num_prefix=p, depth=depth, class_token=class_token))
        else:
            lead = 0
            while lead < len(cnn.stem_path) and isinstance(cnn.stem_path[lead], Window):
                lead += 1
            windows = window_axes([w for w in cnn.stem_path[:lead] if isinstance(w, Window)], start)
            tracker, mid = start_on_windows(self.scheme, label_map, start, depth, windows, p, class_token)
            rest = cnn.stem_path[lead:]
            if rest:
                _Patches(tracker, p).aggregate(lambda y: apply_path(rest, y, mid)[0], normalised=True)
        patches = _Patches(tracker, p)
        kernels = block_kernels(patches, cnn.paths)
        for layer, blk in enumerate(cnn.blocks):
            x, keep = cnn.forward(blk, x)
            grid = block_labels(patches, layer, grid, *cnn.paths[layer], keep, kernels)
        if self._proj:
            g, proj = grid, self._proj
            patches.aggregate(lambda y: apply_path(proj, y, g)[0], normalised=True)
            grid = path_grid(proj, grid)
        x = self._tokens(x)
        map_token_targets_refusal(m, self.scheme)
        self._check_tiles(label_map, grid, range(first, depth), tracker.wants_class_attention)
        on_tokens = _Patches(tracker, 0, grid)  # the class attention's patches: the token grid
        for i, blk in enumerate(m.blocks):
            x = through_hooks(blk, functools.partial(self._block, blk, layer=first + i, tracker=on_tokens), x)
        x = m.norm(x)
        tracker.pool(*self._readout())
        output = m.forward_head(x)
        token_logits = m.head(m.head_drop(m.fc_norm(x[:, p:]))) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    # ------------------------------------------------------------------------------------------ reference
    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit ``(p + n', p + n)`` matrices of every CNN path and every attention, on dense labels."""
        m: Any = self.model
        cnn, p = self._cnn, m.num_prefix_tokens
        x, grid, start = self._embed(images, label_map)
        first = len(cnn.blocks)
        depth = first + len(m.blocks)
        rules = DenseRules(self.scheme, label_map, start, p, depth, class_token=m.global_pool == "token")
        if start != grid:
            rules.aggregate(_with_prefix(path_matrix(cnn.stem_path, start)[0], p))
        for layer, blk in enumerate(cnn.blocks):
            x, keep = cnn.forward(blk, x)
            branch_path, shortcut = cnn.paths[layer]
            mixed = None
            if rules.rules.wants_labels(layer):
                mixed = _with_prefix(path_matrix(branch_path, grid)[0], p) @ rules.y
            merge, grid = path_matrix(shortcut, grid)
            if shortcut:
                rules.aggregate(_with_prefix(merge, p))
            if mixed is not None:
                rules.y = rules.rules.residual(rules.y, mixed, keep)
        merge, grid = path_matrix(self._proj, grid)
        rules.aggregate(_with_prefix(merge, p))
        x = self._tokens(x)
        map_token_targets_refusal(m, self.scheme)
        self._check_tiles(label_map, grid, range(first, depth), rules.wants_class_attention)
        for i, blk in enumerate(m.blocks):
            attn, layer = blk.attn, first + i
            h = blk.norm1(x)
            q, k, v = rearrange(attn.qkv(h), "b n (three h d) -> three b h n d", three=3, h=attn.num_heads)
            q, k = attn.q_norm(q), attn.k_norm(k)
            a = torch.softmax(q @ k.transpose(-2, -1) * attn.scale, dim=-1)  # b h n n
            out = attn.norm(rearrange(F.dropout(a, attn.attn_drop.p, attn.training) @ v, "b h n d -> b n (h d)"))
            out, keep = branch(blk.drop_path1, blk.ls1(attn.proj_drop(attn.proj(out))))
            rules.mix(layer, a.detach().double().mean(dim=1), keep)
            if rules.wants_class_attention(layer):
                rules.attend_class(a.detach().double()[:, :, 0].mean(dim=1), grid)
            x = x + out
            x = x + branch(blk.drop_path2, blk.ls2(blk.mlp(blk.norm2(x))))[0]  # labels unchanged
        x = m.norm(x)
        output = m.forward_head(x)
        token_logits = m.head(m.head_drop(m.fc_norm(x[:, p:]))) if self.scheme.needs_token_logits else None
        how, first_token = self._readout()
        return rules.result(output, output, how, token_logits, first_token)


def tiny_hybrid(backbone: str = "resnetv2", drop_path_rate: float = 0.0, **kwargs: Any) -> nn.Module:
    """A seeded tiny hybrid on 32x32 images (10 classes): ``backbone`` ``"resnetv2"`` (two stages of TF 'same'
    weight-standardised bottlenecks, stride 8), ``"stem"`` (ResNetV2's stem alone, a 2x2 projection), ``"resnet"``
    (a features_only ResNet-D, two stages) or ``"convstem"`` (MobileCLIP's)."""
    torch.manual_seed(0)
    embed: dict[str, Any] = {}
    if backbone == "resnetv2":
        bb: nn.Module = ResNetV2(layers=[1, 1], channels=(8, 16), stem_chs=8, num_classes=0, global_pool="", preact=False,
                                 stem_type="same", conv_layer=StdConv2dSame, norm_layer=functools.partial(GroupNormAct, num_groups=2),
                                 drop_path_rate=drop_path_rate)  # fmt: skip
    elif backbone == "stem":
        bb = create_resnetv2_stem(3, 8, stem_type="same", preact=False, conv_layer=StdConv2dSame,
                                           norm_layer=functools.partial(GroupNormAct, num_groups=2))  # fmt: skip
        kwargs = {"patch_size": 2} | kwargs
    elif backbone == "resnet":
        bb = timm.create_model("resnet26d", layers=(1, 1, 1, 1), channels=(8, 16, 24, 32), stem_width=8, features_only=True,
                               out_indices=[2], drop_path_rate=drop_path_rate)  # fmt: skip
    else:
        bb = ConvStem(channels=(8, 8, 32), stride=(2, 2, 2), kernel_size=(2, 2, 2), padding=0, act_layer=nn.GELU)
        embed, kwargs = {"proj": False}, {"no_embed_class": True} | kwargs
    layer = functools.partial(HybridEmbed, backbone=bb, **embed)
    args = {"img_size": 32, "patch_size": 1, "embed_dim": 32, "depth": 2, "num_heads": 2, "num_classes": 10} | kwargs
    return VisionTransformer(embed_layer=layer, drop_path_rate=drop_path_rate, **args)


FAMILY = Family(
    name="vit_hybrid",
    description=VIT_HYBRID_FAMILY,
    refusal=vit_hybrid_refusal,
    build=AdaptedViTHybrid,
    example=tiny_hybrid,
    timm_modules=("vision_transformer_hybrid",),
    speed_model="vit_small_r26_s32_224",
    class_token=True,
)
