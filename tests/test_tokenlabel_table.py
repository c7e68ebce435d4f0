"""The ablation's token-labeling table: rows and keys, crops reported by the loader, the annotator's maps per batch.

The end-to-end test trains a 2-block DeiT teacher for 2 steps on 64 CIFAR-10
images, scores them, and trains the four rows for 2 steps each: the pipeline,
not the accuracy, is tested (see test_ablation.py for the data cache).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks import ablation
from benchmarks._archive import NAMED, TensorSplit, default_data_root
from benchmarks._ablation_config import run_key
from benchmarks._data import Shard, TensorBatches
from benchmarks._token_labels import TokenLabelSource, annotate_split
from mixlabels import TokenLabelMap, TokenLabelingConfig
from mixlabels.score_maps import ScoreMapError, ScoreMaps, ScoreMapWriter, compress, crop_resize
from mixlabels.strategies import CutMixConfig, MixTokenConfig

CIFAR = default_data_root() / NAMED["cifar10"]
needs_cifar = pytest.mark.skipif(not CIFAR.is_file(), reason=f"the CIFAR-10 archive is not at {CIFAR} (../shared/data)")

TINY = ["--subset", "64", "--test-subset", "64", "--batch-size", "16", "--max-steps", "2", "--eval-batch-size", "64",
        "--embed-dim", "16", "--depth", "2", "--heads", "2", "--quiet", "--threads", "1"]
CPU = Shard(rank=0, world=1, device=torch.device("cpu"))


def _split(n: int = 24, side: int = 8, seed: int = 0) -> TensorSplit:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, side, side, 3), generator=g, dtype=torch.uint8)
    return TensorSplit(images=images, labels=torch.arange(n) % 3, classes=("a", "b", "c"))


# ---------------------------------------------------------------------------------------------- rows


def test_rows_and_run_keys() -> None:
    cfg, dry = ablation.resolve_config(["--table", "tokenlabel", "--dry-run"])
    assert dry and cfg.table == "tokenlabel"
    planned = ablation.plan(cfg, 10, "cpu")
    assert [p.cell.row for p in planned[::2]] == ["cutmix", "mixtoken", "mixtoken+mask-labels", "mixtoken+annotator"]
    assert len(planned) == 8 and len({p.key for p in planned}) == 8
    by_row = {p.cell.row: p.run for p in planned if p.seed == 0}
    assert isinstance(by_row["cutmix"].mixer, CutMixConfig)
    assert all(isinstance(by_row[r].mixer, MixTokenConfig) for r in ("mixtoken", "mixtoken+mask-labels"))
    assert by_row["mixtoken"].mixer.patch_size == 4  # type: ignore[union-attr]  # one MixToken cell per token
    assert isinstance(by_row["mixtoken+mask-labels"].scheme, TokenLabelingConfig)
    assert [r for r, run in by_row.items() if run.annotator is not None] == ["mixtoken+annotator"]

    teacher = ablation.teacher_run(cfg, 10, "cpu")
    assert by_row["mixtoken+annotator"].annotator.teacher == run_key(teacher)  # type: ignore[union-attr]
    assert teacher.model.class_token is False and teacher.model.global_pool == "avg"
    assert teacher.recipe.epochs == 2 * cfg.recipe.epochs
    model = teacher.model.build(10)
    assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 10) and getattr(model, "num_prefix_tokens") == 0

    # another teacher gives the annotator row (only it) new keys: its maps are other maps
    longer, _ = ablation.resolve_config(["--table", "tokenlabel", "--teacher-epochs", "6"])
    keys = {p.cell.row: p.key for p in planned if p.seed == 0}
    keys_longer = {p.cell.row: p.key for p in ablation.plan(longer, 10, "cpu") if p.seed == 0}
    assert [r for r in keys if keys[r] != keys_longer[r]] == ["mixtoken+annotator"]


def test_bad_table_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        ablation.resolve_config(["--table", "9"])
    assert "7, 8 or tokenlabel" in capsys.readouterr().err


def test_folder_loader_is_refused(tmp_path: Path) -> None:
    cfg, _ = ablation.resolve_config(["--table", "tokenlabel", *TINY])
    planned = ablation.plan(cfg, 10, "cpu")
    data = ablation.Data(num_classes=10, make_train=lambda seed: None, test=None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="--loader tensor"):
        ablation.prepare_annotator(cfg, planned, data, CPU, tmp_path, progress=False, needed=True)


# -------------------------------------------------------------------------------------------- loader


def _old_augment(x: Tensor, gen: torch.Generator, p: int, hflip: float) -> Tensor:
    """The loader's augmentation as it was before it reported its crops (the reference for the draws)."""
    b, _, h, w = x.shape
    padded = F.pad(x, (p, p, p, p))
    dy = torch.randint(0, 2 * p + 1, (b, 1), generator=gen)
    dx = torch.randint(0, 2 * p + 1, (b, 1), generator=gen)
    rows = (dy + torch.arange(h)).view(b, 1, h, 1).expand(b, 3, h, w + 2 * p)
    cols = (dx + torch.arange(w)).view(b, 1, 1, w).expand(b, 3, h, w)
    x = padded.gather(2, rows).gather(3, cols)
    flip = (torch.rand(b, generator=gen) < hflip).view(b, 1, 1, 1)
    return torch.where(flip, x.flip(3), x)


def test_indexed_batches_report_their_crops() -> None:
    split = _split()
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    batches = TensorBatches(split, torch.arange(4, 24), 8, CPU, train=True, seed=3, mean=mean, std=std,
                            crop_padding=2, hflip=0.5)
    again = TensorBatches(split, torch.arange(4, 24), 8, CPU, train=True, seed=3, mean=mean, std=std,
                          crop_padding=2, hflip=0.5)
    old_gen = torch.Generator().manual_seed(3 * 1_000_003)
    m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    flipped = 0
    for (x, y, idx, crops), (x2, y2) in zip(batches.indexed_epoch(1), again.epoch(1), strict=True):
        raw = split.images[idx].permute(0, 3, 1, 2).float() / 255.0
        assert torch.equal(y, split.labels[idx]) and torch.equal(x, x2) and torch.equal(y, y2)
        # the reported crop and flip, applied to the raw images by RoIAlign, is the batch
        torch.testing.assert_close(x * s + m, crop_resize(raw, crops, (8, 8), padding="zeros"), atol=1e-5, rtol=0)
        # and the draws are the loader's original ones: same seed, same batches as before
        torch.testing.assert_close(x, (_old_augment(raw, old_gen, 2, 0.5) - m) / s, atol=0, rtol=0)
        assert crops.boxes[:, :2].abs().max() <= 2 and torch.equal(crops.boxes[:, 2:] - crops.boxes[:, :2],
                                                                   torch.full((len(idx), 2), 8.0))
        flipped += int(crops.flips.sum())
    assert 0 < flipped < 16  # both branches were exercised


# ------------------------------------------------------------------------------------------ annotator


class _Pooled(torch.nn.Module):
    """A stand-in teacher: 2x2 patches, per-token class scores from the mean pixel (timm's forward_features/head)."""

    num_prefix_tokens = 0

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(3, 3)

    def forward_features(self, x: Tensor) -> Tensor:
        return F.avg_pool2d(x, 2).flatten(2).transpose(1, 2)  # b (h w) 3

    def forward_head(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(x.mean(1))
        return out


def test_annotate_split_and_the_schemes_targets(tmp_path: Path) -> None:
    split = _split()
    teacher = _Pooled()
    subset = torch.tensor([3, 5, 8, 13, 21])
    kwargs: dict[str, Any] = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0), "k": 3, "meta": {"teacher": "t"},
                              "device": torch.device("cpu"), "batch_size": 2}
    store = annotate_split(teacher, split, subset, tmp_path / "maps", **kwargs)
    assert store.ids == tuple(f"train/{i}" for i in subset.tolist()) and store.map_size == (4, 4)
    assert annotate_split(teacher, split, subset, tmp_path / "maps", **kwargs).ids == store.ids  # resumed, done
    with pytest.raises(ScoreMapError, match="index.json"):  # another teacher's maps are not reused
        annotate_split(teacher, split, subset, tmp_path / "maps", **{**kwargs, "meta": {"teacher": "u"}})

    source = TokenLabelSource.open(store, len(split.labels), fill="renormalize", grid=(4, 4),
                                   device=torch.device("cpu"))
    batch = TensorBatches(split, subset, 5, CPU, train=False, seed=0, mean=(0.0,) * 3, std=(1.0,) * 3)
    x, y, idx, crops = next(batch.indexed_epoch(0))  # identity crops
    label_map = TokenLabelMap.unmixed(y, num_classes=3, image_size=(8, 8)).with_token_targets(source.targets(idx, crops))
    with torch.inference_mode():
        expected = torch.softmax(teacher.forward_head(teacher.forward_features(x).unsqueeze(2).flatten(0, 1)), -1)
    targets = label_map.mixed_token_targets((4, 4))  # b n c: the teacher's scores of each token (k = c = 3: exact)
    torch.testing.assert_close(targets, expected.view(5, 16, 3), atol=2e-3, rtol=0)  # fp16 storage

    with pytest.raises(ScoreMapError, match=r"no score map for split images \[0\]"):
        source.targets(torch.tensor([0, 3]), crops)


def test_foreign_ids_are_refused(tmp_path: Path) -> None:
    with ScoreMapWriter(tmp_path, num_classes=3, map_size=(2, 2), k=2) as w:
        w.append(["val/1"], compress(torch.softmax(torch.randn(1, 2, 2, 3), -1), k=2))
    with pytest.raises(ScoreMapError, match="'val/1' is not an image of this split"):
        TokenLabelSource.open(ScoreMaps(tmp_path), 10, fill="renormalize", grid=(2, 2),
                              device=torch.device("cpu"))


# ---------------------------------------------------------------------------------------- end to end


@needs_cifar
def test_end_to_end_teacher_maps_rows_and_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    original = TokenLabelSource.targets

    def counting(self: TokenLabelSource, indices: Tensor, crops: Any) -> Any:
        calls.append(len(indices))
        return original(self, indices, crops)

    monkeypatch.setattr(TokenLabelSource, "targets", counting)
    out = tmp_path / "out"
    cfg, _ = ablation.resolve_config(["--table", "tokenlabel", "--seeds", "0", "--save-checkpoints",
                                      "--out", str(out), *TINY])
    report = ablation.run_ablation(cfg)
    assert (report.trained, report.skipped) == (4, 0)
    assert calls == [16, 16]  # the annotator row's 2 steps, each with its batch's aligned maps; no other row

    teacher = ablation.planned_teacher(cfg, ablation.plan(cfg, 10, "cpu"), 10)
    store = ScoreMaps(out / "annotator" / f"score-maps-{teacher.key}-top5")
    assert len(store) == 64 and store.map_size == (8, 8) and store.meta["teacher"] == teacher.key
    state = torch.load(out / "annotator" / f"teacher-{teacher.key}.pth", weights_only=True)
    teacher.run.model.build(10).load_state_dict(state)
    for p in ablation.plan(cfg, 10, "cpu"):  # --save-checkpoints: every row's model, loadable
        p.run.model.build(10).load_state_dict(torch.load(out / "checkpoints" / f"{p.key}.pth", weights_only=True))

    table = (out / "table.md").read_text()
    assert table.count("\n| ") == 6 and "MixToken + token loss, annotator's token labels" in table
    assert "Annotator: deit_tiny_patch16_224 with global average pooling" in table and "bytes per image" in table
    results = json.loads((out / "results.json").read_text())
    assert results["annotator"]["key"] == teacher.key and results["annotator"]["score_maps"]["images"] == 64

    # a rerun trains nothing, not even the teacher, and rescoring is skipped
    mtime = (out / "runs" / f"{teacher.key}.json").stat().st_mtime_ns
    again = ablation.run_ablation(cfg)
    assert (again.trained, again.skipped) == (0, 4) and again.markdown == report.markdown
    assert (out / "runs" / f"{teacher.key}.json").stat().st_mtime_ns == mtime


@needs_cifar
def test_ddp_two_processes_teacher_and_annotator_row(tmp_path: Path) -> None:
    # rank 0 alone scores the images; both ranks train the teacher and read the maps (gloo on the CPU)
    import os
    import subprocess
    import sys

    from benchmarks._archive import REPO_ROOT

    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    tiny = [a for a in TINY if a not in ("--threads", "1")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO_ROOT / "benchmarks" / "ablation.py"), "--table", "tokenlabel", "--rows", "mixtoken+annotator",
           "--seeds", "0", "--out", str(out), *tiny]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("teacher (annotator): top-1") == 1 and proc.stdout.count("| Training |") == 1
    runs = [json.loads(p.read_text()) for p in (out / "runs").glob("*.json")]
    assert len(runs) == 2 and all(r["world"] == 2 and r["result"]["evaluated"] == 64 for r in runs)
    (store,) = (out / "annotator").glob("score-maps-*")
    assert len(ScoreMaps(store)) == 64 and not list(out.rglob("*.tmp*"))
