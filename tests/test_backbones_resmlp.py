"""The ResMLP adapter: preservation, fast = reference, the linear token-mixing rule Norm(|W|), refusals."""

from __future__ import annotations

import pytest
import timm
import torch
from test_backbones_common import C, IMG, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.models.mlp_mixer import Affine, MlpMixer, ResBlock
from torch.testing import assert_close

from mixlabels import NoAlign, TLAlign, TransMix, backbones
from mixlabels.backbones.families.resmlp import linear_mixing_matrices


def make(drop_path_rate: float = 0.0) -> MlpMixer:
    torch.manual_seed(0)
    model = MlpMixer(img_size=IMG, patch_size=8, embed_dim=32, num_blocks=2, mlp_ratio=2, block_layer=ResBlock,
                     norm_layer=Affine, num_classes=C, drop_path_rate=drop_path_rate)
    with torch.no_grad():  # timm's 1e-4 layer scale would make the blocks nearly the identity
        for blk in model.blocks:
            blk.ls1.fill_(0.5)
            blk.ls2.fill_(0.5)
    return model


@pytest.mark.parametrize("scheme", ["none", "tl_align", "tokens_aligned"])
def test_function_preservation_train_mode(scheme: str) -> None:
    check_preservation(make(drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_path_rate=0.4), scheme)


def test_mixtoken_fast_equals_reference() -> None:
    check_parity(make(drop_path_rate=0.2), "tokens_aligned", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def test_linear_mixing_rule() -> None:
    """Rows of Norm(|W|) are distributions; a signed permutation W moves every label to its token's image."""
    model = make()
    linear = model.blocks[0].linear_tokens
    n = linear.weight.shape[0]
    assert_close(linear_mixing_matrices([linear])[0].sum(-1), torch.ones(n))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        linear.weight.copy_(-2.0 * torch.eye(n)[perm])  # token i reads token perm[i]; the sign does not matter
    assert_close(linear_mixing_matrices([linear])[0], torch.eye(n)[perm])
    images, lm = cutmix_batch()
    scheme = TLAlign(layers=(0,), normalize=False)  # Y <- Norm(|W|) Y at block 0 only
    out = backbones.adapt(model, scheme)(images, lm)
    area = lm.targets(lm.token_weights((IMG // 8, IMG // 8)))  # b n c
    assert_close(out.target, area[:, perm].mean(1))  # a permutation keeps the mean: the area mix
    assert_close(out.target, lm.image_targets())
    assert (area[:, perm] - area).abs().max() > 0.1  # the permutation did move the token labels


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "resmlp")
    for name in ("resmlp_12_224", "resmlp_24_224", "resmlp_big_24_224"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    with torch.device("meta"):
        mixer = timm.create_model("mixer_s32_224", pretrained=False)
    assert family.refusal(mixer) == (
        "block 0 is MixerBlock, not ResBlock (MlpMixer blocks adapt by type: MixerBlock as mlp_mixer, "
        "ResBlock as resmlp, SpatialGatingBlock as gmlp; one type per model)"
    )
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
    odd = make()
    odd.blocks[1].norm2 = torch.nn.BatchNorm1d(32)
    with pytest.raises(TypeError, match="block 1's norm2 is BatchNorm1d; only Affine or LayerNorm"):
        backbones.adapt(odd, TLAlign())
    assert type(backbones.adapt(odd, NoAlign())).__name__ == "AdaptedClassifier"  # any classifier
