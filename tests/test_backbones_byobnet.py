"""The ByobNet adapter (MobileViT v1/v2, basic/bottleneck ByobNets): preservation, fast = reference, the steps
that are timm's own, the two-state fusion rule, every timm name, refusals."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import timm
import torch
from test_backbones_common import (
    POOLED,
    SCHEMES,
    check_parity,
    check_parity_moving_statistics,
    check_preservation,
    check_unmixed_is_one_hot,
    cutmix_batch,
    set_fused,
    sharpen,
)
from timm.layers import LayerNorm2d
from timm.layers.evo_norm import (
    EvoNorm2dB0,
    EvoNorm2dB1,
    EvoNorm2dB2,
    EvoNorm2dS0,
    EvoNorm2dS0a,
    EvoNorm2dS1,
    EvoNorm2dS1a,
    EvoNorm2dS2,
    EvoNorm2dS2a,
)
from timm.layers.global_context import GlobalContext
from timm.models.byobnet import ByoBlockCfg, ByobNet, ByoModelCfg
from torch import nn
from torch.testing import assert_close

from mixlabels import TLAlign, TokenLabeling, TokenLabelMap, TransMix, backbones
from mixlabels.backbones._common import conv_mix, conv_mix_pair
from mixlabels.backbones._dense import conv_matrix, row_normalise
from mixlabels.backbones.families.byobnet import _linear_attention, _vit_attention, byobnet_refusal, rep_kernel, tiny_mobilevit


def make(version: int, drop: float = 0.0) -> nn.Module:
    """The registry's tiny MobileViT (v1: sharpened attention; v2: context scores sharpened by scaling the query row)."""
    model = tiny_mobilevit(version, drop_path_rate=drop, drop_rate=0.1)
    if version == 1:
        return sharpen(model)
    with torch.no_grad():
        for mod in model.modules():
            if type(mod).__name__ == "LinearSelfAttention":
                mod.qkv_proj.weight[0] *= 8.0  # the query channel: near-uniform context scores at init otherwise
    return model


def tiny_genet(drop: float = 0.0) -> nn.Module:
    """A conv-only ByobNet: tiered stem with max pool, a basic block, two SE bottlenecks (avg-pool shortcut)."""
    torch.manual_seed(0)
    cfg = ByoModelCfg(
        blocks=(ByoBlockCfg(type="basic", d=1, c=8, s=1, br=1.0), ByoBlockCfg(type="bottle", d=2, c=16, s=2, br=0.5)),
        stem_chs=8, stem_type="tiered", stem_pool="maxpool", downsample="avg", attn_layer="se", num_features=24,
    )  # fmt: skip
    return ByobNet(cfg, num_classes=10, drop_path_rate=drop)


@pytest.mark.parametrize("version", [1, 2])
def test_function_preservation_train_mode(version: int) -> None:
    for scheme in ("none", "tl_align", "tokens_aligned"):
        check_preservation(make(version, drop=0.5), SCHEMES[scheme])


def test_function_preservation_genet_and_eval() -> None:
    check_preservation(tiny_genet(drop=0.5), SCHEMES["tl_align"])
    images, lm = cutmix_batch()
    for model in (make(1).eval(), make(2).eval(), tiny_genet().eval()):
        assert_close(backbones.adapt(model, TLAlign())(images, lm).output, model(images), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheme", POOLED)
@pytest.mark.parametrize("version", [1, 2])
def test_fast_path_equals_reference(version: int, scheme: str) -> None:
    check_parity(make(version, drop=0.4), scheme)  # drop 0.4: v1's per-offset drop-path keeps some sequences only


def test_fast_path_equals_reference_variants() -> None:
    check_parity(tiny_genet(drop=0.4), "tl_align")
    check_parity(tiny_genet(), "tokens_aligned", token_space=True)
    check_parity(make(1), "tokens_aligned", token_space=True)
    check_parity(set_fused(make(1, drop=0.4), False), "tl_align")  # timm's explicit attention path
    check_parity(make(2), "tl_official")


def test_unmixed_gives_one_hot() -> None:
    for model in (make(1), make(2), tiny_genet()):
        check_unmixed_is_one_hot(model, POOLED)


def test_attention_steps_are_timms() -> None:
    """The v1 attention and the v2 separable attention are timm's modules bit for bit; their label weights are
    distributions (v1: the head-mean rows; v2: the context scores over the patches of one offset)."""
    for model in (make(1).eval(), make(2).eval()):
        blk = model.stages[-1][-1]
        attn = blk.transformer[0].attn
        if type(attn).__name__ == "Attention":
            x = torch.randn(8, 16, 16)
            labels = torch.softmax(torch.randn(8, 16, 3), -1)
            out, mixed, _ = _vit_attention(attn, x, labels)
            assert_close(out, attn(x), rtol=0, atol=1e-6)
            assert mixed is not None
            assert_close(mixed.sum(-1), torch.ones(8, 16))
        else:
            x = torch.randn(2, attn.embed_dim, 4, 16)  # b c p m
            out, scores = _linear_attention(attn, x)
            assert_close(out, attn(x), rtol=0, atol=0)
            assert_close(scores.sum(-1), torch.ones(2, 4))


def test_fusion_rule() -> None:
    """Two label states through one conv: equal halves give the one-state conv rule; on a grid over the explicit
    bound (the conv path) it equals the explicit matrices; it stays a distribution."""
    g = torch.Generator().manual_seed(0)
    for grid in ((4, 4), (9, 9)):
        n = grid[0] * grid[1]
        k1, k2 = torch.rand(3, 3, generator=g), torch.rand(3, 3, generator=g)
        total = (k1 + k2).sum()
        k1, k2 = k1 / total, k2 / total
        y1 = torch.softmax(torch.randn(2, n, 5, generator=g), -1)
        y2 = torch.softmax(torch.randn(2, n, 5, generator=g), -1)
        fused = conv_mix_pair(y1, y2, grid, k1, k2, (1, 1), (1, 1))
        assert_close(fused.sum(-1), torch.ones(2, n))
        assert_close(conv_mix_pair(y1, y1, grid, k1, k2, (1, 1), (1, 1)), conv_mix(y1, grid, k1 + k2, (1, 1), (1, 1)))
        halves = [conv_matrix(grid, k.double(), padding=(1, 1))[0] for k in (k1, k2)]
        explicit = row_normalise(torch.cat(halves, dim=1)) @ torch.cat([y1, y2], dim=1).double()
        assert_close(fused.double(), explicit, rtol=1e-6, atol=1e-6)


def test_v1_fusion_reads_both_halves() -> None:
    """With the fusion conv's path channels zeroed, v1's block output labels are the input's labels through the
    conv alone: a change of the transformer's attention does not reach them; with its input channels zeroed, it does."""
    images, lm = cutmix_batch()
    for zeroed, attention_counts in (("path", False), ("input", True)):
        model = make(1).eval()
        blk = model.stages[-1][-1]
        c_in = blk.conv_kxk.conv.in_channels
        with torch.no_grad():
            weight = blk.conv_fusion.conv.weight
            (weight[:, c_in:] if zeroed == "path" else weight[:, :c_in]).zero_()
        before = backbones.adapt(model, TLAlign())(images, lm).target
        with torch.no_grad():
            for tb in blk.transformer:
                tb.attn.qkv.weight[:32].mul_(3.0)  # sharper queries and keys: other attention rows
        after = backbones.adapt(model, TLAlign())(images, lm).target
        assert ((after - before).abs().max() > 1e-3) == attention_counts, zeroed


def test_every_timm_name_adapts_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "byobnet")
    names = timm.list_models(module="mobilevit")
    assert len(names) == 10
    for name in names + ["gernet_s", "resnet33ts", "seresnext26ts", "eca_resnet33ts", "regnetz_b16", "resnet51q"]:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    for name, why in (("bat_resnext26ts", "block 0's branch module 5 is BatNonLocalAttn, which has no label rule here"),
                      ("gcresnet33ts", "block 0's branch module 5 is GlobalContext with fuse_add ('gca')"),
                      ("resnet50_clip", "the head (AttentionPool2d) has no label readout")):  # fmt: skip
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        reason = byobnet_refusal(model)
        assert reason is not None and reason.startswith(why), (name, reason)
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(1), TransMix())(images, lm)
    # timm's mobilevit_xxs at 224 px: the last MobileViT block gets a 7x7 map, which timm would resize
    torch.manual_seed(0)
    xxs = timm.create_model("mobilevit_xxs", pretrained=False, num_classes=10)
    big = torch.zeros(1, 224, 224)
    big[:, :100, :50] = 1.0
    lm224 = TokenLabelMap.from_mask(big, torch.tensor([0]), torch.tensor([3]), num_classes=10)
    with pytest.raises(ValueError, match=r"gets a 7x7 map, not a multiple of its 2x2 patches.*256x256"):
        backbones.adapt(xxs, TLAlign())(torch.randn(1, 3, 224, 224), lm224)


# ---------------------------------------------------------------------------------------------- EdgeBlock, GlobalContext gate,
# EvoNorm, NormMlpClassifierHead
def tiny_edge(drop: float = 0.0, norm: Any = None, head: str = "classifier") -> nn.Module:
    """An EdgeBlock ByobNet (kxk then 1x1) with GlobalContext gates ('gc'): a plain edge block and a strided one
    with an avg-pool shortcut, then a bottleneck; ``norm`` everywhere (an EvoNorm, LayerNorm2d), ``head`` timm's."""
    torch.manual_seed(0)
    cfg = ByoModelCfg(
        blocks=(ByoBlockCfg(type="edge", d=1, c=8, s=1, br=1.0), ByoBlockCfg(type="edge", d=1, c=16, s=2, br=0.5),
                ByoBlockCfg(type="bottle", d=1, c=16, s=1, br=0.5)),
        stem_chs=8, stem_type="3x3", stem_pool="", downsample="avg", attn_layer="gc", num_features=24,
        head_type=head, head_hidden_size=16 if head == "mlp" else None, **({} if norm is None else {"norm_layer": norm}),
    )  # fmt: skip
    return ByobNet(cfg, num_classes=10, drop_path_rate=drop)


_EDGE_VARIANTS: dict[str, Callable[[float], nn.Module]] = {
    "edge_gc": lambda drop: tiny_edge(drop),
    "evonorm_s0a": lambda drop: tiny_edge(drop, partial(EvoNorm2dS0a, group_size=4)),
    "evonorm_s1": lambda drop: tiny_edge(drop, partial(EvoNorm2dS1, group_size=4)),
    "evonorm_b0": lambda drop: tiny_edge(drop, EvoNorm2dB0),
    "evonorm_b2": lambda drop: tiny_edge(drop, EvoNorm2dB2),
    "mlp_head_ln": lambda drop: tiny_edge(drop, LayerNorm2d, head="mlp"),
}


@pytest.mark.parametrize("variant", list(_EDGE_VARIANTS))
def test_edge_gc_evonorm_mlp_head(variant: str) -> None:
    """Preservation (train mode, drop path on), fast = reference on every pooled scheme, unmixed one-hot."""
    check_preservation(_EDGE_VARIANTS[variant](0.5), SCHEMES["tl_align"])
    for scheme in POOLED:
        check_parity(_EDGE_VARIANTS[variant](0.4), scheme, must_move=scheme != "none")
    check_unmixed_is_one_hot(_EDGE_VARIANTS[variant](0.0), POOLED)


def test_global_context_is_a_channel_op() -> None:
    """timm's 'gc' GlobalContext: an input change at one position changes the gate of every position alike, never
    another position's pre-gate content, so its output at a position is that position's input times a per-channel
    gate. 'gca' (fuse_add) adds the pooled context to every position: its output at a position moves with another
    position's input, which is why it is refused."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    gate, add = GlobalContext(32).eval(), GlobalContext(32, fuse_add=True, fuse_scale=False).eval()  # 4 hidden channels
    with torch.no_grad():
        for mod in (gate, add):
            for p in mod.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        x = torch.randn(2, 32, 4, 4, generator=g)
        out = gate(x)
        ratio = out / x  # the per-(sample, channel) gate: equal at every position
        assert_close(ratio, ratio[:, :, :1, :1].expand_as(ratio), rtol=1e-4, atol=1e-5)
        moved = x.clone()
        moved[:, :, 0, 0] += 1.0
        assert (add(moved) - add(x))[:, :, 3, 3].abs().max() > 1e-3  # another position's content reaches (3, 3)
    with torch.device("meta"):
        model = timm.create_model("gcresnet33ts", pretrained=False)
    reason = byobnet_refusal(model)
    assert reason is not None and "GlobalContext with fuse_add" in reason and "attn_layer='gc'" in reason


def test_evonorm_moves_nothing_between_positions() -> None:
    """Every EvoNorm in train mode: the output's change at one position, when only another position's input changes,
    is the change of the map's statistics alone, the same for every position of equal input (a channel op)."""
    g = torch.Generator().manual_seed(1)
    for cls in (EvoNorm2dB0, EvoNorm2dB1, EvoNorm2dB2, EvoNorm2dS0, EvoNorm2dS0a, EvoNorm2dS1, EvoNorm2dS1a,
                EvoNorm2dS2, EvoNorm2dS2a):  # fmt: skip
        norm = (cls(8, group_size=4) if "S" in cls.__name__ else cls(8)).train()
        x = torch.randn(2, 8, 4, 4, generator=g)
        x[:, :, 1, 1] = x[:, :, 2, 2]  # two positions with equal input
        moved = x.clone()
        moved[:, :, 0, 0] += 3.0
        out = norm(moved)
        assert_close(out[:, :, 1, 1], out[:, :, 2, 2], msg=cls.__name__)  # output a function of the own input + stats


def test_mlp_head_with_batchnorm_refuses_token_logits() -> None:
    """resnet50_mlp's head normalises by the pooled batch's statistics: token logits refuse, pooled schemes run."""
    model = tiny_edge(head="mlp")
    assert isinstance(model.head.norm, nn.BatchNorm2d)
    check_parity(tiny_edge(0.4, head="mlp"), "tl_align")
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="NormMlpClassifierHead with BatchNorm2d"):
        backbones.adapt(model, TokenLabeling(beta=0.5))(images, lm)


NEWLY_ACCEPTED = ("gc_efficientnetv2_rw_t", "test_efficientnet_evos", "regnetz_b16_evos", "regnetz_c16_evos",
                  "regnetz_d8_evos", "ese_vovnet39b_evos", "resnet61q",
                  "resnet50_mlp",
                  "repvgg_a0", "repvgg_a1", "repvgg_a2", "repvgg_b0", "repvgg_b1", "repvgg_b1g4", "repvgg_b2",
                  "repvgg_b2g4", "repvgg_b3", "repvgg_b3g4", "repvgg_d2se",
                  "mobileone_s0", "mobileone_s1", "mobileone_s2", "mobileone_s3", "mobileone_s4")  # fmt: skip


def test_newly_accepted_names() -> None:
    """Each name is accepted by exactly one family (meta device; "any", the NoAlign fallback, takes every model)."""
    for name in NEWLY_ACCEPTED:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        accepting = [f.name for f in backbones.FAMILIES if f.name != "any" and f.refusal(model) is None]
        assert len(accepting) == 1, (name, accepting)


# ---------------------------------------------------------------------------------------------- RepVGG, MobileOne
def _randomise_norms(model: nn.Module) -> nn.Module:
    """Random running statistics and affine norms: the fused kernel then weighs every branch differently (at init
    they are 0 and 1 with near-equal weights, which would hide a wrong fusion)."""
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.BatchNorm2d):
                c = mod.num_features
                # a train-mode forward moves the running statistics the fused kernels read; the parity checks run
                # the fast path, then the reference, on one model: with momentum 0 both see the same kernels
                mod.momentum = 0.0
                mod.running_mean.copy_(torch.randn(c, generator=g) * 0.1)
                mod.running_var.copy_(torch.rand(c, generator=g) * 2 + 0.2)
                mod.weight.copy_(torch.randn(c, generator=g))
                mod.bias.copy_(torch.randn(c, generator=g) * 0.1)
    return model


def tiny_repvgg(drop: float = 0.0) -> nn.Module:
    """A RepVGG as timm's configs build it: a strided rep stem, rep stages (a grouped one), SE in the last."""
    torch.manual_seed(0)
    cfg = ByoModelCfg(
        blocks=(ByoBlockCfg(type="rep", d=2, c=8, s=2, gs=0, br=1.0), ByoBlockCfg(type="rep", d=2, c=16, s=2, gs=4, br=1.0),
                ByoBlockCfg(type="rep", d=2, c=16, s=1, gs=0, br=1.0, attn_layer="se")),
        stem_type="rep", stem_pool="maxpool", stem_chs=8, num_features=0, downsample="conv1x1",
    )  # fmt: skip
    return _randomise_norms(ByobNet(cfg, num_classes=10, drop_path_rate=drop, drop_rate=0.1))


def tiny_mobileone() -> nn.Module:
    """A MobileOne as timm's configs build it: depthwise kxk blocks (several conv branches, a 1x1 scale branch,
    the identity) alternating with pointwise ones, SE at the end."""
    torch.manual_seed(0)
    one = partial(ByoBlockCfg, type="one", d=1, br=1.0)
    cfg = ByoModelCfg(
        blocks=[[one(c=8, s=2, gs=1, block_kwargs=dict(num_conv_branches=3)), one(c=16, s=2, gs=0, block_kwargs=dict(kernel_size=1, num_conv_branches=3))],
                [one(c=16, s=1, gs=1, block_kwargs=dict(num_conv_branches=2)), one(c=16, s=1, gs=0, block_kwargs=dict(kernel_size=1)),
                 one(c=16, s=1, gs=1, attn_layer="se"), one(c=24, s=1, gs=0, attn_layer="se", block_kwargs=dict(kernel_size=1))]],
        stem_type="one", stem_pool="maxpool", stem_chs=8, num_features=0, downsample="conv1x1",
    )  # fmt: skip
    return _randomise_norms(ByobNet(cfg, num_classes=10, drop_rate=0.1))


_REP = {"repvgg": tiny_repvgg, "mobileone": tiny_mobileone}


@pytest.mark.parametrize("kind", sorted(_REP))
def test_reparameterisable_blocks(kind: str) -> None:
    model = _REP[kind]()
    assert byobnet_refusal(model) is None
    for scheme in ("none", "tl_align", "tokens_aligned"):
        check_preservation(model, SCHEMES[scheme])
    for scheme in ("tl_align", "tl_last", "tokens_aligned", "tl_official"):
        check_parity(model, scheme)
    check_parity(model, "tokens_aligned", token_space=True)
    check_unmixed_is_one_hot(model, POOLED)


@pytest.mark.parametrize("kind", sorted(_REP))
def test_rep_fast_path_reads_the_statistics_the_reference_reads(kind: str) -> None:
    """In training the forward moves the running statistics the fused kernels read (momentum above 0): the fast
    path reads them where the reference does."""
    check_parity_moving_statistics(_REP[kind](), "tl_align")


@pytest.mark.parametrize("kind", sorted(_REP))
def test_reparameterised_model_has_the_same_targets(kind: str) -> None:
    """timm's own ``reparameterize`` (one plain conv per block) gives the targets the branches give: the fused kernel
    the adapter reads is the one timm writes (in eval mode the two models compute the same function)."""
    branches = _REP[kind]().eval()
    fused = copy.deepcopy(branches)
    for mod in fused.modules():
        if hasattr(mod, "reparameterize"):
            mod.reparameterize()
    assert not any(isinstance(mod, nn.BatchNorm2d) for blk in _blocks_of(fused) for mod in blk.modules())
    assert byobnet_refusal(fused) is None
    images, lm = cutmix_batch()
    for scheme in ("tl_align", "tokens_aligned"):
        a = backbones.adapt(branches, SCHEMES[scheme])(images, lm)
        b = backbones.adapt(fused, SCHEMES[scheme])(images, lm)
        assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
        assert_close(a.target, b.target, rtol=1e-5, atol=1e-5)
        assert (a.target - lm.image_targets()).abs().max() > 1e-3


def _blocks_of(model: nn.Module) -> list[nn.Module]:
    m: Any = model
    return [m.stem, *(blk for stage in m.stages for blk in stage.children())]


def test_rep_kernel_is_timms() -> None:
    """The kernel the adapter reads is what timm's ``_get_kernel_bias`` returns (grouped identity included)."""
    for model in (tiny_repvgg(), tiny_mobileone()):
        for blk in _blocks_of(model):
            assert_close(rep_kernel(blk), copy.deepcopy(blk)._get_kernel_bias()[0])  # type: ignore[operator]


def test_rep_drop_path_is_refused() -> None:
    """timm's experimental drop path around a RepVGG block's conv branches keeps the identity norm: refused."""
    why = byobnet_refusal(tiny_repvgg(drop=0.2))
    assert why is not None and "drop path" in why and "drop_path_rate=0" in why


def _two_fusions() -> nn.Module:
    """A MobileViT with two v1 blocks (16 and 24 channels), each with its fusion conv, on 8x8 and 4x4 maps."""
    torch.manual_seed(0)
    inverted = dict(bottle_in=True, linear_out=True)
    mobile = dict(transformer_dim=16, transformer_depth=1, patch_size=2)
    blocks = (ByoBlockCfg(type="bottle", d=1, c=8, s=2, gs=1, br=2.0, block_kwargs=inverted),
              (ByoBlockCfg(type="bottle", d=1, c=16, s=2, gs=1, br=2.0, block_kwargs=inverted),
               ByoBlockCfg(type="mobilevit", d=1, c=16, s=1, block_kwargs=mobile)),
              (ByoBlockCfg(type="bottle", d=1, c=24, s=2, gs=1, br=2.0, block_kwargs=inverted),
               ByoBlockCfg(type="mobilevit", d=1, c=24, s=1, block_kwargs=mobile)))
    cfg = ByoModelCfg(blocks=blocks, stem_chs=8, stem_type="3x3", stem_pool="", downsample="", act_layer="silu",
                      num_features=32)
    return sharpen(ByobNet(cfg, num_classes=10))


def test_fusion_kernels_are_read_once_a_forward_and_only_for_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where every operator is a launch, the forward reads both v1 blocks' fusion kernels (four halves) in the one
    ``label_kernels`` call that reads its convs' (``_forward_kernels``), and its labels equal the reference's and the
    CPU route's (which reads each block's own, and each conv block's); a scheme that tracks no labels (NoAlign) reads
    no fusion kernel at all."""
    from test_backbones_common import _fast_and_reference

    from mixlabels import NoAlign
    from mixlabels.backbones import _convnet
    from mixlabels.backbones._common import launch_routes
    from mixlabels.backbones.families import byobnet

    calls: list[list[tuple[int, ...]]] = []
    original = _convnet.label_kernels
    monkeypatch.setattr(_convnet, "label_kernels", lambda ws: calls.append([tuple(w.shape) for w in ws]) or original(ws))
    monkeypatch.setattr(byobnet, "label_kernels", lambda ws: pytest.fail("fusion halves read apart"))
    model = _two_fusions()
    halves = sorted(tuple(half.shape) for blk in byobnet._blocks(model) if type(blk) is byobnet.MobileVitBlock
                    for half in byobnet._fusion_halves(blk))
    with launch_routes():
        fast, _, _ = _fast_and_reference(copy.deepcopy(model), copy.deepcopy(model), "tl_align")
    assert len(calls) == 1 and len(halves) == 4, calls  # the forward's one read, the halves among its weights
    assert all(calls[0].count(h) >= halves.count(h) for h in halves) and len(calls[0]) > 4, calls
    images, lm = cutmix_batch()
    torch.manual_seed(11)
    calls.clear()
    cpu = backbones.adapt(copy.deepcopy(model).train(), TLAlign())(images, lm)
    assert all(len(c) == 1 for c in calls), calls  # the CPU's route: each conv's own path, no fusion half among them
    assert_close(cpu.target, fast.target, rtol=1e-6, atol=1e-7)

    def refuse(*_: object) -> None:
        raise AssertionError("a fusion kernel read for a scheme that tracks no labels")

    monkeypatch.setattr(byobnet, "label_kernels", refuse)
    monkeypatch.setattr(byobnet, "_fusion_kernels", refuse)
    for routes in (launch_routes(), contextlib.nullcontext()):
        with routes:
            out = backbones.adapt(copy.deepcopy(model), NoAlign())(images, lm)
        assert_close(out.target.sum(-1), torch.ones(len(images)))
