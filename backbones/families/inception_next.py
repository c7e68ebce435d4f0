"""Adapter for timm's InceptionNeXt (``inception_next_*``, the ``MetaNeXt`` class): MetaNeXt blocks of Inception depthwise
convs; builds on ``mambaout``'s stage walk (``_units``).

The label rules of ``backbones._convnet`` (both walks in its ``AdaptedConvNet``) on MetaNeXt's parts. Units after the
stem, in order: each stage's downsampler (not a layer), then its ``MetaNeXtBlock``\\ s, one layer each:

- the stem (a 4x4 stride-4 conv, its norm) starts from the pixels and aggregates over its windows (a MixToken map
  starts on the stem's grid);
- a downsampler (a norm, then a 2x2 stride-2 conv; with ``output_stride`` < 32 a stride-1 dilated or 'same' conv):
  ``aggregate`` over its windows, or by its conv's kernel where it has stride 1 (no shortcut);
- ``MetaNeXtBlock``: the token mixer ``InceptionDWConv2d`` splits the channels into an untouched part, a square
  depthwise conv, a ``1xk`` and a ``kx1`` band depthwise conv, and concatenates them: ``Parallel.concat`` weighed by
  channel count (each conv's labels by its channel-averaged normalised |kernel|, border-renormalised), as mambaout's
  gated block; then the norm, the ``ConvMlp`` (1x1 convs), layer scale: channel ops; ``residual(layer, keep,
  mixed=P Y)`` with timm's drop-path draw;
- readout: ``pool("mean", 0)`` (the ``MlpClassifierHead`` pools first, then its MLP, norm and classifier; no class
  token: TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions, ``k`` classes.
"""

from __future__ import annotations

from typing import Any

from einops import rearrange
from timm.layers.drop import DropPath
from timm.models.inception_next import ConvMlp, InceptionDWConv2d, MetaNeXt, MetaNeXtBlock, MlpClassifierHead
from torch import Tensor, nn

from mixlabels.backbones._common import branch
from mixlabels.backbones._convnet import AdaptedConvNet, Parallel, Path, Window, conv_norm_act_ops, path_of, path_refusal
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones.families.mambaout import _units

__all__ = ["AdaptedInceptionNeXt", "INCEPTION_NEXT_FAMILY", "inception_next_refusal", "partial_concat", "stride_one_refusal"]

INCEPTION_NEXT_FAMILY = (
    "timm InceptionNeXt (inception_next_*): every position a token; the Inception depthwise token mixer's untouched, "
    "square, 1xk and kx1 band channel parts are concatenated, so their labels join weighed by channel count (each "
    "conv's by its channel-averaged normalised |kernel|, border-renormalised), then by the residual rule; norms, 1x1 "
    "conv MLPs, layer scale and activations as channel ops; strided stem and downsampling convs aggregate over their "
    "windows; global average pooling (MLP head); stochastic depth"
)


def partial_concat(parts: list[tuple[list[nn.Module], int]]) -> Path:
    """Channel parts run side by side and concatenated (``torch.split``, then ``torch.cat``): one ``Parallel.concat``
    of each part's path (``[]``: the untouched part), weighed by its channel count; an empty part is left out."""
    kept = [(path_of(mods), n) for mods, n in parts if n > 0]
    return (Parallel.concat([p for p, _ in kept], [n for _, n in kept]),)


def _mixer_path(mixer: Any) -> Path:
    """``InceptionDWConv2d``'s four parts (``split_indexes``: untouched, square, 1xk band, kx1 band); another mixer's
    own ops."""
    if type(mixer) is not InceptionDWConv2d:
        return path_of([mixer])
    n_id, n_hw, n_w, n_h = (int(n) for n in mixer.split_indexes)
    return partial_concat([([], n_id), ([mixer.dwconv_hw], n_hw), ([mixer.dwconv_w], n_w), ([mixer.dwconv_h], n_h)])


def _mlp_modules(mlp: Any) -> list[nn.Module]:
    return [mlp.fc1, mlp.norm, mlp.act, mlp.drop, mlp.fc2]


def _branch_path(blk: Any) -> Path:
    return (*_mixer_path(blk.token_mixer), *path_of([blk.norm, *_mlp_modules(blk.mlp)]))



def stride_one_refusal(path: Path, where: str) -> str | None:
    """Why a residual branch's ``path`` leaves the block's grid (a window: a strided conv or a pool), else ``None``."""
    if any(isinstance(op, Window) for op in path):
        return f"{where} has a strided conv or a pool: the residual sum needs the branch on the block's grid (stride 1)"
    return None


def _block_refusal(blk: nn.Module, where: str) -> str | None:
    if type(blk) is not MetaNeXtBlock:
        return f"{where} is {type(blk).__name__}, not timm's MetaNeXtBlock"
    b: Any = blk
    if not isinstance(b.drop_path, (DropPath, nn.Identity)):
        return f"{where}'s drop_path is {type(b.drop_path).__name__}, not timm's DropPath"
    if type(b.mlp) is not ConvMlp:
        return f"{where}'s mlp is {type(b.mlp).__name__}, not timm's InceptionNeXt ConvMlp"
    mixer = b.token_mixer
    mods = [mixer.dwconv_hw, mixer.dwconv_w, mixer.dwconv_h] if type(mixer) is InceptionDWConv2d else [mixer]
    why = path_refusal(mods, f"{where}'s token mixer") or path_refusal([b.norm, *_mlp_modules(b.mlp)], f"{where}'s norm and mlp")
    return why or stride_one_refusal(_branch_path(b), f"{where}'s branch")


def inception_next_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm InceptionNeXt this adapter carries labels through (``None``: it is)."""
    if type(model) is not MetaNeXt:
        return f"{type(model).__name__} is not a timm MetaNeXt (InceptionNeXt)"
    m: Any = model
    if type(m.head) is not MlpClassifierHead:
        return f"the head is {type(m.head).__name__}, not timm's InceptionNeXt MlpClassifierHead"
    if m.head.global_pool.pool_type != "avg":
        return f"the head's pool_type={m.head.global_pool.pool_type!r} has no label readout; use 'avg'"
    why = path_refusal(conv_norm_act_ops(m.stem), "the stem")
    for s, stage in enumerate(m.stages):
        if why is None and not isinstance(stage.downsample, nn.Identity):
            why = path_refusal(conv_norm_act_ops(stage.downsample), f"stage {s}'s downsampler")
        for i, blk in enumerate(stage.blocks):
            why = why or _block_refusal(blk, f"stage {s} block {i}")
    return why


class AdaptedInceptionNeXt(AdaptedConvNet):
    """A timm InceptionNeXt returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = INCEPTION_NEXT_FAMILY
    refusal = staticmethod(inception_next_refusal)

    def _stem_modules(self) -> list[nn.Module]:
        m: Any = self.model
        return conv_norm_act_ops(m.stem)

    def _blocks(self) -> list[nn.Module]:
        return _units(self.model)

    def _is_layer(self, blk: Any) -> bool:
        return type(blk) is MetaNeXtBlock

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """timm's ``MetaNeXtBlock.forward`` with the drop-path draw exposed; a downsampler as itself."""
        if type(blk) is not MetaNeXtBlock:
            return blk(x), None
        h = blk.mlp(blk.norm(blk.token_mixer(x)))
        if blk.gamma is not None:
            h = h.mul(blk.gamma.reshape(1, -1, 1, 1))
        h, keep = branch(blk.drop_path, h)
        return h + x, keep

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        if type(blk) is MetaNeXtBlock:
            return _branch_path(blk), ()
        return path_of(conv_norm_act_ops(blk)), None  # a downsampler aggregates

    def _logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return m.forward_head(x)  # type: ignore[no-any-return]

    def _position_logits(self, x: Tensor) -> Tensor:
        """The head on every final position ``(b, h*w, k)``: its MLP, norm, dropout and classifier, pooling left out."""
        head: Any = self.model.head
        t = rearrange(x, "b c h w -> b (h w) c")
        return head.fc2(head.drop(head.norm(head.act(head.fc1(t)))))  # type: ignore[no-any-return]


FAMILY = Family(
    name="inception_next",
    description=INCEPTION_NEXT_FAMILY,
    refusal=AdaptedInceptionNeXt.refusal,
    build=AdaptedInceptionNeXt,
    example=tiny("inception_next_atto", depths=(1, 1, 2, 1), dims=(8, 16, 24, 32)),
    timm_modules=("inception_next",),
    speed_model="inception_next_atto",
)
