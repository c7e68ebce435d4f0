"""Every rule of ``Rules`` (mixlabels/_rules.py) held by a case computed by hand.

The fast and the reference paths share ``Rules``, so comparing them cannot see a bug in a
rule; these numbers can. The last tests read the labels out of real timm models that
average-pool but keep prefix tokens (a class token, registers): the mean readout must
skip them.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import timm
import torch
from torch.testing import assert_close

from mixlabels import TokenLabelMap
from mixlabels._align import LabelTracker, TokenLayout
from mixlabels._rules import Rules, normalise_rows
from mixlabels._trackers import CompactTracker
from mixlabels.backbones import adapt


def t(rows: object) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


# ------------------------------------------------------------------ the arithmetic, one rule at a time
def test_normalise_rows() -> None:
    assert_close(normalise_rows(t([[2.0, 6.0], [1.0, 1.0]])), t([[0.25, 0.75], [0.5, 0.5]]))
    assert_close(normalise_rows(t([[0.0, 0.0]])), t([[0.0, 0.0]]))  # a zero row stays zero, never NaN


def test_residual_averages_or_replaces() -> None:
    y, mixed = t([[[1.0, 0.0], [0.0, 1.0]]]), t([[[0.5, 0.5], [0.2, 0.8]]])  # b=1, n=2, k=2
    assert_close(Rules().residual(y, mixed, keep=None), t([[[0.75, 0.25], [0.1, 0.9]]]))  # (Y + AY) / 2
    assert_close(Rules(normalize=False).residual(y, mixed, keep=None), mixed)  # Y <- AY


def test_residual_follows_stochastic_depth_per_sample_and_per_token() -> None:
    y = t([[[1.0, 0.0]], [[0.0, 1.0]]])  # b=2, n=1
    mixed = t([[[0.0, 1.0]], [[1.0, 0.0]]])
    keep = torch.tensor([True, False])  # sample 1's branch was dropped: its labels stay
    assert_close(Rules().residual(y, mixed, keep), t([[[0.5, 0.5]], [[0.0, 1.0]]]))
    assert_close(Rules(follow_drop=False).residual(y, mixed, keep), t([[[0.5, 0.5]], [[0.5, 0.5]]]))  # official
    y2, mixed2 = t([[[1.0, 0.0], [1.0, 0.0]]]), t([[[0.0, 1.0], [0.0, 1.0]]])  # b=1, n=2: per-token keep
    assert_close(Rules().residual(y2, mixed2, torch.tensor([[False, True]])), t([[[1.0, 0.0], [0.5, 0.5]]]))


def test_merge_renormalises_the_summed_labels() -> None:
    assert_close(Rules().merge(t([[[0.6, 0.2], [1.0, 1.0]]])), t([[[0.75, 0.25], [0.5, 0.5]]]))


def test_readout_token_and_mean_past_the_prefix() -> None:
    # two prefix tokens (class, register) then three patch tokens
    y = t([[[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.5, 0.5], [0.2, 0.8]]])
    assert_close(Rules().readout(y, "token", 0), t([[1.0, 0.0]]))
    assert_close(Rules().readout(y, "token", 1), t([[0.9, 0.1]]))
    assert_close(Rules().readout(y, "mean", 2), t([[0.7 / 3, 2.3 / 3]]))  # the patch tokens only
    assert_close(Rules().readout(y, "mean", 0), t([[2.6 / 5, 2.4 / 5]]))  # no prefix: all of them
    assert_close(Rules().readout(2 * y, "mean", 2), t([[0.7 / 3, 2.3 / 3]]))  # renormalised


def test_class_weights_renormalise_the_attention_over_the_patches() -> None:
    row = t([[0.5, 0.3, 0.1, 0.1]])  # the class token's attention: itself, then three patches
    area = t([[[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]]])  # each patch's source shares
    # patches' attention 0.6, 0.2, 0.2 after dropping the prefix and renormalising
    assert_close(Rules().class_weights(row, area, num_prefix=1), t([[0.6 + 0.1, 0.1 + 0.2]]))
    two = t([[0.2, 0.2, 0.3, 0.1, 0.2]])  # two prefix tokens
    assert_close(Rules().class_weights(two, area, num_prefix=2), t([[0.5 + 1 / 12, 1 / 12 + 1 / 3]]))  # 0.3, 0.1, 0.2 over 0.6


def test_combine_weighs_area_and_attention() -> None:
    image, attention = t([[0.8, 0.2]]), t([[0.4, 0.6]])
    assert_close(Rules().combine(image, attention), t([[0.6, 0.4]]))  # TransMix: the plain average
    assert_close(Rules(area_weight=0.25).combine(image, attention), t([[0.5, 0.5]]))
    assert_close(Rules(area_weight=1.0).combine(image, attention), image)
    assert_close(Rules(area_weight=0.0).combine(image, attention), attention)


def test_what_a_rule_set_tracks() -> None:
    assert not Rules().tracks_aligned and not Rules().tracks_input and not Rules().uses_token_targets
    assert Rules(align=frozenset({2})).tracks_aligned and Rules(target="aligned").tracks_aligned
    assert Rules(token_targets="aligned").tracks_aligned and Rules(token_targets="aligned").uses_token_targets
    assert Rules(token_targets="input").tracks_input and not Rules(token_targets="input").tracks_aligned
    r = Rules(align=frozenset({0, 2}), class_attention_layer=3, target="attention")
    assert [r.wants_labels(i) for i in range(4)] == [True, False, True, False]
    assert [r.wants_class_attention(i) for i in range(4)] == [False, False, False, True]
    with pytest.raises(ValueError, match=r"area_weight must lie in \[0, 1\], got 1.5"):
        Rules(area_weight=1.5)
    with pytest.raises(ValueError, match="needs class_attention_layer"):
        Rules(target="attention")


# ------------------------------------------------------------------ the mean readout of real pooled models with prefix tokens
@dataclass(frozen=True)
class ReadoutOnly:
    """A scheme that aligns no layer but reads the labels out: the target is the readout of the input labels."""

    @property
    def needs_token_logits(self) -> bool:
        return False

    def rules(self, label_map: TokenLabelMap, layout: TokenLayout) -> Rules:
        return Rules(target="aligned")

    def start(self, label_map: TokenLabelMap, layout: TokenLayout) -> LabelTracker:
        return CompactTracker(self.rules(label_map, layout), label_map, layout)


@pytest.mark.parametrize("reference", [False, True])
@pytest.mark.parametrize(("class_token", "reg_tokens"), [(True, 0), (True, 3), (False, 2)])
def test_a_pooled_model_reads_out_its_patch_tokens_not_its_prefix(class_token: bool, reg_tokens: int,
                                                                  reference: bool) -> None:
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, embed_dim=16,
                              depth=1, num_heads=2, num_classes=5, class_token=class_token, reg_tokens=reg_tokens,
                              global_pool="avg")  # fmt: skip
    assert model.num_prefix_tokens == int(class_token) + reg_tokens
    # the partner fills the top-left 2x3 cells of a 4x4 grid (6 of 16 tokens); lambda is given apart from the area
    # (timm's uncorrected lambda), so the prefix tokens' labels (the image weights) differ from the patches' mean
    lam = torch.tensor([0.9, 0.9])
    lm = TokenLabelMap.from_boxes(torch.tensor([[0, 2, 0, 3], [1, 4, 1, 4]]), (4, 4), torch.tensor([1, 0]),
                                  torch.tensor([2, 4]), num_classes=5, image_size=(16, 16), lam=lam)
    out = adapt(model, ReadoutOnly(), reference)(torch.randn(2, 3, 16, 16), lm)
    # by hand: sample 0 keeps 10/16 of the patch tokens (class 2) and takes 6/16 (class 4); sample 1 keeps 7/16
    want = torch.zeros(2, 5)
    want[0, 2], want[0, 4] = 10 / 16, 6 / 16
    want[1, 4], want[1, 2] = 7 / 16, 9 / 16
    assert_close(out.target.float(), want)
