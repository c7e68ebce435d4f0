"""Token fluctuation analysis: Eq. 2 presence, Eq. 13 similarity ratio, RMSE, scheme parity, the picture command."""

from __future__ import annotations

import json
import math
import runpy
import sys
from pathlib import Path
from typing import Any

import pytest
import timm
import torch
from torch.testing import assert_close

from mixlabels import backbones
from mixlabels import TLAlign, TokenLabelMap, TransMix
from mixlabels.analysis import (
    analyse,
    layer_presence,
    similarity_ratio,
    token_presence,
    trace_vit,
)

REPO = Path(__file__).resolve().parents[1]
CIFAR = REPO.parent / "shared" / "data" / "cifar10-jpg.tar.gz"
B, IMG, PATCH, DIM, HEADS, DEPTH, C = 4, 32, 8, 32, 2, 3, 10


def make_model(sharpen: float = 1.0, seed: int = 0, **kwargs: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=IMG, patch_size=PATCH, embed_dim=DIM, depth=DEPTH,
        num_heads=HEADS, num_classes=C, **kwargs,
    )
    if sharpen != 1.0:
        # Random-init attention is almost uniform: sharpen it so alignment moves labels.
        with torch.no_grad():
            for blk in model.blocks:
                blk.attn.qkv.weight[: 2 * DIM] *= sharpen
    return model


def cutmix_map(partner: torch.Tensor | None = None, token_space: bool = False) -> tuple[torch.Tensor, TokenLabelMap]:
    g = torch.Generator().manual_seed(1)
    images = torch.randn(B, 3, IMG, IMG, generator=g)
    mask = torch.ones(B, IMG, IMG)
    mask[:, 5:21, 3:30] = 0.0  # a box cutting through patches
    partner = torch.arange(B).flip(0) if partner is None else partner
    lm = TokenLabelMap.from_mask(mask, partner, torch.arange(B), num_classes=C, token_space=token_space)
    return images, lm


# ---------------------------------------------------------------------- Eq. 2 / Eq. 3
def conv_matrix(kernel: torch.Tensor, side: int, circular: bool, normalise_rows: bool) -> torch.Tensor:
    """A depth-wise convolution on a side x side token grid as a (n_out, n_in) matrix."""
    r = kernel.shape[0] // 2
    w = torch.zeros(side * side, side * side)
    for y in range(side):
        for x in range(side):
            for dy in range(-r, r + 1):
                for dx in range(-r, r + 1):
                    yy, xx = y + dy, x + dx
                    if circular:
                        yy, xx = yy % side, xx % side
                    elif not (0 <= yy < side and 0 <= xx < side):
                        continue  # zero padding
                    w[y * side + x, yy * side + xx] += kernel[dy + r, dx + r]
    if normalise_rows:  # attention-like: every token attends to the neighbours it has
        w = w / w.sum(dim=1, keepdim=True)
    return w


@pytest.mark.parametrize("normalise_rows", [False, True])
def test_convolution_presence_is_one_for_interior_tokens(normalise_rows: bool) -> None:
    # Eq. 3: for a non-strided depth-wise convolution, row and column sums of |W| both equal
    # sum |K| away from the edge, so p(z_i) = 1. "Away from the edge" with zero padding means
    # every output that z_i feeds has its full kernel: distance >= 2r from the border.
    g = torch.Generator().manual_seed(0)
    kernel = torch.rand(3, 3, generator=g) + 0.1
    if not normalise_rows:
        kernel = kernel * torch.tensor([[1.0, -1.0, 1.0], [-1.0, 1.0, 1.0], [1.0, 1.0, -1.0]])  # |.| in Eq. 2
    side, r = 7, 1
    p = token_presence(conv_matrix(kernel, side, circular=False, normalise_rows=normalise_rows)).reshape(side, side)
    interior = p[2 * r : side - 2 * r, 2 * r : side - 2 * r]
    assert_close(interior, torch.ones_like(interior))
    assert (p - 1).abs().max() > 1e-3  # edge tokens fluctuate
    circ = token_presence(conv_matrix(kernel, side, circular=True, normalise_rows=normalise_rows))
    assert_close(circ, torch.ones_like(circ))  # no edge at all: every token keeps presence 1


def test_presence_redistributes_and_matches_head_mean() -> None:
    model = make_model(sharpen=8.0)
    images, _ = cutmix_map()
    trace = trace_vit(model, images)
    n = trace.attention.shape[-1]
    presence = layer_presence(trace)  # b l n
    assert_close(presence.sum(-1), torch.full(presence.shape[:2], float(n)))
    assert presence.amax() > 1.3 and presence.amin() < 0.7  # peaked attention: tokens fluctuate
    assert_close(layer_presence(trace, residual=True), (1 + presence) / 2)
    # Per-head rows sum to 1, so the presence of the head mean is the mean of per-head presences.
    heads = torch.softmax(torch.randn(2, 3, 5, 5), dim=-1)
    assert_close(token_presence(heads.mean(1)), token_presence(heads).mean(1))


# ---------------------------------------------------------------------- Eq. 13
def test_identical_sources_give_similarity_ratio_one_half() -> None:
    z = torch.randn(3, 6, 8)
    assert_close(similarity_ratio(z, torch.stack([z, z], dim=1)), torch.full((3, 6, 2), 0.5))
    # Through a model: every sample mixed with itself.
    images, lm = cutmix_map(partner=torch.arange(B))
    sim = analyse(make_model(sharpen=8.0), images, lm).ratios.similarity
    assert sim is not None
    assert_close(sim, torch.full_like(sim, 0.5))


def test_similarity_ratio_prefers_the_source_a_token_came_from() -> None:
    z1, z2 = torch.randn(6, 8), torch.randn(6, 8)
    ratio = similarity_ratio(z1[:3], torch.stack([z1, z2]))
    assert (ratio[:, 0] > 0.5).all()
    assert_close(ratio.sum(-1), torch.ones(3))


# ---------------------------------------------------------------------- RMSE and parity
def test_rmse_zero_for_uniform_masks_and_positive_for_cutmix() -> None:
    model = make_model(sharpen=8.0)
    images = torch.randn(B, 3, IMG, IMG, generator=torch.Generator().manual_seed(2))
    lam = torch.tensor([0.3, 0.5, 0.7, 0.9])
    mixup = TokenLabelMap.from_mask(lam.view(B, 1, 1), torch.arange(B).flip(0), torch.arange(B), num_classes=C,
                                    image_size=(IMG, IMG))
    a = analyse(model, images, mixup, similarity=False)
    assert float(a.rmse) < 1e-6  # labels are lambda everywhere: attention keeps them
    assert_close(a.ratios.tl_align[..., 0], lam.view(B, 1, 1).expand_as(a.ratios.tl_align[..., 0]))
    images, lm = cutmix_map()
    assert float(analyse(model, images, lm, similarity=False).rmse) > 1e-2


@pytest.mark.parametrize("kwargs", [{}, {"class_token": False, "global_pool": "avg"}, {"reg_tokens": 2}])
def test_targets_match_the_adapter(kwargs: dict[str, Any]) -> None:
    model = make_model(sharpen=8.0, **kwargs)
    images, lm = cutmix_map()
    fused = [blk.attn.fused_attn for blk in model.blocks]
    model.train()
    a = analyse(model, images, lm)
    assert model.training and [blk.attn.fused_attn for blk in model.blocks] == fused  # restored
    model.eval()
    mixed = lm.mix_pixels(images)
    out = backbones.adapt(model, TLAlign())(mixed, lm)
    assert_close(a.tl_align_target, out.weights)
    assert_close(a.cutmix_target, lm.image_weights)
    m: Any = model
    assert_close(m.forward_head(m.norm(a.mixed.tokens[:, -1])), model(mixed))  # trace = timm's forward
    if m.global_pool == "token":
        assert a.transmix_target is not None
        assert_close(a.transmix_target, backbones.adapt(model, TransMix())(mixed, lm).weights)
    # An adapter is accepted in place of the model.
    assert_close(analyse(backbones.adapt(model, TLAlign()), images, lm, similarity=False).tl_align_target, out.weights)


def test_token_space_map_matches_the_adapter() -> None:
    model = make_model(sharpen=8.0).eval()
    images, lm = cutmix_map(token_space=True)
    a = analyse(model, images, lm, similarity=False)
    assert_close(a.tl_align_target, backbones.adapt(model, TLAlign())(images, lm).weights)


# ---------------------------------------------------------------------- the command
TINY = [
    "--data", str(CIFAR), "--model", "vit_tiny_patch16_224", "--img-size", "32", "--patch-size", "8",
    "--embed-dim", "32", "--depth", "2", "--num-heads", "2", "--batch-size", "2", "--pairs", "1",
    "--sizes", "tiny", "--size-img", "16", "--size-patch", "8", "--size-depth", "2",
]


def _finite(value: Any) -> bool:
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return not isinstance(value, float) or math.isfinite(value)


def _check_outputs(out: Path) -> dict[str, Any]:
    for name in ("label_maps.png", "mixing_ratio.png", "rmse_by_size.png"):
        assert (out / name).stat().st_size > 10_000, name
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    numbers: dict[str, Any] = json.loads((out / "analysis.json").read_text())
    assert _finite(numbers)
    assert len(numbers["per_block_sample0"]["class_token"]["similarity"]) == 2
    return numbers


@pytest.mark.skipif(not CIFAR.is_file(), reason="needs ../shared/data/cifar10-jpg.tar.gz")
def test_command_runs_as_a_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `python benchmarks/alignment_analysis.py ...` from the repo root, in this process (a fresh
    # interpreter would spend most of the test importing torch).
    out = tmp_path / "script"
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["benchmarks/alignment_analysis.py", *TINY, "--out", str(out)])
    runpy.run_path("benchmarks/alignment_analysis.py", run_name="__main__")
    numbers = _check_outputs(out)
    assert "RANDOM INIT" in numbers["initialisation"]


@pytest.mark.skipif(not CIFAR.is_file(), reason="needs ../shared/data/cifar10-jpg.tar.gz")
def test_command_on_a_checkpoint(tmp_path: Path) -> None:
    from benchmarks.alignment_analysis import main

    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
        num_classes=C,
    )
    ckpt = tmp_path / "model.pt"
    torch.save({"model": model.state_dict()}, ckpt)
    args = list(TINY)
    for flag in ("--img-size", "--patch-size", "--embed-dim", "--depth"):  # read from the checkpoint instead
        i = args.index(flag)
        del args[i : i + 2]
    numbers = main([*args, "--sizes", "", "--checkpoint", str(ckpt), "--out", str(tmp_path / "ckpt")])
    _check_outputs(tmp_path / "ckpt")
    assert numbers["model"]["img_size"] == 32 and numbers["model"]["depth"] == 2
    assert "checkpoint model.pt" in numbers["initialisation"]


@pytest.mark.skipif(not CIFAR.is_file(), reason="needs ../shared/data/cifar10-jpg.tar.gz")
def test_ablation_checkpoints_by_size(tmp_path: Path) -> None:
    # the layout of `ablation.py --save-checkpoints`: <out>/checkpoints/<key>.pth and <out>/runs/<key>.json,
    # whose num_heads a state dict cannot tell (4 heads of width 8, not embed_dim // 64)
    from benchmarks.alignment_analysis import main

    paths = []
    for dim, heads in ((48, 6), (32, 4)):
        out = tmp_path / f"d{dim}"
        model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=dim,
                                  depth=2, num_heads=heads, num_classes=C)
        (out / "checkpoints").mkdir(parents=True)
        (out / "runs").mkdir()
        torch.save(model.state_dict(), out / "checkpoints" / "abc123.pth")
        (out / "runs" / "abc123.json").write_text(json.dumps({"run": {"model": {"num_heads": heads}}}))
        paths.append(out / "checkpoints" / "abc123.pth")
    args = [a for a in TINY if a not in ("--sizes", "tiny")]
    numbers = main([*args, "--size-checkpoints", ",".join(map(str, paths)), "--out", str(tmp_path / "fig")])
    _check_outputs(tmp_path / "fig")
    sized = [b for b in numbers["rmse_by_size"] if b["kind"] == "size"]
    assert [(b["embed_dim"], b["num_heads"]) for b in sized] == [(32, 4), (48, 6)]  # narrowest first, heads read
    assert all(0.0 <= b["rmse"] < 1.0 for b in sized) and sized[0]["checkpoint"] == str(paths[1])
    with pytest.raises(SystemExit, match="no checkpoint at"):
        main([*args, "--size-checkpoints", str(tmp_path / "missing.pth"), "--out", str(tmp_path / "x")])
