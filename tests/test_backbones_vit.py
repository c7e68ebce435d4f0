"""The timm ViT adapter: function preservation, fast path = reference path, no attention matrix, errors."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import timm
import torch
from timm.layers import drop_path
from timm.models.deit import VisionTransformerDistilled
from timm.layers import RmsNorm
from timm.layers.attention import Attention
from timm.models.vision_transformer import (
    DiffParallelScalingBlock, ParallelScalingBlock, ParallelThingsBlock, ResPostBlock, VisionTransformer,
)
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from test_backbones_common import cutmix_batch, grads

from mixlabels import backbones
import mixlabels
from mixlabels.backbones._attention import drop_path_with_keep
from mixlabels.backbones.families.vit import join_branches
from mixlabels import NoAlign, TLAlign, TokenLabeling, TokenLabelMap, TransMix

B, IMG, PATCH, DIM, HEADS, DEPTH, C = 4, 32, 8, 32, 2, 3, 10
BASE: dict[str, Any] = dict(img_size=IMG, patch_size=PATCH, embed_dim=DIM, depth=DEPTH, num_heads=HEADS, num_classes=C)
CONFIGS: dict[str, dict[str, Any]] = {
    "cls": {},
    "distilled": {"distilled": True},
    "registers": {"reg_tokens": 2},
    "pooled": {"class_token": False, "global_pool": "avg"},
    "qk_norm": {"qk_norm": True},
    "layer_scale": {"init_values": 0.1},
    "res_post": {"block_fn": ResPostBlock, "init_values": 0.5},  # x + norm(f(x)), the norms' weights 0.5
    "parallel_things": {"block_fn": ParallelThingsBlock, "init_values": 0.1},  # 2 attentions, then 2 MLPs
    "parallel_scaling": {  # vit_*_xp: attention and MLP from one RmsNorm, qk norm
        "block_fn": ParallelScalingBlock, "norm_layer": RmsNorm, "qk_norm": True, "pre_norm": True, "no_embed_class": True,
    },
    "parallel_scaling_gap": {  # vit_pwee: a register token, average pooling, and here the fused output projection
        "block_fn": functools.partial(ParallelScalingBlock, fuse_out_proj=True), "init_values": 0.1,
        "class_token": False, "reg_tokens": 1, "no_embed_class": True, "global_pool": "avg",
    },
}
POOLED_CONFIGS = ("pooled", "parallel_scaling_gap")  # no class token: TransMix refuses
SCHEMES: dict[str, Any] = {
    "none": NoAlign(),
    "transmix": TransMix(),
    "tl_align": TLAlign(),
    "tl_last": TLAlign(layers=(-1,)),  # Table 8: "Layer 12"
    "tl_some": TLAlign(layers=(0, 2)),  # Table 8: "Layer 2,4,6,8" in spirit
    "tl_no_norm": TLAlign(normalize=False),  # Table 8: "Normalization Disabled"
    "tl_official": TLAlign(drop_path="official"),  # the official code's drop-path rule
    "tokens": TokenLabeling(beta=0.5),
    "tokens_aligned": TokenLabeling(beta=0.5, aligned=True),
}


def make_model(name: str, drop_path_rate: float = 0.0, sharpen: float = 1.0, seed: int = 0) -> VisionTransformer:
    torch.manual_seed(seed)
    kwargs = dict(CONFIGS[name])
    cls = VisionTransformerDistilled if kwargs.pop("distilled", False) else VisionTransformer
    model = cls(**BASE, **kwargs, drop_path_rate=drop_path_rate)
    if cls is VisionTransformerDistilled:
        model.set_distilled_training(True)
    if sharpen != 1.0:
        # Random-init ViTs attend almost uniformly; scaled q and k make attention peaked,
        # so alignment moves the targets and a parity test can fail.
        with torch.no_grad():
            for mod in model.blocks.modules():
                if isinstance(mod, Attention):
                    mod.qkv.weight[: 2 * DIM] *= sharpen
                if isinstance(mod, ParallelScalingBlock):  # in_proj: [mlp, q, k, v]
                    mod.in_proj.weight[mod.in_split[0] : mod.in_split[0] + 2 * DIM] *= sharpen
    return model


def output_sum(out: Any) -> torch.Tensor:
    return sum(o.sum() for o in out) if isinstance(out, tuple) else out.sum()


# ---------------------------------------------------------------------------- preservation
@pytest.mark.parametrize("config", list(CONFIGS))
def test_plain_call_is_the_model(config: str) -> None:
    model = make_model(config, drop_path_rate=0.3)
    aligned = backbones.adapt(model, TLAlign())
    assert aligned.model is model
    assert list(aligned.state_dict()) == list(model.state_dict())  # a plain timm state dict
    images, _ = cutmix_batch()
    torch.manual_seed(5)
    expected = model(images)
    torch.manual_seed(5)
    assert_close(aligned(images), expected, rtol=0, atol=0)


@pytest.mark.parametrize("scheme", ["none", "tl_align", "tokens_aligned"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str, scheme: str) -> None:
    """Logits and parameter gradients equal the bare timm model's, stochastic depth on, same seed."""
    model = make_model(config, drop_path_rate=0.5)
    model.train()
    images, lm = cutmix_batch()
    torch.manual_seed(7)
    expected = model(images)
    output_sum(expected).backward()
    expected_grads = grads(model)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    out = backbones.adapt(model, SCHEMES[scheme])(images, lm)
    output_sum(out.output).backward()
    assert type(out.output) is type(expected)
    assert_close(out.output, expected, rtol=1e-5, atol=1e-6)
    got = grads(model)
    assert got.keys() == expected_grads.keys()
    for name in got:
        assert_close(got[name], expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_drop_path_matches_timm_draw() -> None:
    x = torch.randn(16, 5, 3)
    torch.manual_seed(3)
    expected = drop_path(x, 0.5, training=True)
    torch.manual_seed(3)
    got, keep = drop_path_with_keep(x, 0.5, training=True)
    assert_close(got, expected, rtol=0, atol=0)
    assert keep is not None and 0 < int(keep.sum()) < 16
    assert torch.equal(keep, expected.flatten(1).abs().sum(1) > 0)


# ---------------------------------------------------------------------------- fast = reference
def parity_cases() -> list[tuple[str, str]]:
    cases = [(c, s) for c in CONFIGS for s in SCHEMES if not (c in POOLED_CONFIGS and s == "transmix")]
    return cases


@pytest.mark.parametrize(("config", "scheme"), parity_cases())
def test_fast_path_equals_reference(config: str, scheme: str) -> None:
    model = make_model(config, drop_path_rate=0.4, sharpen=8.0)
    model.train()
    images, lm = cutmix_batch()
    fast = backbones.adapt(model, SCHEMES[scheme])
    ref = backbones.adapt(model, SCHEMES[scheme], reference=True)
    torch.manual_seed(11)
    a = fast(images, lm)
    torch.manual_seed(11)
    b = ref(images, lm)
    assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
    assert_close(a.target, b.target, rtol=1e-5, atol=1e-5)
    assert_close(a.target.sum(-1), torch.ones(B))
    assert not a.target.requires_grad
    if a.token_target is not None or b.token_target is not None:
        assert a.token_target is not None and b.token_target is not None and a.token_logits is not None
        assert_close(a.token_target, b.token_target, rtol=1e-5, atol=1e-5)
        assert_close(a.token_logits, b.token_logits, rtol=1e-5, atol=1e-5)
    assert_close(a.loss(), b.loss(), rtol=1e-5, atol=1e-5)
    if scheme not in ("none", "tokens"):  # alignment must have moved the targets
        assert (a.target - lm.image_targets()).abs().max() > 1e-3


@pytest.mark.parametrize("scheme", ["tl_align", "tokens_aligned", "none"])
def test_mixtoken_fast_equals_reference(scheme: str) -> None:
    model = make_model("cls", drop_path_rate=0.2, sharpen=8.0)
    images, lm = cutmix_batch(token_space=True)
    torch.manual_seed(2)
    a = backbones.adapt(model, SCHEMES[scheme])(images, lm)
    torch.manual_seed(2)
    b = backbones.adapt(model, SCHEMES[scheme], reference=True)(images, lm)
    assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
    assert_close(a.target, b.target, rtol=1e-5, atol=1e-5)
    # MixToken mixes embeddings: the logits differ from the model on the unmixed images.
    assert (a.logits - model.eval()(images)).abs().max() > 1e-4


def test_drop_path_rules_differ_only_under_stochastic_depth() -> None:
    """Same draws: the two rules give different targets in train mode (some sample dropped), equal ones in eval."""
    model = make_model("cls", drop_path_rate=0.5, sharpen=8.0)
    images, lm = cutmix_batch()
    targets = {}
    for rule in ("follow", "official"):
        torch.manual_seed(3)
        targets[rule] = backbones.adapt(model.train(), TLAlign(drop_path=rule))(images, lm).target
    assert (targets["follow"] - targets["official"]).abs().max() > 1e-3
    with torch.no_grad():
        follow = backbones.adapt(model.eval(), TLAlign())(images, lm).target
        official = backbones.adapt(model.eval(), TLAlign(drop_path="official"))(images, lm).target
    assert_close(follow, official, rtol=0, atol=0)


def test_training_step_runs_and_eval_mode_is_allowed() -> None:
    model = make_model("distilled")
    images, lm = cutmix_batch()
    aligned = backbones.adapt(model, TLAlign())
    out = aligned(images, lm)
    assert isinstance(out.output, tuple) and out.logits is out.output[0]  # timm's distilled training tuple
    out.loss().backward()
    assert model.blocks[0].attn.qkv.weight.grad is not None
    model.eval()
    out = aligned(images, lm)  # eval: timm averages the two heads; targets still computed
    assert isinstance(out.output, torch.Tensor)
    assert_close(out.target.sum(-1), torch.ones(B))


# ---------------------------------------------------------------------------- no N x N tensor
class ShapeRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def attention_matrices(shapes: list[tuple[int, ...]], n: int) -> list[tuple[int, ...]]:
    return [s for s in shapes if len(s) >= 3 and s[-2:] == (n, n) and s[0] == B]


@pytest.mark.parametrize("scheme", ["tl_align", "transmix", "tokens_aligned"])
def test_fast_path_allocates_no_attention_matrix(scheme: str) -> None:
    model = make_model("registers", drop_path_rate=0.2)
    images, lm = cutmix_batch()
    n = (IMG // PATCH) ** 2 + model.num_prefix_tokens
    for reference, expect in ((False, False), (True, True)):  # the reference shows the test can fail
        rec = ShapeRecorder()
        with rec:
            out = backbones.adapt(model, SCHEMES[scheme], reference=reference)(images, lm)
            out.loss().backward()
        assert bool(attention_matrices(rec.shapes, n)) is expect, (reference, attention_matrices(rec.shapes, n)[:3])


# ---------------------------------------------------------------------------- autocast, compile
def test_autocast_bf16_targets_close_to_fp32() -> None:
    model = make_model("qk_norm", drop_path_rate=0.0, sharpen=8.0)
    images, lm = cutmix_batch()
    aligned = backbones.adapt(model, TokenLabeling(aligned=True))
    exact = aligned(images, lm)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = aligned(images, lm)
    out.loss().backward()
    assert out.target.dtype == torch.float32
    assert_close(out.target.sum(-1), torch.ones(B))
    # bf16 label channels: measured max error about 5e-4 on this depth-3 model.
    assert (out.target - exact.target).abs().max() < 5e-3
    assert out.token_target is not None and exact.token_target is not None
    assert (out.token_target - exact.token_target).abs().max() < 5e-3


def test_torch_compile_aot_eager_matches_eager() -> None:
    model = make_model("cls", drop_path_rate=0.0, sharpen=8.0)
    images, lm = cutmix_batch()
    aligned = backbones.adapt(model, TLAlign())
    eager = aligned(images, lm)
    compiled = torch.compile(aligned, backend="aot_eager")
    out = compiled(images, lm)
    assert_close(out.logits, eager.logits, rtol=1e-5, atol=1e-5)
    assert_close(out.target, eager.target, rtol=1e-5, atol=1e-5)
    out.loss().backward()
    assert model.blocks[0].attn.qkv.weight.grad is not None


# ---------------------------------------------------------------------------- errors
def test_unsupported_model_lists_supported_families() -> None:
    nfnet = timm.create_model("test_byobnet", pretrained=False, num_classes=C)
    with pytest.raises(TypeError, match="Supported families") as err:
        backbones.adapt(nfnet, TLAlign())
    assert "VisionTransformer" in str(err.value) and "ByobNet" in str(err.value)
    maxpooled = VisionTransformer(**BASE, global_pool="max", class_token=False)
    with pytest.raises(TypeError, match="global_pool"):
        backbones.adapt(maxpooled, TLAlign())
    assert type(backbones.adapt(maxpooled, NoAlign())).__name__ == "AdaptedClassifier"  # NoAlign: any classifier


def test_clear_input_errors() -> None:
    model = make_model("cls")
    images, lm = cutmix_batch()
    aligned = backbones.adapt(model, TLAlign())
    with pytest.raises(ValueError, match="made for 32x32"):
        aligned(torch.randn(B, 3, 24, 24), lm)
    dyn = VisionTransformer(**BASE, dynamic_img_size=True)
    odd = TokenLabelMap.unmixed(torch.arange(B), C, (36, 36))
    with pytest.raises(ValueError, match="not divisible by the patch size"):
        backbones.adapt(dyn, TLAlign())(torch.randn(B, 3, 36, 36), odd)
    pooled = make_model("pooled")
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(pooled, TransMix())(images, lm)
    model.set_grad_checkpointing(True)
    with pytest.raises(RuntimeError, match="gradient checkpointing"):
        aligned(images, lm)
    assert aligned(images).shape == (B, C)  # without labels, timm's own checkpointed forward


def test_dynamic_img_size_other_resolution() -> None:
    torch.manual_seed(0)
    dyn = VisionTransformer(**BASE, dynamic_img_size=True)
    lm = TokenLabelMap.unmixed(torch.arange(B), C, (48, 40))
    images = torch.randn(B, 3, 48, 40)
    fast = backbones.adapt(dyn, TLAlign())(images, lm)
    ref = backbones.adapt(dyn, TLAlign(), reference=True)(images, lm)
    assert_close(fast.logits, dyn(images), rtol=1e-5, atol=1e-6)
    assert_close(fast.target, ref.target, rtol=1e-5, atol=1e-6)


def test_scheme_config_builds_for_adapt() -> None:
    from pydantic import TypeAdapter

    scheme = TypeAdapter(mixlabels.SchemeConfig).validate_python({"kind": "token_labeling", "aligned": True}).build()
    images, lm = cutmix_batch()
    out = backbones.adapt(make_model("cls"), scheme)(images, lm)
    assert out.token_logits is not None and out.token_logits.shape == (B, (IMG // PATCH) ** 2, C)


def test_parallel_branches_join_where_kept() -> None:
    """Two parallel attentions: a sample counts the branches it kept; one that kept none keeps its labels."""
    m1, m2 = torch.zeros(3, 1, 2), torch.zeros(3, 1, 2)
    m1[..., 0], m2[..., 1] = 1.0, 1.0
    mixed, keep = join_branches([m1, m2], [torch.tensor([True, False, False]), torch.tensor([True, True, False])])
    assert keep is not None and keep.tolist() == [True, True, False]
    assert_close(mixed[:, 0], torch.tensor([[0.5, 0.5], [0.0, 1.0], [0.5, 0.5]]))
    mixed, keep = join_branches([m1, m2], [None, None])
    assert keep is None and mixed[:, 0].tolist() == [[0.5, 0.5]] * 3


@pytest.mark.parametrize(
    "kwargs", [{"attn_layer": "diff"}, {"block_fn": DiffParallelScalingBlock}], ids=["diff_attention", "diff_parallel"]
)
def test_differential_attention_is_refused(kwargs: dict[str, Any]) -> None:
    model = VisionTransformer(**BASE, **kwargs)
    with pytest.raises(TypeError, match="negative"):
        backbones.adapt(model, TLAlign())
