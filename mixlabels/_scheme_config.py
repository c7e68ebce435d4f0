"""Pydantic configurations of the alignment schemes, keyed by a ``kind`` literal.

Example:
    >>> from pydantic import TypeAdapter
    >>> TypeAdapter(SchemeConfig).validate_python({"kind": "tl_align", "layers": [1, 3, 5, 7]}).build()
    TLAlign(layers=(1, 3, 5, 7), normalize=True, drop_path='follow')
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from mixlabels._config import Config
from mixlabels._schemes import DropPathRule, MixPro, NoAlign, TLAlign, TokenLabeling, TransMix

__all__ = ["NoAlignConfig", "TransMixConfig", "TLAlignConfig", "TokenLabelingConfig", "MixProConfig", "SchemeConfig"]


class NoAlignConfig(Config[NoAlign]):
    """The image-level mix (CutMix/MixUp baseline)."""

    kind: Literal["none"] = "none"

    def build(self) -> NoAlign:
        return NoAlign()


class TransMixConfig(Config[TransMix]):
    """TransMix: last-layer class attention averaged with the area lambda."""

    kind: Literal["transmix"] = "transmix"

    def build(self) -> TransMix:
        return TransMix()


class TLAlignConfig(Config[TLAlign]):
    """TL-Align; ``layers``, ``normalize`` and ``drop_path`` give Table 8's ablations."""

    kind: Literal["tl_align"] = "tl_align"
    layers: Annotated[
        tuple[int, ...] | None,
        Field(description="0-based aligned layers (negative from the end); None aligns all"),
    ] = None
    normalize: Annotated[bool, Field(description="False: Table 8's 'Normalization Disabled'")] = True
    drop_path: Annotated[
        DropPathRule,
        Field(description="'follow': a sample whose attention branch was dropped keeps its labels; 'official': they mix anyway"),
    ] = "follow"

    def build(self) -> TLAlign:
        return TLAlign(layers=self.layers, normalize=self.normalize, drop_path=self.drop_path)


class TokenLabelingConfig(Config[TokenLabeling]):
    """Token labeling: class loss plus beta times the dense token loss."""

    kind: Literal["token_labeling"] = "token_labeling"
    beta: Annotated[float, Field(ge=0.0, description="weight of the dense token loss")] = 0.5
    aligned: Annotated[bool, Field(description="align token targets through the layers")] = False

    def build(self) -> TokenLabeling:
        return TokenLabeling(beta=self.beta, aligned=self.aligned)


class MixProConfig(Config[MixPro]):
    """MixPro: class-attention and area lambdas, the area's weight falling with the batch's progress."""

    kind: Literal["mixpro"] = "mixpro"
    initial: Annotated[float, Field(ge=0.0, le=1.0, description="the area lambda's weight at progress 0")] = 1.0
    final: Annotated[float, Field(ge=0.0, le=1.0, description="the area lambda's weight at progress 1")] = 0.0

    def build(self) -> MixPro:
        return MixPro(initial=self.initial, final=self.final)


SchemeConfig = Annotated[
    Union[NoAlignConfig, TransMixConfig, TLAlignConfig, TokenLabelingConfig, MixProConfig],
    Field(discriminator="kind"),
]
