"""The ablation benchmark end to end on a tiny CIFAR-10 subset: outputs, resume, DDP on CPU, configs, rows.

The end-to-end tests use the real archive (``../shared/data/cifar10-jpg.tar.gz``)
and its decoded cache (``$MIXLABELS_CACHE`` or ``~/.cache/mixlabels``; the first
use decodes the archive once, about 30 s). Runs are 2 optimizer steps of a
2-block, 16-wide DeiT on 64 images, so the pipeline, not the accuracy, is tested.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import ablation
from benchmarks._archive import NAMED, REPO_ROOT, default_data_root
from benchmarks._ablation_config import AblationConfig, DataConfig, ModelConfig, RecipeConfig, RunConfig, run_key
from benchmarks._data import _per_rank
from benchmarks._rows import ROW_IDS, paper_layers, table_cells
from mixlabels import NoAlignConfig, TLAlignConfig
from mixlabels.strategies import BlockwiseMixConfig, CutMixConfig, SwitchConfig

CIFAR = default_data_root() / NAMED["cifar10"]
needs_cifar = pytest.mark.skipif(not CIFAR.is_file(), reason=f"the CIFAR-10 archive is not at {CIFAR} (../shared/data)")

TINY = ["--subset", "64", "--test-subset", "64", "--batch-size", "16", "--max-steps", "2", "--eval-batch-size", "64",
        "--embed-dim", "16", "--depth", "2", "--heads", "2", "--quiet"]


def _run_files(out: Path) -> dict[str, float]:
    return {p.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*.json")}


# --------------------------------------------------------------------------------------------- rows


def test_paper_layers_scale_to_depth() -> None:
    assert paper_layers(12) == (1, 3, 5, 7)  # the paper's layers 2, 4, 6, 8, 0-based
    assert paper_layers(6) == (0, 1, 2, 3)
    assert paper_layers(2) == (0,)  # deduplicated, never below the first layer


def test_table8_rows() -> None:
    cells = table_cells(8, num_classes=10, label_smoothing=0.1, prob=1.0, patch_size=4, img_size=32, depth=6)
    assert tuple(c.row for c in cells) == ROW_IDS[8]
    assert all(isinstance(c.mixer, CutMixConfig) and c.flags.cutmix for c in cells)
    schemes = {c.row: c.scheme for c in cells}
    assert schemes["none"] == NoAlignConfig()
    assert schemes["layer-last"] == TLAlignConfig(layers=(5,))
    assert schemes["layers-2468"] == TLAlignConfig(layers=(0, 1, 2, 3))
    assert schemes["no-norm"] == TLAlignConfig(normalize=False)
    assert schemes["tl-align"] == TLAlignConfig()
    assert schemes["official-drop-path"] == TLAlignConfig(drop_path="official")
    assert [c.aligned for c in cells] == [False, True, True, True, True, True]
    labels = {c.row: c.label for c in table_cells(8, num_classes=10, label_smoothing=0.1, prob=1.0, patch_size=4,
                                                  img_size=32, depth=6, drop_path=0.1)}
    assert "drop-path 0.1" in labels["official-drop-path"]


def test_new_scheme_fields_enter_the_run_key_only_off_their_default() -> None:
    """A default TL-Align run keeps the key it had before ``drop_path`` and ``init`` existed: cached runs resume."""
    run = RunConfig(data=DataConfig(), model=ModelConfig(), recipe=RecipeConfig(), scheme=TLAlignConfig())
    dump = run.model_dump(mode="json")
    # the run's config as written before the fields existed
    del dump["scheme"]["drop_path"], dump["model"]["init"], dump["model"]["pretrained"]
    del dump["init_sha256"], dump["base"]
    before = hashlib.sha256(json.dumps(dump, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
    assert run_key(run) == before
    official = run.model_copy(update={"scheme": TLAlignConfig(drop_path="official")})
    assert run_key(official) != before


def test_table7_rows() -> None:
    cells = table_cells(7, num_classes=10, label_smoothing=0.1, prob=1.0, patch_size=4, img_size=32, depth=6)
    assert [(c.row, c.aligned) for c in cells] == [("none", False)] + [
        (row, aligned) for row in ROW_IDS[7][1:] for aligned in (False, True)
    ]
    by = {(c.row, c.aligned): c for c in cells}
    assert by[("none", False)].mixer is None
    assert isinstance(by[("mixup+cutmix", True)].mixer, SwitchConfig)
    block = by[("blockwise", True)].mixer
    assert isinstance(block, BlockwiseMixConfig) and block.cell_size == 4 and block.min_cells == 5  # 16/196 of 64
    assert by[("random", True)].scheme == TLAlignConfig() and by[("random", False)].scheme == NoAlignConfig()


# ------------------------------------------------------------------------------------------- config


def test_config_file_then_flags(tmp_path: Path) -> None:
    (tmp_path / "job.json").write_text(json.dumps({"table": 8, "seeds": [3, 4], "recipe": {"batch_size": 64, "lr": 1e-3}}))
    cfg, dry = ablation.resolve_config(["--config", str(tmp_path / "job.json"), "--batch-size", "32"])
    assert (cfg.table, cfg.seeds, cfg.recipe.batch_size, cfg.recipe.lr, dry) == (8, (3, 4), 32, 1e-3, False)
    assert cfg.model == AblationConfig().model  # untouched sections keep the defaults
    (tmp_path / "job.yaml").write_text("table: 7\nrows: [cutmix]\ndata: {subset: 100}\n")
    cfg, _ = ablation.resolve_config(["--config", str(tmp_path / "job.yaml"), "--seeds", "5"])
    assert (cfg.table, cfg.rows, cfg.data.subset, cfg.seeds) == (7, ("cutmix",), 100, (5,))
    # the resolved config round-trips through its own JSON
    (tmp_path / "dump.json").write_text(cfg.model_dump_json())
    assert ablation.resolve_config(["--config", str(tmp_path / "dump.json")])[0] == cfg


def test_imagenette_preset_and_model_flag() -> None:
    cfg, _ = ablation.resolve_config(["--data", "imagenette", "--epochs", "3"])
    assert (cfg.data.loader, cfg.data.img_size, cfg.model.name) == ("folder", 224, "deit_small_patch16_224")
    assert (cfg.model.embed_dim, cfg.model.depth, cfg.model.patch_size, cfg.recipe.epochs) == (None, None, None, 3.0)
    cfg, _ = ablation.resolve_config(["--model", "vit_small_patch16_224", "--patch-size", "4"])
    assert (cfg.model.embed_dim, cfg.model.patch_size, cfg.model.img_size) == (None, 4, 32)


def test_bad_inputs_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ablation.main(["--rows", "cutmix,bogus", "--dry-run", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "bogus" in err and "mixup+cutmix" in err  # names the bad id and the valid ones
    # neither the bundled archive nor torchvision's files, and no download allowed: both ways are named
    assert ablation.main(["--data-root", str(tmp_path / "nowhere"), "--cache-dir", str(tmp_path / "cache"),
                          "--no-download", "--dry-run", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "nowhere" / NAMED["cifar10"]) in err and "--data-root" in err
    assert str(tmp_path / "cache" / "torchvision") in err and "network" in err
    with pytest.raises(ValueError, match="too small for 4 ranks"):
        _per_rank(6, 4)
    with pytest.raises(ValueError, match="divisible"):
        _per_rank(10, 4)


# --------------------------------------------------------------------------------------- end to end


@needs_cifar
def test_end_to_end_outputs_and_resume(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--rows", "cutmix", "--seeds", "0,1", "--out", str(out), *TINY]
    cfg, _ = ablation.resolve_config(argv)
    first = ablation.run_ablation(cfg)
    assert (first.trained, first.skipped) == (4, 0)
    for name in ("table.md", "runs.csv", "deltas.csv", "results.json", "table.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "table.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "table.md").read_text()
    assert "| MixUp | CutMix | Random | Block-wise | Top-1 (%) | +TL-Align Top-1 (%) | Δ |" in table
    assert "| × | ✓ | × | × |" in table and " ± " in table
    with (out / "runs.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["aligned"], r["seed"]) for r in rows) == [("False", "0"), ("False", "1"), ("True", "0"), ("True", "1")]
    assert {r["scheme"] for r in rows} == {"none", "tl_align"} and all(r["evaluated"] == "64" for r in rows)
    results = json.loads((out / "results.json").read_text())
    assert AblationConfig.model_validate(results["config"]) == cfg and len(results["runs"]) == 4
    with (out / "deltas.csv").open() as f:
        deltas = list(csv.DictReader(f))
    assert [(d["row"], d["against"], d["n"]) for d in deltas] == [("cutmix", "without TL-Align", "2")]
    assert results["deltas"][0]["verdict"] in ("no significant difference", "higher", "lower")
    assert results["deltas"][0]["verdict"] in table

    # a rerun trains nothing and leaves every run file as it was
    before = _run_files(out)
    again = ablation.run_ablation(cfg)
    assert (again.trained, again.skipped) == (0, 4) and _run_files(out) == before
    assert again.markdown == first.markdown

    # a torn run file (a crash mid-write cannot leave one, a hand edit can) is redone, the others kept
    torn = sorted(before)[0]
    (out / "runs" / torn).write_text('{"key": ')
    third = ablation.run_ablation(cfg)
    assert (third.trained, third.skipped) == (1, 3)
    after = _run_files(out)
    assert all(after[name] == before[name] for name in before if name != torn)


@needs_cifar
def test_ddp_two_processes_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO_ROOT / "benchmarks" / "ablation.py"), "--rows", "cutmix", "--seeds", "0", "--out", str(out), *TINY]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("| MixUp | CutMix |") == 1  # rank 0 alone prints the table
    assert proc.stdout.count("resolved config") == 1
    runs = [json.loads(p.read_text()) for p in (out / "runs").glob("*.json")]
    assert len(runs) == 2 and all(r["world"] == 2 for r in runs)
    assert all(r["result"]["evaluated"] == 64 for r in runs)  # the two eval shards cover the test subset once
    assert not list(out.rglob("*.tmp*"))  # atomic writes leave no temporaries behind
    assert {p.name for p in out.iterdir()} == {"runs", "table.md", "runs.csv", "deltas.csv", "results.json", "table.png"}
