"""Every family's targets are bit-identical to those recorded before the round-3 move.

Issue 30 moved every family into its own declaring file (``backbones/families/``) and
reorganised the shared machinery. A move must not change one bit of what a user trains on:
this test runs every registered family's example, with every scheme it supports, on the fast
path and on the reference path, in training mode on a fixed CutMix-like batch, and compares the
SHA-256 of the targets' bytes (and of the logits, which a move must not change either) with
``tests/data/targets_digest.json``, written by ``python tests/test_targets_unchanged.py --write``
at commit ``762a84e`` (torch 2.14.1, timm 1.0.31, this project's CPU, 2 intra-op threads) before the move.

Rewritten (every family, the families added since included) when issue 28 cut the label path's operators:
label kernels reduced together, runs of convs in one layout, ``torch.lerp`` for the residual's mean, a
parallel's sum by ``add(alpha=)``. That changes rounding only: 94 fast-path pairs moved, by at most 1.8e-7
in any target or token target (1.5 units in the last place near 1), no logits, no reference pair; compared
tensor by tensor against ``b47a302``.

Rewritten again for the next cuts (joins by ``lerp``: a parallel's sum and ``Rules.join``; a small grid's tap
matrices built together; a stem's and EfficientFormerV2's label kernels read together): 22 fast-path pairs of
11 families moved, by at most 9e-8, no logits, no reference pair; compared tensor by tensor against ``9c31220``.

Rewritten when the label kernels of several shapes were averaged by a mean per shape instead of ``segment_reduce``
(whose CUDA kernel reduces a segment in one thread): 66 fast-path pairs of 22 families moved, by at most 1.8e-7,
no logits; compared tensor by tensor against ``a7b3c71``.

Rewritten for session 37's cuts (windows averaged by pooling, tap weights of many convs computed together,
renormalisation left out after row-keeping merges, a CNN's label kernels read after its whole forward): 132
fast-path pairs of 52 families moved, by at most 1.2e-7 in any target or token target, no logits, no reference
pair; compared tensor by tensor against ``ca630b8``.

Rewritten for session 38's FocalNet cut (its levels weighed by the gates in the grid layout, by ``addcmul``):
2 fast-path pairs of FocalNet moved, by at most 6e-8, no logits, no reference pair; compared tensor by tensor
against ``c16d41d`` (Res2Net's walk no longer repeating its groups, and EfficientViT's leaner linear attention
labels, left every bit as it was).

Rewritten for session 42's EfficientViT (MSRA) cut (its depthwise convs' label kernels computed together and
applied by ``apply_path``): 2 fast-path pairs of that family moved, by at most 6e-8, no logits, no reference pair;
compared tensor by tensor against ``63de25d`` (its cascade's leaner label products left every bit as it was).

Rewritten for session 42's PVT v2 cut (its MLP depthwise convs' label kernels computed together and applied by
``apply_path``): 2 fast-path pairs of that family moved, by at most 6e-8, no logits, no reference pair; compared
tensor by tensor against ``6074d10`` (the same cut for DaViT, MViTv2, MetaFormer and FastViT left every bit as it was).

Rewritten for session 43's joins without renormalisation (``LabelTracker.join(normalised=True)``: a partial
shortcut's and a cross-stage part's rows already sum to 1): 5 fast-path pairs of ReXNet and CSPNet moved, by at most
1.2e-7, no logits, no reference pair; compared tensor by tensor against ``eb50881`` (small grids' conv matrices built
once per forward, ``Kernels.matrix``, left every bit as it was).

Rewritten for session 43's Hiera cut (a stage transition's merge by the mean of the pooled tokens' labels instead of
their renormalised sum; the unroll, a permutation, not renormalised): 3 fast-path pairs of Hiera moved, by at most
6e-8, no logits, no reference pair; compared tensor by tensor against ``eb50881`` (the batched MLP-Mixer, gMLP and
ResMLP mixes left every bit as it was).

A digest is exact: another torch or timm version, or another CPU's kernels, may change the last
bit of a float, and then this test fails although nothing is wrong. It says so, and the fix is
to rewrite the digest from the commit before the change under test on that machine
(``git stash; python tests/test_targets_unchanged.py --write; git stash pop``).

One digest per CPU vendor (``machines``, keyed by ``/proc/cpuinfo``'s ``vendor_id``): held to the same instruction
set, an Intel and an AMD CPU still compute other bits (MKL and oneDNN dispatch by vendor too, presumably), and session 53's Intel Xeon
computed other bits than the AMD EPYC that wrote the digest for 572 of its 610 pairs at ``489f389``, NoAlign's logits
included, with nothing changed. ``--write`` records this machine's vendor and keeps the others'; a change that moves
bits on purpose rewrites the vendors it can, and a vendor without a digest fails with how to record one.

The kernels: the digests are computed in a child process held to AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``, and
oneDNN's and MKL's instruction sets to match, ``KERNEL_ENV``), so an AVX-512 machine computes the bits an AVX2 one
does. Session 44 met such a machine: computed with its own kernels, 412 of the pairs differed from the digest
written on the earlier AVX2 machines, by rounding, while nothing had changed; held to AVX2, every pair matched. A
machine without AVX2 cannot compute these bits, and the test says so.

Rewritten for session 44's stem fix (a CNN whose stem keeps the pixel grid, VGG's stride-1 first conv, had that
conv's label rule left out on both paths, which took ``start == grid`` for a token-space map; and DarkNet's): 26
pairs moved, compared tensor by tensor against ``20db8aa`` under AVX2 kernels. By the fix, on both paths alike: vgg
(targets by up to 2.0e-3, token targets 3.3e-3) and cspnet (6.7e-3, token targets 4.6e-2). By rounding, fast path
only (a stem's ops after its windows now join the first run of units, their kernels read with the forward's):
hgnet, resnest, tresnet, vovnet, xception_aligned, by at most 6e-8. No logits.

Rewritten for session 48's folded label convs (a CPU walk's labels copied position-major once, then each depthwise
label conv and pool over the whole batch's labels as one channels-last map, ``backbones._windows.folded``): 8
fast-path pairs of cspnet, ghostnet, mobilenetv3 and repghost moved (the example batch is two samples, and these
examples' first grids are the only ones over ``_DENSE_CONV_TOKENS``), by at most 6e-8, no logits, no reference pair;
compared tensor by tensor against ``910faee`` under AVX2 kernels (``tests/test_fold.py`` holds the folded walk at
64 px, where 29 families fold, against the unfolded walk and the reference path).

Rewritten for session 51's CrossViT start (the labels start on both branches' windows at once, weighed from the mask
by ``window_weights``, not on a per-pixel label map aggregated by each branch's matrices): 3 fast-path pairs of
crossvit moved (TransMix's target, both TokenLabeling token targets), by at most 6e-8, no logits, no reference pair;
compared tensor by tensor against ``5bcb0d0``.

Split into ``SHARDS`` tests (every third family each, one child process each) in session 57: one child for all the
families was the suite's longest test (120-150 s on 2 cores). The same digest: a family's pairs compute the same bits
in a process of its own shard as in one of every family (each example seeds its own weights: ``backbones._family.tiny``).

Rewritten for session 72's start after a first unit's windows (``backbones._convnet.windows_into_stem``: a stem of
windows alone followed by a unit without shortcut that starts with windows, the labels weighed from the mask under
the whole chain at once, on the smaller grid): 9 fast-path pairs of mobilenetv4, selecsls, starnet and tv_mobilenet
moved, by at most 6e-8 in any target or token target, no logits, no reference pair; compared tensor by tensor
against ``2582980`` under AVX2 kernels, on an Intel CPU. No AMD CPU was at hand to recompute its digest: those 9
pairs were dropped from the AMD one (its other 601 pairs are unchanged), so an AMD machine checks them no more until
it rewrites its digest.

Rewritten for session 73's tap weights by the axes' products (``backbones._common.tap_weights``: on the CPU's eager
route a label conv's in-grid tap weight is ``R K C^T``, two small products, not a convolution of ones): 20 fast-path
pairs of cspnet, efficientvit_mit, nfnet, repghost, resnet, rexnet, vitamin and xception_aligned moved, by at most
1.2e-7 in any target or token target, no logits, no reference pair; compared tensor by tensor against ``2af93a4``
under AVX2 kernels, on an Intel CPU. Those 20 pairs were dropped from the AMD digest too (581 pairs left).

Rewritten for session 73's fused joins on a CPU's small grids (``backbones._joins.fused_join_route``: up to 28x28, one
grouped conv a join, the residual's mean folded into its shares, where the walk took a conv a branch and a ``lerp``
each): 2 fast-path pairs of inception_next moved, by at most 6e-8, no logits, no reference pair; compared tensor by
tensor against ``2052b87`` under AVX2 kernels, on an Intel CPU; dropped from the AMD digest (579 pairs left).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch

from mixlabels import TokenLabelMap
from mixlabels import backbones
from mixlabels.backbones._matrix import SCHEMES

DIGEST = Path(__file__).parent / "data" / "targets_digest.json"
VERSIONS = {"torch": torch.__version__, "timm": timm.__version__}


def _batch() -> tuple[torch.Tensor, TokenLabelMap]:
    g = torch.Generator().manual_seed(0)
    images = torch.randn(2, 3, 32, 32, generator=g)
    mask = torch.ones(2, 32, 32)
    mask[0, 4:20, 6:26] = 0.0  # boxes cutting through patches, a different one per sample
    mask[1, 10:30, 0:13] = 0.0
    lm = TokenLabelMap.from_mask(mask, torch.tensor([1, 0]), torch.tensor([3, 7]), num_classes=10)
    return lm.mix_pixels(images), lm


def _sha(t: torch.Tensor | None) -> str | None:
    if t is None:
        return None
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()[:24]


THREADS = 2  # the digest's intra-op thread count: another count sums in another order (and an earlier test,
# an in-process ablation run, may have set one)


SHARDS = 3  # the families are digested in this many child processes, one test each, that xdist spreads over its
# workers (one process for all took 120-150 s, the suite's longest test, often its last)


def shard(index: int | None) -> list[backbones.Family]:
    """The families of shard ``index`` (every ``SHARDS``-th, from ``index``); every family for ``None``."""
    return list(backbones.FAMILIES) if index is None else list(backbones.FAMILIES)[index::SHARDS]


def digests(index: int | None = None) -> dict[str, dict[str, str | None]]:
    """``{"family/scheme/path": {"target": sha, "token_target": sha, "logits": sha}}`` for every supported pair of
    shard ``index``'s families (every family for ``None``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return _digests(shard(index))
    finally:
        torch.set_num_threads(before)


def _digests(families: list[backbones.Family]) -> dict[str, dict[str, str | None]]:
    images, lm = _batch()
    out: dict[str, dict[str, str | None]] = {}
    for family in families:
        for scheme_name, scheme in SCHEMES.items():
            for reference in (False, True):
                model = family.example().train()
                try:
                    adapted = backbones.adapt(model, scheme, reference=reference)
                    torch.manual_seed(0)  # drop path and dropout draw the same in every run
                    res = adapted(images, lm)
                except (TypeError, ValueError):
                    continue  # a refused pair: test_matrix holds its message
                out[f"{family.name}/{scheme_name}/{'reference' if reference else 'fast'}"] = {
                    "target": _sha(res.target),
                    "token_target": _sha(res.token_target),
                    "logits": _sha(res.logits),
                }
    return out


KERNEL_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
"""The kernels the digests are computed with, whatever the machine offers above them (set before torch loads)."""


def digests_on_avx2(index: int | None = None) -> dict[str, dict[str, str | None]]:
    """``digests(index)`` computed in a child process held to ``KERNEL_ENV``'s kernels."""
    env = {**os.environ, **KERNEL_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    args = ["--print"] if index is None else ["--print", str(index)]
    run = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        raise RuntimeError(f"computing the digests in a child process failed:\n{run.stderr[-4000:]}")
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if out["capability"] != "AVX2":
        pytest.fail(
            f"this CPU runs torch's {out['capability']} kernels, not AVX2: the digest's bits are those of AVX2 "
            "kernels, which this machine cannot compute; run the test on an x86 CPU with AVX2"
        )
    return out["digests"]  # type: ignore[no-any-return]


def cpu_vendor() -> str:
    """The CPU's vendor (``/proc/cpuinfo``'s ``vendor_id``: ``GenuineIntel``, ``AuthenticAMD``), else the platform's
    processor name, else ``unknown``: the key of this machine's digest."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@pytest.mark.parametrize("index", range(SHARDS))
def test_targets_bit_identical_to_the_recorded_digest(index: int) -> None:
    recorded = json.loads(DIGEST.read_text())
    if recorded["versions"] != VERSIONS:
        pytest.fail(
            f"the digest was written with {recorded['versions']}, this run has {VERSIONS}: a digest is exact only "
            "on the versions (and CPU) that wrote it; rewrite it from the commit before your change "
            "(python tests/test_targets_unchanged.py --write)"
        )
    vendor = cpu_vendor()
    if vendor not in recorded["machines"]:
        pytest.fail(
            f"no digest for a {vendor} CPU (recorded: {', '.join(recorded['machines'])}): its kernels compute other bits; "
            "record one from the commit before your change (git stash; python tests/test_targets_unchanged.py "
            "--write; git stash pop)"
        )
    names = {family.name for family in shard(index)}
    mine = {key: value for key, value in recorded["machines"][vendor].items() if key.split("/")[0] in names}
    assert mine, f"the digest holds no pair of shard {index}'s families {sorted(names)}"
    now = digests_on_avx2(index)
    lost = sorted(set(mine) - set(now))
    assert not lost, f"family/scheme pairs supported before no longer run: {lost}"
    # a family added after the digest has no lines in it (its own tests hold its targets)
    changed = [key for key in mine if now[key] != mine[key]]
    assert not changed, f"targets or logits changed bits on {len(changed)} pairs ({vendor} CPU): {changed[:10]}"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--print"]:  # the child process of digests_on_avx2 (of one shard): one JSON line
        index = int(sys.argv[2]) if sys.argv[2:] else None
        print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "digests": digests(index)}))
        sys.exit(0)
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_targets_unchanged.py --write")
    earlier = json.loads(DIGEST.read_text()) if DIGEST.exists() else {}
    machines = earlier.get("machines", {}) if earlier.get("versions") == VERSIONS else {}  # other versions: stale
    machines[cpu_vendor()] = digests_on_avx2()
    DIGEST.write_text(json.dumps({"versions": VERSIONS, "machines": machines}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {DIGEST} for a {cpu_vendor()} CPU (digests of {', '.join(sorted(machines))})")
