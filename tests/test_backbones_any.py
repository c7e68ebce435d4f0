"""``adapt(model, NoAlign())`` for any classifier: timm models of every family, torchvision, a user's own module.

The target of NoAlign is the label map's image-level target whatever the model, so the
checks are: the adapted model computes exactly the bare model's function, a training
step runs, MixToken mixes the patch embeddings where timm's ``patch_embed`` exists
(checked against the family adapters' own MixToken) and is refused by name where not,
and the aligning schemes refuse clearly, saying that NoAlign works.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import timm
import torch
import torchvision
from torch import nn
from torch.testing import assert_close

from mixlabels import NoAlign, TLAlign, TokenLabeling, TokenLabelMap, TransMix, backbones
from mixlabels.backbones._any import AdaptedClassifier
from mixlabels.backbones._count import count_timm_names, count_torchvision_names
from mixlabels.strategies import CutMix, MixToken

from test_backbones_common import cutmix_batch

C = 10


class SmallNet(nn.Module):
    """A user's own classifier: no timm, no patch_embed."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(8, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).flatten(1))  # type: ignore[no-any-return]


class AuxNet(SmallNet):
    """Returns ``(logits, aux_logits)`` like torchvision's Inception in training."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        logits = super().forward(x)
        return logits, logits * 0.5


def _seeded(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return make()

    return build


MODELS: dict[str, Callable[[], nn.Module]] = {
    # a torchvision model of no aligning family (its ResNet is tv_resnet's now)
    "torchvision_shufflenet": _seeded(lambda: torchvision.models.shufflenet_v2_x0_5(weights=None, num_classes=C)),
    "timm_dla": _seeded(lambda: timm.create_model("dla46_c", pretrained=False, num_classes=C)),
    "timm_byobnet": _seeded(lambda: timm.create_model("test_byobnet", pretrained=False, num_classes=C)),
    "timm_skresnet": _seeded(lambda: timm.create_model("skresnet18", pretrained=False, num_classes=C)),
    "timm_dpn": _seeded(lambda: timm.create_model("dpn48b", pretrained=False, num_classes=C)),
    "own_module": _seeded(SmallNet),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_cutmix_training_step_and_function_preserved(name: str) -> None:
    model = MODELS[name]()
    adapted = backbones.adapt(model, NoAlign())
    assert type(adapted) is AdaptedClassifier and adapted.model is model
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, C, (4,), generator=g)
    mixed, lm = CutMix(C, generator=g)(images, labels)
    model.eval()
    with torch.no_grad():
        bare = model(mixed)
        assert torch.equal(adapted(mixed), bare)  # without labels: exactly the model's output
        assert torch.equal(adapted(mixed, lm).output, bare)
    model.train()
    out = adapted(mixed, lm)
    assert_close(out.target, lm.image_targets())
    assert out.logits is out.output and not out.target.requires_grad and out.token_target is None
    loss = out.loss()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert torch.isfinite(loss) and grads and all(torch.isfinite(gr).all() for gr in grads)
    assert any(gr.abs().sum() > 0 for gr in grads)


@pytest.mark.parametrize("scheme", [TLAlign(), TransMix(), TokenLabeling(beta=0.5), TokenLabeling(beta=0.5, aligned=True)])
def test_aligning_schemes_refuse_other_models_naming_the_families_and_noalign(scheme: object) -> None:
    model = MODELS["timm_byobnet"]()
    with pytest.raises(TypeError) as err:
        backbones.adapt(model, scheme)  # type: ignore[arg-type]
    text = str(err.value)
    # first the reason of the family whose class it is (a ByobNet of DarkBlocks), then the families
    assert text.startswith(f"{type(scheme).__name__} cannot adapt this ByobNet: byobnet: block ")
    assert "\naligned targets follow labels through a model's token mixers" in text
    assert "NoAlign() (the image-level CutMix/MixUp target) works for any classifier" in text
    assert f"{type(scheme).__name__} cannot adapt ByobNet, which is none of them: " in text
    assert "ByobNet is not a timm VisionTransformer" in text  # the vit family's reason, among every family's
    for family in backbones.FAMILIES[:-1]:
        assert f"{family.name}: {family.description}" in text


def test_adapt_refuses_what_is_not_a_module() -> None:
    with pytest.raises(TypeError, match="takes a torch.nn.Module"):
        backbones.adapt(lambda x: x, NoAlign())  # type: ignore[arg-type]


def test_mixtoken_is_refused_by_name_without_patch_embed() -> None:
    model = MODELS["own_module"]()
    images, lm = cutmix_batch(token_space=True)
    with pytest.raises(ValueError, match="SmallNet has no `patch_embed` module"):
        backbones.adapt(model, NoAlign())(images, lm)


# Family models built bare: the generic hook on ``patch_embed`` must mix exactly as the family
# adapter's own MixToken (tokens (b, n, c) for ViT, a channels-last grid for Swin and PVT v2).
FAMILY_EXAMPLES = ["vit", "swin", "pvt_v2", "mlp_mixer"]


@pytest.mark.parametrize("family", FAMILY_EXAMPLES)
def test_mixtoken_through_patch_embed_equals_the_family_adapter(family: str) -> None:
    model = {f.name: f for f in backbones.FAMILIES}[family].example().eval()
    if family == "mlp_mixer":  # timm's MlpMixer calls its patch embedding `stem`: refused by name
        images, lm = cutmix_batch(token_space=True)
        with pytest.raises(ValueError, match="no `patch_embed`"):
            AdaptedClassifier(model, NoAlign())(images, lm)
        return
    images, lm = cutmix_batch(token_space=True)
    with torch.no_grad():
        ours = AdaptedClassifier(model, NoAlign())(images, lm)
        theirs = backbones.adapt(model, NoAlign())(images, lm)
        assert_close(ours.output, theirs.output, rtol=1e-5, atol=1e-5)
        assert_close(ours.target, theirs.target)
        assert not torch.equal(ours.output, model(images))  # the tokens were mixed
        assert torch.equal(model(images), AdaptedClassifier(model, NoAlign())(images))  # hook removed


def test_mixtoken_trains_a_timm_model_outside_the_families() -> None:
    torch.manual_seed(0)
    # Max pooling (global_pool='avgmax') has no label readout: outside every aligning family.
    model = timm.create_model("test_vit3", pretrained=False, num_classes=C, img_size=32, global_pool="avgmax")
    adapted = backbones.adapt(model, NoAlign())
    assert type(adapted) is AdaptedClassifier
    with pytest.raises(TypeError, match="TLAlign cannot adapt VisionTransformer, which is none of them") as err:
        backbones.adapt(model, TLAlign())
    # the family of its class says what to change, first; the families of other classes are not listed there
    first = str(err.value).split("\n")[0]
    assert first.startswith("TLAlign cannot adapt this VisionTransformer: vit: global_pool='avgmax' has no label readout")
    assert "is not a timm" not in first
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, C, (4,), generator=g)
    unmixed, lm = MixToken(C, patch_size=16, generator=g)(images, labels)
    assert lm.token_space and unmixed is images
    out = adapted(unmixed, lm)
    assert_close(out.target, lm.image_targets())
    out.loss().backward()


def test_tuple_output_uses_its_first_item_and_wrong_class_count_is_refused() -> None:
    images, lm = cutmix_batch()
    out = backbones.adapt(AuxNet(), NoAlign())(images, lm)
    assert isinstance(out.output, tuple) and out.logits is out.output[0]
    wrong = timm.create_model("test_byobnet", pretrained=False, num_classes=C + 1)
    with pytest.raises(ValueError, match=r"returned \(4, 11\).*num_classes=10"):
        backbones.adapt(wrong, NoAlign())(images, lm)
    with pytest.raises(ValueError, match="do not match the label map"):
        backbones.adapt(SmallNet(), NoAlign())(images[:2], lm)


def test_counts_of_timm_names_per_tier() -> None:
    counts = {c.tier: c for c in count_timm_names()}
    assert counts["NoAlign"].count == len(timm.list_models())
    families = [f.name for f in backbones.FAMILIES[:-1] if f.timm_modules]
    union = set().union(*(counts[f"TLAlign: {f}"].names for f in families))
    assert counts["TLAlign"].names == tuple(sorted(union)) and 0 < counts["TLAlign"].count < counts["NoAlign"].count
    assert "vit_base_patch16_224" in counts["TLAlign: vit"].names and "dla34" not in counts["TLAlign"].names


def test_counts_of_torchvision_builders_per_tier() -> None:
    """Every declared builder is a torchvision classification model, and (built on the meta device) its family takes it."""
    everything = torchvision.models.list_models(module=torchvision.models)
    declared = {f.name: f.torchvision_builders for f in backbones.FAMILIES[:-1] if f.torchvision_builders}
    counts = {c.tier: c for c in count_torchvision_names(exact=True)}
    assert counts["NoAlign"].count == len(everything) and "alexnet" not in counts["TLAlign"].names
    for family, names in declared.items():
        assert set(names) <= set(everything), family
        assert counts[f"TLAlign: {family}"].names == tuple(sorted(names)) and not counts[f"TLAlign: {family}"].failed
    assert counts["TLAlign"].names == tuple(sorted({n for names in declared.values() for n in names}))


def test_vits_with_a_conv_stem_embedding_refuse_tlalign_and_take_noalign() -> None:
    """A timm VisionTransformer whose patch_embed is a conv stem no family has a label rule for (a features_only
    ConvNeXt): its token grid is not patch_embed.patch_size, so TL-Align refuses it (such ViTs crashed before);
    NoAlign takes it. (The hybrid ResNet-ViTs and ViTamin, refused here before, align now by the vit_hybrid and
    vitamin families: tests/test_backbones_vit_hybrid.py, tests/test_backbones_vitamin.py.)"""
    from functools import partial

    from timm.layers.hybrid_embed import HybridEmbed
    from timm.models.vision_transformer import VisionTransformer

    with torch.device("meta"):
        convnext = timm.create_model("convnext_atto", pretrained=False, features_only=True, out_indices=[2])
        model = VisionTransformer(img_size=64, patch_size=1, embed_dim=32, depth=1, num_heads=2,
                                  embed_layer=partial(HybridEmbed, backbone=convnext))  # fmt: skip
    with pytest.raises(TypeError, match="patch_embed is HybridEmbed, not timm's PatchEmbed"):
        backbones.adapt(model, TLAlign())
    assert type(backbones.adapt(model, NoAlign())) is AdaptedClassifier
