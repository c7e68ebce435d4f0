"""Adapter for timm's SelecSLS (``selecsls*``): a plain conv net whose blocks concatenate a chain's outputs.

The label rules of ``backbones._convnet`` (both walks in its ``AdaptedConvNet``). SelecSLS has no
residual sum: every unit forms each position from its windows alone, so its labels ``aggregate``
(as VGG's). Units, in order:

- the stem (3x3 stride-2 conv) from the pixels (a MixToken map starts on its grid);
- every stage of ``features``: a first block (``is_first``), then the blocks that follow it. A block
  runs a chain ``d1 = conv1(x)``, ``d2 = conv3(conv2(d1))``, ``d3 = conv5(conv4(d2))`` and fuses
  ``cat[d1, d2, d3]`` (a first block) or ``cat[d1, d2, d3, skip]`` by a 1x1 ``conv6``: each part is a
  prefix of the chain, ``Parallel`` branches weighed by their channel counts (a strided ``conv1``
  aggregates over its windows, a stride-1 3x3 mixes by its normalised |kernel|). ``skip`` is the
  stage's first block's output ``S``, which every later block of the stage reads, not only the one
  right after it: a stage is one unit whose path starts from ``S`` on each later block,
  ``T_j = Parallel.concat([(T_{j-1}, chain_j), ()], [chain channels, skip channels])`` (``T_1``
  empty: the second block reads ``S`` itself), the first block's path before it;
- every ``head`` conv (3x3 strided: windows; 3x3 stride 1: the conv rule; 1x1: a channel op);
- readout: ``pool("mean", 0)``: global average pooling, dropout and the linear ``fc`` (channel ops).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions.
"""

from __future__ import annotations

from typing import Any

from einops import rearrange
from timm.models.selecsls import SelecSls, SelecSlsBlock, SequentialList
from torch import Tensor, nn

from mixlabels.backbones._convnet import AdaptedConvNet, Parallel, Path, path_of, path_refusal
from mixlabels.backbones._family import Family, tiny

__all__ = ["AdaptedSelecSls", "SELECSLS_FAMILY", "selecsls_refusal", "TINY_CFG"]

SELECSLS_FAMILY = (
    "timm SelecSLS (selecsls*): every position a token; no residual sum, so every unit forms its positions from its "
    "windows: a block concatenates its conv chain's outputs (and its stage's first block's output), their labels "
    "joined weighed by channel count; stride-1 3x3 convs mix labels by the (out, in)-averaged normalised |kernel| "
    "(border-renormalised); strided convs aggregate over their windows; 1x1 convs, norms, activations as channel "
    "ops; stem from the pixels; global average pooling"
)

_CONVS = ("conv1", "conv2", "conv3", "conv4", "conv5", "conv6")


def _stages(m: Any) -> list[list[Any]]:
    """``features`` split into stages: a first block, then the blocks that read its output as their skip."""
    stages: list[list[Any]] = []
    for blk in m.features:
        if blk.is_first or not stages:
            stages.append([blk])
        else:
            stages[-1].append(blk)
    return stages


def _width(conv_bn: Any) -> int:
    return int(conv_bn[0].out_channels)


def _chain(blk: Any) -> tuple[Path, list[int]]:
    """A block's ``cat[d1, d2, d3]`` (before any skip): ``conv1``'s ops, then the parts as branches from ``d1``."""
    p23, p45 = path_of([*blk.conv2, *blk.conv3]), path_of([*blk.conv4, *blk.conv5])
    channels = [_width(blk.conv1), _width(blk.conv3), _width(blk.conv5)]
    return (*path_of(list(blk.conv1)), Parallel.concat([(), p23, (*p23, *p45)], channels)), channels


def _stage_path(stage: list[Any]) -> Path:
    """The path of a stage from its input: the first block's, then each later block's from the first's output ``S``."""
    first, *rest = stage
    chain, _ = _chain(first)
    path: Path = ()  # from S to the last block's output
    for blk in rest:
        part, channels = _chain(blk)
        skip = int(blk.conv6[0].in_channels) - sum(channels)
        path = (Parallel.concat([(*path, *part), ()], [sum(channels), skip]), *path_of(list(blk.conv6)))
    return (*chain, *path_of(list(first.conv6)), *path)


def selecsls_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm SelecSLS this adapter carries labels through (``None``: it is)."""
    if type(model) is not SelecSls:
        return f"{type(model).__name__} is not a timm SelecSls"
    m: Any = model
    if m.global_pool.pool_type != "avg" or not isinstance(m.fc, (nn.Linear, nn.Identity)):
        return f"the head (global_pool={m.global_pool.pool_type!r}) has no label readout; use 'avg' and a linear fc"
    why = path_refusal(list(m.stem), "the stem")
    for i, blk in enumerate(m.features):
        where = f"features block {i}"
        if why is not None:
            return why
        if type(blk) is not SelecSlsBlock:
            return f"{where} is {type(blk).__name__}; only timm's SelecSlsBlock is supported"
        if i == 0 and not blk.is_first:
            return f"{where} reads a skip no block before it made (is_first=False)"
        for name in _CONVS:
            why = why or path_refusal(list(getattr(blk, name)), f"{where}'s {name}")
        if why is None and not blk.is_first and blk.stride != 1:
            why = f"{where} is strided but not its stage's first block: its chain and its skip end on different grids"
    for i, conv in enumerate(m.head):
        why = why or path_refusal(list(conv), f"head conv {i}")
    return why


class AdaptedSelecSls(AdaptedConvNet):
    """A timm SelecSLS returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = SELECSLS_FAMILY
    refusal = staticmethod(selecsls_refusal)

    def _stem_modules(self) -> list[nn.Module]:
        m: Any = self.model
        return list(m.stem)

    def _blocks(self) -> list[nn.Module]:
        """Every stage (its blocks as one ``SequentialList``: no parameters of its own), then every head conv."""
        m: Any = self.model
        sequential: Any = SequentialList  # untyped in timm
        return [*(sequential(*stage) for stage in _stages(m)), *m.head]

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        if type(blk) is SequentialList:
            return blk([x])[0], None  # timm passes [x, skip] between blocks and reads x at the end
        return blk(x), None

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        if type(blk) is SequentialList:
            return _stage_path(list(blk)), None
        return path_of(list(blk)), None

    def _logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return m.forward_head(x)  # type: ignore[no-any-return]

    def _position_logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return m.fc(m.head_drop(rearrange(x, "b c h w -> b (h w) c")))  # type: ignore[no-any-return]


TINY_CFG: dict[str, Any] = {
    "block": SelecSlsBlock,
    # in_chs, skip_chs, mid_chs, out_chs, is_first, stride: stage 1's third block reads the first's output as skip
    "features": [(32, 0, 8, 8, True, 2), (8, 8, 8, 16, False, 1), (16, 8, 8, 16, False, 1),
                 (16, 0, 16, 16, True, 2), (16, 16, 16, 24, False, 1)],
    "head": [(24, 32, 3, 2), (32, 32, 3, 1), (32, 32, 1, 1)],
    "num_features": 32,
    "feature_info": [{"num_chs": 32, "reduction": 2, "module": "stem.2"}],
}
"""Two stages on a 32x32 image (grids 16 (stem), 8, 4, then the head's 2)."""

FAMILY = Family(
    name="selecsls",
    description=SELECSLS_FAMILY,
    refusal=AdaptedSelecSls.refusal,
    build=AdaptedSelecSls,
    example=tiny(SelecSls, cfg=TINY_CFG),
    timm_modules=("selecsls",),
    speed_model="selecsls42b",
)
