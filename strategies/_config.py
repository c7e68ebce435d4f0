"""Pydantic configs of the mixers: frozen, strict, keyed by ``kind``; ``build()`` returns the mixer.

Example:
    >>> from pydantic import TypeAdapter
    >>> cfg = TypeAdapter(MixerConfig).validate_python(
    ...     {"kind": "switch", "probs": [0.5, 0.5], "mixers": [
    ...         {"kind": "mixup", "num_classes": 10, "alpha": 0.8},
    ...         {"kind": "cutmix", "num_classes": 10, "alpha": 1.0}]})
    >>> type(cfg.build()).__name__
    'Switch'
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import Field, model_validator

from mixlabels import Config
from mixlabels.strategies._cutmix import CutMix
from mixlabels.strategies._fmix import FMix
from mixlabels.strategies._gridmix import GridMix
from mixlabels.strategies._mixtoken import MixToken
from mixlabels.strategies._mixup import MixUp
from mixlabels.strategies._patch import BlockwiseMix, RandomPatchMix
from mixlabels.strategies._resizemix import ResizeMix
from mixlabels.strategies._saliencymix import SaliencyMix
from mixlabels.strategies._sampling import Mode, Pairing
from mixlabels.strategies._switch import Switch
from mixlabels.strategies._tokenmix import TokenMix

__all__ = [
    "CutMixConfig",
    "MixUpConfig",
    "RandomPatchMixConfig",
    "BlockwiseMixConfig",
    "MixTokenConfig",
    "FMixConfig",
    "ResizeMixConfig",
    "SaliencyMixConfig",
    "GridMixConfig",
    "TokenMixConfig",
    "SwitchConfig",
    "MixerConfig",
]

Alpha = Annotated[float, Field(gt=0, allow_inf_nan=False, description="Beta(alpha, alpha) concentration")]
Cell = Annotated[int, Field(ge=1, description="cell side in pixels; must divide the image")]
Ratio = Annotated[Optional[float], Field(ge=0, le=1, description="fixed fraction of partner cells; None draws it from Beta")]


class _PairConfig(Config[object]):
    """Fields every pairwise mixer takes."""

    num_classes: Annotated[int, Field(ge=1, description="number of classes c")]
    label_smoothing: Annotated[float, Field(ge=0, lt=1, description="smoothing applied to the expanded targets")] = 0.0
    prob: Annotated[float, Field(ge=0, le=1, description="probability of mixing per batch, pair or sample")] = 1.0
    mode: Annotated[Mode, Field(description="one draw per batch, per pair or per element (timm)")] = "batch"
    pairing: Annotated[Pairing, Field(description="partner of sample i: b-1-i (flip, timm), a random derangement, or i-1 (roll, torchvision)")] = "flip"


class CutMixConfig(_PairConfig):
    """Config of ``CutMix``."""

    kind: Literal["cutmix"] = "cutmix"
    alpha: Alpha = 1.0
    minmax: Annotated[Optional[tuple[float, float]], Field(description="timm's cutmix_minmax side ratios")] = None
    correct_lam: Annotated[bool, Field(description="lambda is the clipped box area (timm's default)")] = True
    patch_size: Annotated[Optional[int], Field(ge=1, description="snap boxes to this cell size")] = None

    def build(self) -> CutMix:
        return CutMix(
            self.num_classes, self.alpha, self.minmax, self.correct_lam, self.patch_size,
            self.label_smoothing, self.prob, self.mode, self.pairing,
        )


class MixUpConfig(_PairConfig):
    """Config of ``MixUp``."""

    kind: Literal["mixup"] = "mixup"
    alpha: Alpha = 0.8

    def build(self) -> MixUp:
        return MixUp(self.num_classes, self.alpha, self.label_smoothing, self.prob, self.mode, self.pairing)


class RandomPatchMixConfig(_PairConfig):
    """Config of ``RandomPatchMix``."""

    kind: Literal["random_patch"] = "random_patch"
    cell_size: Cell = 16
    alpha: Alpha = 1.0
    ratio: Ratio = None

    def build(self) -> RandomPatchMix:
        return RandomPatchMix(
            self.num_classes, self.cell_size, self.alpha, self.ratio, self.label_smoothing, self.prob, self.mode, self.pairing
        )


class BlockwiseMixConfig(_PairConfig):
    """Config of ``BlockwiseMix``."""

    kind: Literal["blockwise"] = "blockwise"
    cell_size: Cell = 16
    alpha: Alpha = 1.0
    ratio: Ratio = None
    min_cells: Annotated[int, Field(ge=1, description="smallest block, in cells (BEiT: 16)")] = 16
    max_cells: Annotated[Optional[int], Field(ge=1, description="largest block, in cells")] = None
    min_aspect: Annotated[float, Field(gt=0, description="smallest block aspect ratio (BEiT: 0.3)")] = 0.3
    max_aspect: Annotated[Optional[float], Field(gt=0, description="largest aspect ratio; default 1/min_aspect")] = None

    def build(self) -> BlockwiseMix:
        return BlockwiseMix(
            self.num_classes, self.cell_size, self.alpha, self.ratio, self.min_cells, self.max_cells,
            self.min_aspect, self.max_aspect, self.label_smoothing, self.prob, self.mode, self.pairing,
        )


class MixTokenConfig(_PairConfig):
    """Config of ``MixToken``."""

    kind: Literal["mixtoken"] = "mixtoken"
    alpha: Alpha = 1.0
    patch_size: Annotated[int, Field(ge=1, description="the backbone's patch size")] = 16

    def build(self) -> MixToken:
        return MixToken(self.num_classes, self.alpha, self.patch_size, self.label_smoothing, self.prob, self.mode, self.pairing)


class FMixConfig(_PairConfig):
    """Config of ``FMix``."""

    kind: Literal["fmix"] = "fmix"
    alpha: Alpha = 1.0
    decay_power: Annotated[float, Field(gt=0, allow_inf_nan=False, description="spectral decay of the noise (paper: 3)")] = 3.0
    cell_size: Annotated[Optional[int], Field(ge=1, description="mask cell side in pixels; None: per pixel")] = None

    def build(self) -> FMix:
        return FMix(
            self.num_classes, self.alpha, self.decay_power, self.cell_size, self.label_smoothing, self.prob, self.mode, self.pairing
        )


class ResizeMixConfig(_PairConfig):
    """Config of ``ResizeMix``."""

    kind: Literal["resizemix"] = "resizemix"
    scale: Annotated[tuple[float, float], Field(description="(min, max) side ratio of the pasted partner (paper: 0.1, 0.8)")] = (0.1, 0.8)
    patch_size: Annotated[Optional[int], Field(ge=1, description="snap boxes to this cell size")] = None

    def build(self) -> ResizeMix:
        return ResizeMix(self.num_classes, self.scale, self.patch_size, self.label_smoothing, self.prob, self.mode, self.pairing)


class SaliencyMixConfig(_PairConfig):
    """Config of ``SaliencyMix``."""

    kind: Literal["saliencymix"] = "saliencymix"
    alpha: Alpha = 1.0
    patch_size: Annotated[Optional[int], Field(ge=1, description="snap boxes to this cell size")] = None

    def build(self) -> SaliencyMix:
        return SaliencyMix(self.num_classes, self.alpha, self.patch_size, self.label_smoothing, self.prob, self.mode, self.pairing)


class GridMixConfig(_PairConfig):
    """Config of ``GridMix``."""

    kind: Literal["gridmix"] = "gridmix"
    cell_sizes: Annotated[tuple[Annotated[int, Field(ge=1)], ...], Field(min_length=1, description="candidate cell sides in pixels")] = (16, 32)
    alpha: Alpha = 1.0

    def build(self) -> GridMix:
        return GridMix(self.num_classes, self.cell_sizes, self.alpha, self.label_smoothing, self.prob, self.mode, self.pairing)


class TokenMixConfig(_PairConfig):
    """Config of ``TokenMix``."""

    kind: Literal["tokenmix"] = "tokenmix"
    patch_size: Annotated[int, Field(ge=1, description="the backbone's patch size")] = 16
    alpha: Alpha = 1.0
    min_tokens: Annotated[int, Field(ge=1, description="smallest block, in tokens (TokenMix: 14)")] = 14
    min_aspect: Annotated[float, Field(gt=0, description="smallest block aspect ratio (BEiT: 0.3)")] = 0.3

    def build(self) -> TokenMix:
        return TokenMix(
            self.num_classes, self.patch_size, self.alpha, self.min_tokens, self.min_aspect,
            self.label_smoothing, self.prob, self.mode, self.pairing,
        )


class SwitchConfig(Config[Switch]):
    """Config of ``Switch``: nested mixer configs and their probabilities."""

    kind: Literal["switch"] = "switch"
    mixers: Annotated[list[MixerConfig], Field(min_length=1, description="the mixers to choose from")]
    probs: Annotated[Optional[list[Annotated[float, Field(ge=0)]]], Field(description="probability of each mixer")] = None

    @model_validator(mode="after")
    def _consistent(self) -> SwitchConfig:
        if self.probs is not None and (len(self.probs) != len(self.mixers) or sum(self.probs) <= 0):
            raise ValueError(f"probs must hold one weight per mixer ({len(self.mixers)}) with a positive sum")
        classes = {_num_classes(m) for m in self.mixers}
        if len(classes) != 1:
            raise ValueError(f"all mixers of a switch must have the same num_classes, got {sorted(classes)}")
        return self

    def build(self) -> Switch:
        return Switch([m.build() for m in self.mixers], self.probs)


def _num_classes(cfg: MixerConfig) -> int:
    if isinstance(cfg, SwitchConfig):
        return _num_classes(cfg.mixers[0])
    return cfg.num_classes


MixerConfig = Annotated[
    Union[
        CutMixConfig, MixUpConfig, RandomPatchMixConfig, BlockwiseMixConfig, MixTokenConfig,
        FMixConfig, ResizeMixConfig, SaliencyMixConfig, GridMixConfig, TokenMixConfig, SwitchConfig,
    ],
    Field(discriminator="kind"),
]
"""Any mixer's config, chosen by its ``kind``."""

SwitchConfig.model_rebuild()
