"""Known families without an adapter (EfficientFormerV2): refused by name with their reason;
NoAlign takes them."""

from __future__ import annotations

import pytest
import timm
import torch

from mixlabels import NoAlign, TLAlign, TokenLabeling, backbones
from mixlabels.backbones._refusals import EFFICIENTFORMERV2_REFUSAL


@pytest.mark.parametrize(
    ("name", "kwargs", "reason"),
    [
        ("efficientformerv2_s0", {}, EFFICIENTFORMERV2_REFUSAL),
    ],
)
def test_refused_by_name_and_noalign_works(name: str, kwargs: dict[str, object], reason: str) -> None:
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
    for scheme in (TLAlign(), TokenLabeling()):
        with pytest.raises(TypeError) as info:
            backbones.adapt(model, scheme)
        assert str(info.value) == f"{type(scheme).__name__} cannot adapt {type(model).__name__}: {reason}"
    adapted = backbones.adapt(model.eval(), NoAlign())
    size = 224 if name == "efficientformerv2_s0" else 32  # its attention biases are fixed for 224 px
    images = torch.randn(2, 3, size, size)
    with torch.no_grad():
        torch.testing.assert_close(adapted(images), model(images))


def test_every_timm_name_of_the_families_is_refused_by_name() -> None:
    for module, reason in (("efficientformer_v2", EFFICIENTFORMERV2_REFUSAL),):
        names = timm.list_models(module=module)
        assert names
        for name in names:
            with torch.device("meta"):
                model = timm.create_model(name, pretrained=False)
            with pytest.raises(TypeError, match="cannot adapt") as info:
                backbones.adapt(model, TLAlign())
            assert str(info.value).endswith(reason), name
