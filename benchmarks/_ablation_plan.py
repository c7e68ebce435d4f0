"""The ablation's runs: every (cell, seed) with its full config and key, and the run files already written."""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._ablation_config import AblationConfig, AnnotatorConfig, DataConfig, RunConfig, keyed_dump, run_key
from benchmarks._init import file_digest
from benchmarks._rows import Cell, MixerFlags, row_ids, table_cells
from mixlabels import NoAlignConfig
from mixlabels.strategies import CutMixConfig

__all__ = ["Planned", "plan", "teacher_run", "base_run", "base_data", "planned_teacher", "grid_of", "read_done", "record_problem"]


@dataclass(frozen=True)
class Planned:
    """One run of the job: a table cell at a seed, its full config and key."""

    cell: Cell
    seed: int
    run: RunConfig
    key: str

    @property
    def name(self) -> str:
        return f"{self.cell.row}{' +TL-Align' if self.cell.aligned else ''} seed {self.seed}"


def teacher_run(cfg: AblationConfig, num_classes: int, device_type: str) -> RunConfig:
    """The tokenlabel table's annotator: the job's model, globally average-pooled, trained with CutMix.

    A head trained on the mean of the patch tokens is meaningful on each token alone (as
    a CNN's is on each location: CAM), which is what a dense score map needs; a class
    token's head never sees a patch token. It trains for ``teacher_epochs`` (default:
    twice the rows' epochs) on the same training images, seed 0.
    """
    epochs = cfg.teacher_epochs if cfg.teacher_epochs is not None else 2 * cfg.recipe.epochs
    r = cfg.recipe
    cutmix = CutMixConfig(num_classes=num_classes, label_smoothing=r.label_smoothing, prob=r.mix_prob, alpha=1.0)
    return RunConfig(
        data=cfg.data,  # trained from scratch: a fine-tuning start has a class token the pooled teacher lacks
        model=cfg.model.model_copy(update={"class_token": False, "global_pool": "avg", "init": None, "pretrained": False}),
        recipe=r.model_copy(update={"epochs": epochs}), mixer=cutmix, scheme=NoAlignConfig(),
        seed=0, device_type=device_type, bf16=cfg.use_bf16(),
    )


def base_run(cfg: AblationConfig, num_classes: int, device_type: str) -> RunConfig:
    """The finetune profile's base model: the job's model trained with CutMix on ``base_data``, seed 0.

    All of the base data's training images at the job's image size, for ``base_epochs``
    (default: four times the rows' epochs); the cells then fine-tune it on the job's data.
    """
    r = cfg.recipe
    epochs = cfg.base_epochs if cfg.base_epochs is not None else 4 * r.epochs
    # the base data must have the job's class count: the cells load the base's head strictly
    cutmix = CutMixConfig(num_classes=num_classes, label_smoothing=r.label_smoothing, prob=r.mix_prob, alpha=1.0)
    return RunConfig(data=base_data(cfg), model=cfg.model, recipe=r.model_copy(update={"epochs": epochs}), mixer=cutmix,
                     scheme=NoAlignConfig(), init_sha256=_init_digest(cfg), seed=0, device_type=device_type,
                     bf16=cfg.use_bf16())


def base_data(cfg: AblationConfig) -> DataConfig:
    """The base run's data: the base data set at the job's image size, all its training images, as tensors."""
    return cfg.data.model_copy(update={"source": cfg.base_source(), "loader": "tensor", "subset": None})


def _init_digest(cfg: AblationConfig) -> str | None:
    return file_digest(cfg.model.init) if cfg.model.init is not None else None  # a missing file fails here


def plan(cfg: AblationConfig, num_classes: int, device_type: str) -> list[Planned]:
    """Every (cell, seed) of the table in the paper's order, seeds innermost.

    Raises:
        ValueError: unknown row ids (the message lists the table's rows), no seeds, or a model the table cannot use.
    """
    if not cfg.seeds:
        raise ValueError("no seeds: pass --seeds 0,1 (at least one)")
    if len(set(cfg.seeds)) != len(cfg.seeds):
        raise ValueError(f"seeds must be distinct, got {list(cfg.seeds)}")
    known = row_ids(cfg.table)
    if cfg.rows is not None:
        unknown = [r for r in cfg.rows if r not in known]
        if unknown or not cfg.rows:
            raise ValueError(f"unknown row id(s) {unknown} for table {cfg.table}; its rows are: {', '.join(known)}")
    patch, img = grid_of(cfg)
    cells = table_cells(
        cfg.table, num_classes=num_classes, label_smoothing=cfg.recipe.label_smoothing, prob=cfg.recipe.mix_prob,
        patch_size=patch, img_size=img, depth=cfg.model.resolved_depth(), drop_path=cfg.model.drop_path,
        extension=cfg.rows is not None,
    )
    if cfg.rows is not None:
        cells = [c for c in cells if c.row in cfg.rows]
    digest = _init_digest(cfg)
    model, base = cfg.model, None
    if cfg.profile == "finetune":  # every cell starts from the base run's weights: its key enters theirs
        base = run_key(base_run(cfg, num_classes, device_type))
        model, digest = cfg.model.model_copy(update={"init": None, "pretrained": False}), None
    annotator = None
    if any(c.annotated for c in cells):
        annotator = AnnotatorConfig(teacher=run_key(teacher_run(cfg, num_classes, device_type)))
    out = []
    for cell in cells:
        for seed in cfg.seeds:
            run = RunConfig(data=cfg.data, model=model, recipe=cfg.recipe, mixer=cell.mixer, scheme=cell.scheme,
                            annotator=annotator if cell.annotated else None, init_sha256=digest, base=base, seed=seed,
                            device_type=device_type,
                            bf16=cfg.use_bf16())
            out.append(Planned(cell, seed, run, run_key(run)))
    return out


def grid_of(cfg: AblationConfig) -> tuple[int, int]:
    """``(patch size, image size)`` of the built model: the random and block-wise mixers use one cell per token."""
    model = cfg.model.build(num_classes=2)
    embed = getattr(model, "patch_embed", None)
    patch = getattr(embed, "patch_size", None)
    if not isinstance(patch, tuple) or patch[0] != patch[1]:
        raise ValueError(f"{cfg.model.name}: the ablation needs a ViT with square patches (timm's patch_embed.patch_size)")
    if cfg.data.img_size % patch[0]:
        raise ValueError(f"image size {cfg.data.img_size} is not a multiple of the patch size {patch[0]}")
    return int(patch[0]), cfg.data.img_size


def planned_teacher(cfg: AblationConfig, planned: Sequence[Planned], num_classes: int) -> Planned:
    """The annotator's run, planned like a cell (its key names its run file, checkpoint and score maps)."""
    annotated = next(p for p in planned if p.run.annotator is not None)
    run = teacher_run(cfg, num_classes, annotated.run.device_type)
    cell = Cell("teacher", "annotator (teacher)", MixerFlags(cutmix=True), False, run.mixer, run.scheme)
    planned_key = run_key(run)
    assert annotated.run.annotator is not None and annotated.run.annotator.teacher == planned_key
    return Planned(cell, run.seed, run, planned_key)


def read_done(runs_dir: Path, planned: Sequence[Planned], origin: str | None = None) -> dict[str, dict[str, Any]]:
    """The finished run files among the planned keys; a file that does not match its config or data is ignored."""
    done: dict[str, dict[str, Any]] = {}
    for p in planned:
        path = runs_dir / f"{p.key}.json"
        if not path.is_file():
            continue
        try:
            record = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            warnings.warn(f"run file {path} cannot be read ({e}); treating {p.name} as not done: it is retrained and the file replaced", stacklevel=2)
            continue  # a torn or foreign file: the run is redone and the file replaced
        why = record_problem(record)
        if why is not None:
            warnings.warn(f"run file {path} {why}; treating {p.name} as not done: it is retrained and the file replaced", stacklevel=2)
            continue
        run = record.get("run")
        if (record.get("key") == p.key and isinstance(run, dict) and keyed_dump(run) == keyed_dump(p.run)
                and record.get("data_origin") == origin):
            done[p.key] = record
    return done


def record_problem(record: object) -> str | None:
    """Why a run file's content is not a finished run's record (``None`` if it is one)."""
    if not isinstance(record, dict):
        return f"holds a JSON {type(record).__name__}, not a run record"
    missing = [k for k in ("key", "run", "result") if k not in record]
    if missing:
        return f"has no {', '.join(repr(k) for k in missing)} entry"
    result = record["result"]
    if not isinstance(result, dict) or not all(isinstance(result.get(k), (int, float)) for k in ("top1", "steps")):
        return "has a \"result\" without numeric \"top1\" and \"steps\""
    return None
