"""The full matrix: every mixer x every family x every scheme runs a training step, from the registry.

The families and their tiny example models come from ``backbones.FAMILIES`` and the
schemes from the support matrix's own list, so the README's table
(``python -m mixlabels.backbones.matrix``) and this test cannot drift apart.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from mixlabels import backbones
from mixlabels.backbones._matrix import SCHEMES, support_summary
from mixlabels.backbones.matrix import replace_section
from mixlabels.strategies import BlockwiseMix, CutMix, FMix, GridMix, MixToken, MixUp, RandomPatchMix, ResizeMix, SaliencyMix, Switch, TokenMix

REPO = Path(__file__).resolve().parent.parent
C = 10
FAMILY = {f.name: f for f in backbones.FAMILIES}
MIXERS: dict[str, Callable[[torch.Generator], Any]] = {
    "cutmix": lambda g: CutMix(C, generator=g),
    "mixup": lambda g: MixUp(C, generator=g),
    "random_patch": lambda g: RandomPatchMix(C, cell_size=8, generator=g),
    "blockwise": lambda g: BlockwiseMix(C, cell_size=8, min_cells=2, generator=g),
    "mixtoken": lambda g: MixToken(C, patch_size=8, generator=g),
    "switch": lambda g: Switch([MixUp(C), CutMix(C)], generator=g),
    "fmix": lambda g: FMix(C, generator=g),
    "resizemix": lambda g: ResizeMix(C, generator=g),
    "saliencymix": lambda g: SaliencyMix(C, generator=g),
    "gridmix": lambda g: GridMix(C, cell_sizes=(8, 16), generator=g),
    "tokenmix": lambda g: TokenMix(C, patch_size=8, min_tokens=2, generator=g),
}
# Pooled models have no class token whose attention TransMix could read: refused, with a clear error
# (a BEiT that pools by average has a class token, but its head does not read it: the error says so).
NO_CLASS_TOKEN_READ = r"no class token|the class token that the head reads"
POOLED_FAMILIES = [f.name for f in backbones.FAMILIES[:-1] if not f.class_token]  # each family declares it
REFUSED = {(f, "TransMix") for f in POOLED_FAMILIES}
# The "any" family (timm's test_byobnet here, dark blocks) takes NoAlign only; adapt refuses the rest, and MixToken
# needs a `patch_embed` the ByobNet lacks.
ANY_REFUSED = {("any", s) for s in SCHEMES if s != "NoAlign"}


@cache
def example(family: str) -> torch.nn.Module:
    return FAMILY[family].example()


def test_registry_families_are_disjoint() -> None:
    assert len(FAMILY) == len(backbones.FAMILIES) == len(backbones.SUPPORTED)  # names are unique
    assert backbones.FAMILIES[-1].name == "any"  # the fallback: every module, NoAlign only
    for name, family in FAMILY.items():
        model = example(name)
        assert [f.name for f in backbones.FAMILIES[:-1] if f.refusal(model) is None] == ([name] if name != "any" else [])
        assert backbones.FAMILIES[-1].refusal(model) is None
        assert type(backbones.adapt(model, SCHEMES["NoAlign"])) is family.build


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("family", list(FAMILY))
def test_training_step(family: str, scheme: str) -> None:
    """Every mixer's batch in turn through one adapter, as a training loop feeds it (one adapter, batch after batch).
    One test a family and scheme, not a mixer: as 4070 tests, pytest's own time (about 17 ms a test on 2 cores) was
    as long as the steps. A failure names its mixer (a note on the error)."""
    model = example(family)
    model.train()
    if (family, scheme) in ANY_REFUSED:
        with pytest.raises(TypeError, match="works for any classifier"):
            backbones.adapt(model, SCHEMES[scheme])
        return
    adapted = backbones.adapt(model, SCHEMES[scheme])
    for mixer in MIXERS:
        try:
            _step(model, adapted, family, scheme, mixer)
        except BaseException as e:
            e.add_note(f"mixer: {mixer} (family {family}, scheme {scheme})")
            raise


def _step(model: torch.nn.Module, adapted: torch.nn.Module, family: str, scheme: str, mixer: str) -> None:
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, C, (4,), generator=g)
    mixed, lm = MIXERS[mixer](g)(images, labels)
    if family == "any" and mixer == "mixtoken":
        with pytest.raises(ValueError, match="no `patch_embed`"):
            adapted(mixed, lm)
        return
    if family == "crossvit" and mixer == "mixtoken":  # two patch grids: one token-space map cannot mix both
        with pytest.raises(ValueError, match="CrossViT embeds the image twice"):
            adapted(mixed, lm)
        return
    if (family, scheme) in REFUSED:
        with pytest.raises(ValueError, match=NO_CLASS_TOKEN_READ):
            adapted(mixed, lm)
        return
    out = adapted(mixed, lm)
    for target in (out.target, out.token_target):
        if target is not None:
            assert target.shape[-1] == C and not target.requires_grad
            assert (target >= 0).all() and torch.allclose(target.sum(-1), torch.ones(target.shape[:-1]), atol=1e-5)
    assert (out.token_target is not None) == scheme.startswith("TokenLabeling")
    model.zero_grad(set_to_none=True)
    loss = out.loss()
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(gr).all() for gr in grads) and any(gr.abs().sum() > 0 for gr in grads)


def test_support_matrix_is_generated_from_the_registry() -> None:
    rows = backbones.support_matrix()
    assert [(r.family, r.scheme) for r in rows] == [(f, s) for f in FAMILY for s in SCHEMES]
    assert {(r.family, r.scheme) for r in rows if not r.supported} == REFUSED | ANY_REFUSED
    assert all(re.search(NO_CLASS_TOKEN_READ, r.reason) for r in rows if (r.family, r.scheme) in REFUSED)
    beit = next(r for r in rows if (r.family, r.scheme) == ("beit", "TransMix"))
    assert "global_pool='token'" in beit.reason and "has no class token" not in beit.reason  # it has one
    assert all("works for any classifier" in r.reason for r in rows if (r.family, r.scheme) in ANY_REFUSED)
    md = backbones.support_markdown(rows)
    for name, family in FAMILY.items():
        assert f"| {name} |" in md and family.description in md
    # the README's summary and docs/families.md are generated from these rows (support_matrix: 13 s, built once here)
    stale = "out of date: run python -m mixlabels.backbones.matrix --write README.md"
    readme = (REPO / "README.md").read_text()
    assert replace_section(readme, support_summary(rows)) == readme, f"README.md's support summary is {stale}"
    docs = (REPO / "docs" / "families.md").read_text()
    assert replace_section(docs, md) == docs, f"docs/families.md's support matrix is {stale}"


def test_support_matrix_of_named_families_is_their_rows_and_refuses_an_unknown_name() -> None:
    rows = backbones.support_matrix(["swin", "resnet"])
    assert [(r.family, r.scheme) for r in rows] == [(f, s) for f in FAMILY if f in ("swin", "resnet") for s in SCHEMES]
    assert {(r.family, r.scheme) for r in rows if not r.supported} == {("resnet", "TransMix"), ("swin", "TransMix")}
    with pytest.raises(ValueError, match="no registered family 'swim'; the families: beit, "):
        backbones.support_matrix(["swim"])
