"""The configuration base: frozen, strict, and builds its object."""

from __future__ import annotations

from typing import Annotated, Literal

import pydantic
import pytest
from pydantic import Field

from mixlabels import Config


class Scale(Config[float]):
    kind: Literal["scale"] = "scale"
    factor: Annotated[float, Field(gt=0, description="multiplier")] = 2.0

    def build(self) -> float:
        return self.factor * 10


def test_config_builds_and_round_trips_through_json() -> None:
    cfg = Scale(factor=3.0)
    assert cfg.build() == 30.0
    assert Scale.model_validate_json(cfg.model_dump_json()) == cfg


def test_config_is_frozen_and_forbids_unknown_fields() -> None:
    cfg = Scale()
    with pytest.raises(pydantic.ValidationError):
        cfg.factor = 1.0  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="Extra inputs"):
        Scale(factr=1.0)  # type: ignore[call-arg]
    with pytest.raises(pydantic.ValidationError, match="greater than 0"):
        Scale(factor=-1.0)


def test_base_config_without_build_says_so() -> None:
    class Empty(Config[int]):
        pass

    with pytest.raises(NotImplementedError, match="Empty does not define build"):
        Empty().build()
