"""The CaiT adapter: talking heads, class attention, TransMix on the class-attention row."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from einops import rearrange
from test_backbones_common import C, IMG, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, set_fused, sharpen
from torch.testing import assert_close

from mixlabels.backbones._common import launch_routes
from mixlabels.backbones.families.cait import label_matrix, talking_heads_label_mix

CONFIGS: dict[str, dict[str, Any]] = {"fused": {}, "explicit": {}, "avg": {"global_pool": "avg"}}


def make(config: str, drop_path_rate: float = 0.0, factor: float = 1.0) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model(
        "cait_xxs24_224", pretrained=False, img_size=IMG, patch_size=8, embed_dim=32, depth=2, num_heads=2,
        depth_token_only=1, num_classes=C, drop_path_rate=drop_path_rate, init_values=1.0, **CONFIGS[config],
    )  # fmt: skip
    return sharpen(set_fused(model, config != "explicit"), factor)


@pytest.mark.parametrize("scheme", ["none", "transmix", "tokens_aligned"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str, scheme: str) -> None:
    if config == "avg" and scheme == "transmix":
        scheme = "tl_align"
    check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


def parity_cases() -> list[tuple[str, str]]:
    return [(c, s) for c in CONFIGS for s in SCHEMES if not (c == "avg" and s == "transmix")]


@pytest.mark.parametrize(("config", "scheme"), parity_cases())
def test_fast_path_equals_reference(config: str, scheme: str) -> None:
    # a patch-mean readout barely moves under near doubly-stochastic random attention
    check_parity(make(config, drop_path_rate=0.4, factor=8.0), scheme, must_move=config != "avg")


def test_mixtoken_fast_equals_reference() -> None:
    check_parity(make("fused", drop_path_rate=0.2, factor=8.0), "tokens_aligned", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("fused"), list(SCHEMES))


def test_talking_heads_label_matrix() -> None:
    """Norm(|A'_h|) averaged over heads: rows on the simplex; with proj_w = I it is mean_h softmax."""
    a = torch.softmax(torch.randn(2, 3, 5, 5), dim=-1)
    assert_close(label_matrix(a), a.mean(1))
    mixed_heads = torch.einsum("gh,bhnm->bgnm", torch.randn(3, 3), a) + 0.1
    assert_close(label_matrix(mixed_heads).sum(-1), torch.ones(2, 5))
    assert (label_matrix(mixed_heads) >= 0).all()


@pytest.mark.parametrize("heads, tokens, labels", [(1, 7, 4), (3, 7, 4), (4, 50, 2), (8, 17, 3), (12, 9, 10)])
def test_talking_heads_label_mix_equals_the_matrix_product(heads: int, tokens: int, labels: int) -> None:
    """The fast path's one-product form (ones column for the row sums, the labels shared by every query row) is
    ``label_matrix(a) @ y`` in float64, from the head-mixing linear's own layout as the step gives it; the CPU's
    product per sample and a GPU's one product give the same bits."""
    g = torch.Generator().manual_seed(heads * 100 + tokens)
    soft = torch.softmax(torch.randn(2, heads, tokens, tokens, generator=g), dim=-1)
    mix = torch.randn(heads, heads, generator=g)
    a = rearrange(torch.einsum("gh,bhnm->bnmg", mix, soft) - 0.05, "b n m g -> b g n m")  # proj_w's output, permuted
    y = torch.rand(2, tokens, labels, generator=g)
    y = y / y.sum(-1, keepdim=True)
    w = a.double().abs()
    expected = (w / w.sum(-1, keepdim=True)).mean(1) @ y.double()  # Norm(|A'_h|) averaged over heads, float64
    got = talking_heads_label_mix(a, y)
    assert_close(got.double(), expected, rtol=1e-6, atol=1e-7)
    with launch_routes():  # one product over every sample's rows (a GPU's route), not one per sample
        assert torch.equal(talking_heads_label_mix(a, y), got)
