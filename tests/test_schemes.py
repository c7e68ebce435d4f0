"""Schemes and the event protocol: hand-checkable alignment cases, configs, losses."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pydantic import TypeAdapter, ValidationError
from timm.models.vision_transformer import VisionTransformer
from torch.testing import assert_close

from mixlabels import backbones
from mixlabels._trackers import DenseTracker
from mixlabels.backbones import attention_with_labels
from mixlabels import (
    AlignedOutput,
    LabelTracker,
    NoAlign,
    SchemeConfig,
    TLAlign,
    TokenLabeling,
    TokenLabelMap,
    TokenLayout,
    TransMix,
    soft_target_cross_entropy,
    token_soft_target_cross_entropy,
)

GRID, P = (2, 2), 1
LAYOUT = TokenLayout(grid=GRID, num_prefix=P, depth=3, class_token=True)


def left_half_map(b: int = 2) -> TokenLabelMap:
    mask = torch.zeros(b, 4, 4)
    mask[:, :, :1] = 1.0  # a quarter of the image from the sample itself: lambda = 0.25
    return TokenLabelMap.from_mask(mask, torch.arange(b).roll(1), torch.arange(b), num_classes=4)


def qk_for(attention: str, n: int, h: int = 2, d: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (1, h, n, d) giving identity (one-hot, large) or uniform (zero q) attention."""
    eye = torch.eye(n, d).expand(1, h, n, d)
    q = 50.0 * eye if attention == "identity" else torch.zeros(1, h, n, d)
    return q, eye.clone(), torch.randn(1, h, n, d)


def run_tracker(scheme: TLAlign, lm: TokenLabelMap, attention: str) -> torch.Tensor:
    """Drive a tracker with real fused attention for every layer; return the final labels (b, n, k)."""
    tracker = scheme.start(lm, LAYOUT)
    n = LAYOUT.num_tokens
    for layer in range(LAYOUT.depth):
        y, mixed = tracker.labels_for(layer), None
        if y is not None:
            q, k, v = (t.expand(y.shape[0], -1, -1, -1) for t in qk_for(attention, n))
            _, mixed = attention_with_labels(q, k, v, y, scale=8**-0.5)
        tracker.residual(layer, keep=None, mixed=mixed)
        tracker.residual(layer, keep=None, mixed=None)
    return current_labels(tracker)


def current_labels(tracker: LabelTracker, layer: int = 0) -> torch.Tensor:
    """The tracker's labels now, asked through an aligned ``layer``."""
    labels = tracker.labels_for(layer)
    assert labels is not None
    return labels


# ---------------------------------------------------------------------------- hand-checkable
@pytest.mark.parametrize("normalize", [True, False])
def test_identity_attention_leaves_labels_unchanged(normalize: bool) -> None:
    lm = left_half_map()
    start = current_labels(TLAlign().start(lm, LAYOUT))
    assert_close(run_tracker(TLAlign(normalize=normalize), lm, "identity"), start)


def test_uniform_attention_drives_tokens_to_the_image_mean() -> None:
    lm = left_half_map()
    start = current_labels(TLAlign().start(lm, LAYOUT))  # b n k
    mean = start.mean(dim=1, keepdim=True)
    assert_close(mean[:, 0], lm.image_weights)  # class token = area mean, so the token mean is lambda
    got = run_tracker(TLAlign(), lm, "uniform")
    assert_close(got, mean + (start - mean) / 2**LAYOUT.depth)  # halves the distance each layer
    assert_close(run_tracker(TLAlign(normalize=False), lm, "uniform"), mean.expand_as(start))  # at once


def test_mixup_maps_are_unchanged_by_tl_align() -> None:
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=5)
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.qkv.weight[:64] *= 8.0  # peaked attention: it would move CutMix labels
    lam = torch.tensor([0.3, 0.7, 0.55, 0.1])
    mixup = TokenLabelMap.from_mask(
        lam.view(4, 1, 1), torch.arange(4).flip(0), torch.tensor([0, 1, 2, 3]), 5, image_size=(32, 32)
    )
    images = mixup.mix_pixels(torch.randn(4, 3, 32, 32))
    for scheme in (TLAlign(), TLAlign(normalize=False), TokenLabeling(aligned=True), TransMix()):
        out = backbones.adapt(model, scheme)(images, mixup)
        assert_close(out.target, mixup.image_targets(), rtol=0, atol=1e-6)


def test_transmix_hand_checked() -> None:
    lm = left_half_map(b=1)  # tokens 0 and 2 (left column) half from the sample itself
    tracker = TransMix().start(lm, LAYOUT)
    assert [tracker.wants_class_attention(i) for i in range(3)] == [False, False, True]
    attn = torch.tensor([[0.6, 0.4, 0.0, 0.0, 0.0]])  # class token: itself and patch token 0 only
    tracker.class_attention(2, attn)
    tracker.pool("token", 0)
    out = tracker.finish()
    lam_attn = lm.token_weights(GRID)[:, 0]  # all renormalised patch attention on patch 0: (0.5, 0.5)
    assert out.weights is not None
    assert_close(out.weights, (lam_attn + lm.image_weights) / 2)
    with pytest.raises(ValueError, match="no class token"):
        TransMix().start(lm, TokenLayout(GRID, 0, 3, class_token=False))


def test_transmix_class_row_over_a_grid_that_changed() -> None:
    """A model that merged tokens since the start passes the row's grid: the areas are that grid's cells. Here the
    labels start on a 4x4 grid and the class token attends over a 1x2 grid (left and right halves)."""
    lm = left_half_map(b=1)  # the left quarter of the image from the sample itself
    tracker = TransMix().start(lm, TokenLayout(grid=(4, 4), num_prefix=1, depth=3, class_token=True))
    tracker.class_attention(2, torch.tensor([[0.2, 0.8, 0.0]]), (1, 2))  # all patch attention on the left half
    tracker.pool("token", 0)
    out = tracker.finish()
    left_half = torch.tensor([[0.5, 0.5]])  # the left half: half of it the sample's own quarter
    assert out.weights is not None
    assert_close(out.weights, (left_half + lm.image_weights) / 2)
    dense = DenseTracker.start(TransMix(), lm, TokenLayout(grid=(4, 4), num_prefix=1, depth=3, class_token=True))
    dense.attend_class(torch.tensor([[0.2, 0.8, 0.0]]), (1, 2))
    result = dense.result(torch.zeros(1, 4), torch.zeros(1, 4), "token", None)
    assert_close(result.target, out.target)


def test_dropped_branch_keeps_labels_and_layers_select() -> None:
    lm = left_half_map()
    tracker = TLAlign(layers=(1,)).start(lm, LAYOUT)
    assert [tracker.labels_for(i) is not None for i in range(3)] == [False, True, False]
    start = current_labels(tracker, 1)
    uniform = start.mean(dim=1, keepdim=True).expand_as(start)
    tracker.residual(1, keep=torch.tensor([True, False]), mixed=uniform)
    assert_close(current_labels(tracker, 1)[0], (start[0] + uniform[0]) / 2)
    assert_close(current_labels(tracker, 1)[1], start[1])  # dropped by stochastic depth: unchanged
    with pytest.raises(ValueError, match=r"layer=0.*does not align.*pass mixed=None"):
        tracker.residual(0, keep=None, mixed=uniform)  # a mix where the scheme asked for none: refused
    assert_close(current_labels(tracker, 1)[1], start[1])  # ... and it left the labels alone
    with pytest.raises(ValueError, match="out of range"):
        TLAlign(layers=(3,)).start(lm, LAYOUT)
    assert TLAlign(layers=(-1,)).start(lm, LAYOUT).labels_for(2) is not None


def dense_drop_path_reference(lm: TokenLabelMap, attn: torch.Tensor, keeps: torch.Tensor, rule: str) -> torch.Tensor:
    """The class token's label after every layer's ``Y <- (Y + A Y) / 2``, sample by sample, on class distributions.

    ``"official"`` (the official TL-Align block): the update runs whatever stochastic depth drew.
    ``"follow"``: a sample whose attention branch was dropped keeps its labels in that layer.
    """
    targets = []
    for s in range(lm.batch_size):
        y = torch.cat([lm.image_targets()[s : s + 1], lm.targets(lm.token_weights(GRID))[s]]).double()  # n c
        for layer in range(attn.shape[0]):
            if rule == "official" or bool(keeps[layer, s]):
                y = (y + attn[layer, s].double() @ y) / 2
        targets.append(y[0])
    return torch.stack(targets).float()


@pytest.mark.parametrize("rule", ["follow", "official"])
def test_drop_path_rule_against_a_dense_reference(rule: str) -> None:
    """Fixed drop-path draws over three layers; sample 2 is never dropped, samples 0 and 1 are."""
    lm = left_half_map(b=3)
    n = LAYOUT.num_tokens
    attn = torch.softmax(4.0 * torch.randn(LAYOUT.depth, 3, n, n, generator=torch.Generator().manual_seed(0)), dim=-1)
    keeps = torch.tensor([[True, False, True], [False, False, True], [True, True, True]])  # layer b
    tracker = TLAlign(drop_path=rule).start(lm, LAYOUT)
    for layer in range(LAYOUT.depth):
        tracker.residual(layer, keeps[layer], mixed=attn[layer] @ current_labels(tracker, layer))  # attention residual
        tracker.residual(layer, ~keeps[layer], mixed=None)  # MLP residual: no spatial mix, labels unchanged whatever the draw
    tracker.pool("token", 0)  # the class token, as the ViT adapter reads it
    got = tracker.finish().target
    assert_close(got, dense_drop_path_reference(lm, attn, keeps, rule))
    other = dense_drop_path_reference(lm, attn, keeps, "official" if rule == "follow" else "follow")
    assert ((got[:2] - other[:2]).abs().amax(dim=-1) > 1e-3).all()  # dropped somewhere: the rules differ
    assert_close(got[2], other[2])  # never dropped: both rules agree


def test_drop_path_rule_is_checked_and_configurable() -> None:
    with pytest.raises(ValueError, match="'follow'.*'official'"):
        TLAlign(drop_path="offical")
    adapter: TypeAdapter[SchemeConfig] = TypeAdapter(SchemeConfig)
    assert adapter.validate_python({"kind": "tl_align", "drop_path": "official"}).build() == TLAlign(drop_path="official")
    assert adapter.validate_python({"kind": "tl_align"}).build().drop_path == "follow"
    with pytest.raises(ValidationError):
        adapter.validate_python({"kind": "tl_align", "drop_path": "offical"})


def test_aggregate_sums_and_renormalises() -> None:
    lm = left_half_map()
    tracker = TLAlign().start(lm, TokenLayout(GRID, 0, 1, class_token=False))
    tracker.aggregate(lambda y: y.sum(dim=1, keepdim=True))  # merge all four tokens into one
    assert_close(current_labels(tracker)[:, 0], lm.image_weights)
    tracker.pool("mean", 0)
    assert_close(tracker.finish().target, lm.image_targets())


def test_noalign_and_unaligned_token_labeling_targets() -> None:
    lm = left_half_map()
    t = NoAlign().start(lm, LAYOUT).finish()
    assert_close(t.target, lm.image_targets())
    assert t.token_target is None
    t = TokenLabeling(beta=0.25).start(lm, LAYOUT).finish()
    assert_close(t.target, lm.image_targets())
    assert t.token_target is not None
    assert_close(t.token_target, lm.targets(lm.token_weights(GRID)))
    assert t.token_loss_weight == 0.25


def test_annotator_hook_gives_dense_token_targets() -> None:
    lm = left_half_map()
    maps = torch.softmax(torch.randn(2, 2, 2, 4), dim=-1)  # b h w c, from a (fake) annotator, before mixing
    t = TokenLabeling().start(lm.with_token_targets(maps), LAYOUT).finish()
    assert t.token_target is not None
    flat, w = maps.flatten(1, 2), lm.token_weights(GRID)  # b n c, b n k: each token mixes its sources' cells
    assert_close(t.token_target, w[..., :1] * flat[lm.sources[:, 0]] + w[..., 1:] * flat[lm.sources[:, 1]])
    assert TLAlign().start(lm.with_token_targets(maps), LAYOUT).finish().weights is not None  # unused: compact labels


@pytest.mark.parametrize("aligned", [False, True])
def test_annotator_maps_fast_path_equals_reference(aligned: bool) -> None:
    torch.manual_seed(0)
    model = VisionTransformer(img_size=16, patch_size=8, embed_dim=16, depth=2, num_heads=2, num_classes=4)
    lm = TokenLabelMap.from_mask(torch.ones(2, 16, 16).tril(), torch.tensor([1, 0]), torch.tensor([0, 3]), num_classes=4)
    lm = lm.with_token_targets(torch.softmax(torch.randn(2, 4, 4, 4) * 3, dim=-1))  # finer maps: averaged per token
    images = lm.mix_pixels(torch.randn(2, 3, 16, 16))
    scheme = TokenLabeling(beta=0.5, aligned=aligned)
    fast, ref = backbones.adapt(model, scheme)(images, lm), backbones.adapt(model, scheme, reference=True)(images, lm)
    assert fast.token_target is not None and ref.token_target is not None
    assert_close(fast.token_target, ref.token_target, rtol=0, atol=1e-6)
    assert_close(fast.target, ref.target, rtol=0, atol=1e-6)
    assert not torch.allclose(fast.token_target, lm.targets(lm.token_weights((2, 2))), atol=1e-3)  # the maps, not the mask


def test_loss_is_class_plus_beta_tokens() -> None:
    logits, tok = torch.randn(2, 4, requires_grad=True), torch.randn(2, 3, 4)
    target, tok_target = torch.softmax(torch.randn(2, 4), -1), torch.softmax(torch.randn(2, 3, 4), -1)
    out = AlignedOutput(logits, logits, target, None, tok, tok_target, 0.5)
    expected = soft_target_cross_entropy(logits, target) + 0.5 * token_soft_target_cross_entropy(tok, tok_target)
    assert_close(out.loss(), expected)
    assert_close(AlignedOutput(logits, logits, target).loss(), soft_target_cross_entropy(logits, target))


@pytest.mark.parametrize("field", ["target", "weights", "token_target"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_output_with_half_precision_targets_is_refused(field: str, dtype: torch.dtype) -> None:
    """A cast output (FSDP2's ``output_dtype`` rebuilds it from its cast fields) raises, naming the field and the fix;
    float32 and float64 targets (the reference path) are kept."""
    logits, tok = torch.randn(2, 4), torch.randn(2, 3, 4)
    target, tok_target = torch.softmax(torch.randn(2, 4), -1), torch.softmax(torch.randn(2, 3, 4), -1)
    out = AlignedOutput(logits, logits, target, torch.rand(2, 2), tok, tok_target, 0.5)
    with pytest.raises(TypeError, match=rf"AlignedOutput.{field} is torch.{str(dtype).split('.')[1]}.*output_dtype=None"):
        dataclasses.replace(out, **{field: getattr(out, field).to(dtype)})
    assert dataclasses.replace(out, logits=logits.to(dtype)).logits.dtype == dtype  # the logits are the user's to cast
    assert getattr(dataclasses.replace(out, **{field: getattr(out, field).double()}), field).dtype == torch.float64


# ---------------------------------------------------------------------------- configs
def test_scheme_configs_build_each_scheme() -> None:
    adapter: TypeAdapter[SchemeConfig] = TypeAdapter(SchemeConfig)
    assert adapter.validate_python({"kind": "none"}).build() == NoAlign()
    assert adapter.validate_python({"kind": "transmix"}).build() == TransMix()
    built = adapter.validate_python({"kind": "tl_align", "layers": [1, 3, 5, 7], "normalize": False}).build()
    assert built == TLAlign(layers=[1, 3, 5, 7], normalize=False)
    assert adapter.validate_python({"kind": "token_labeling", "beta": 1.0, "aligned": True}).build() == TokenLabeling(
        1.0, True
    )
    with pytest.raises(ValidationError):
        adapter.validate_python({"kind": "token_labeling", "beta": -1.0})
    with pytest.raises(ValidationError):
        adapter.validate_python({"kind": "tl_align", "typo": 1})
    with pytest.raises(ValueError, match="beta"):
        TokenLabeling(beta=-0.1)
