"""Known families without an adapter (VOLO): refused by name with their reason; NoAlign takes them."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.models.volo import VOLO

from mixlabels import NoAlign, TLAlign, TokenLabeling, backbones
from mixlabels.backbones._refusals import VOLO_REFUSAL


@pytest.mark.parametrize(
    ("name", "kwargs", "reason"),
    [
        ("volo", {"img_size": 32, "layers": (1, 1, 1, 1), "embed_dims": (16, 32, 32, 32), "num_heads": (1, 2, 2, 2)}, VOLO_REFUSAL),
    ],
)
def test_refused_by_name_and_noalign_works(name: str, kwargs: dict[str, object], reason: str) -> None:
    torch.manual_seed(0)
    # timm's volo_* names pin layers and dims: the class itself for a tiny VOLO
    model = VOLO(num_classes=10, **kwargs) if name == "volo" else timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
    for scheme in (TLAlign(), TokenLabeling()):
        with pytest.raises(TypeError) as info:
            backbones.adapt(model, scheme)
        assert str(info.value) == f"{type(scheme).__name__} cannot adapt {type(model).__name__}: {reason}"
    adapted = backbones.adapt(model.eval(), NoAlign())
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(adapted(images), model(images))


def test_every_timm_name_of_the_families_is_refused_by_name() -> None:
    for module, reason in (("volo", VOLO_REFUSAL),):
        names = timm.list_models(module=module)
        assert names
        for name in names:
            with torch.device("meta"):
                model = timm.create_model(name, pretrained=False)
            with pytest.raises(TypeError, match="cannot adapt") as info:
                backbones.adapt(model, TLAlign())
            assert str(info.value).endswith(reason), name
