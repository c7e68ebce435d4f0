"""The models a job trains before its cells: the finetune profile's base model and the tokenlabel annotator."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks._ablation_data import Data, check_base_classes, load_data
from benchmarks._ablation_outputs import write_atomic
from benchmarks._ablation_plan import Planned, base_run, grid_of, planned_teacher, read_done
from benchmarks._ablation_config import AblationConfig, run_key
from benchmarks._data import Shard
from benchmarks._dist import barrier, broadcast_from_zero
from benchmarks._rows import Cell, MixerFlags
from benchmarks._token_labels import TokenLabelSource, annotate_split
from mixlabels.score_maps import ScoreMaps

__all__ = ["prepare_base", "prepare_annotator"]


def prepare_base(cfg: AblationConfig, planned: Sequence[Planned], num_classes: int, shard: Shard, out: Path, *,
                 progress: bool, needed: bool) -> tuple[dict[str, Any], Path]:
    """The finetune profile's base model: trained once (unless its run file and checkpoint exist), then reused.

    Returns its run record and checkpoint ``<out>/base/<key>.pth``. ``needed``: a cell is
    still to train, so the checkpoint must exist (a deleted one is retrained).
    """
    from benchmarks._train import train_and_evaluate

    run = base_run(cfg, num_classes, planned[0].run.device_type)
    key = run_key(run)
    assert all(p.run.base == key for p in planned)
    cell = Cell("base", "base model", MixerFlags(cutmix=True), False, run.mixer, run.scheme)
    ckpt = out / "base" / f"{key}.pth"  # <out>/runs/<key>.json beside it: benchmarks/alignment_analysis.py reads its heads
    found = read_done(out / "runs", [Planned(cell, run.seed, run, key)]) if shard.rank == 0 else {}
    done = broadcast_from_zero(found if ckpt.is_file() or not needed else {})
    if key not in done:
        data = load_data(cfg.model_copy(update={"data": run.data}), shard)
        check_base_classes(run.data.source, data.num_classes, cfg.data.source, num_classes)
        result = train_and_evaluate(run, data.make_train(run.seed), data.test, shard, num_classes=num_classes,
                                    progress=progress, desc="base model", checkpoint=ckpt)
        record = {"key": key, "run": run.model_dump(mode="json"), "result": asdict(result), "world": shard.world,
                  "device": str(shard.device), "finished": time.time()}
        if shard.rank == 0:
            write_atomic(out / "runs" / f"{key}.json", json.dumps(record, indent=1))
            print(f"base model: top-1 {result.top1:.2f}% on {run.data.source} ({result.steps} steps, "
                  f"{result.train_seconds:.0f} s)", flush=True)
        done[key] = record
    barrier()
    return done[key], ckpt


def prepare_annotator(
    cfg: AblationConfig,
    planned: Sequence[Planned],
    data: Data,
    shard: Shard,
    out: Path,
    *,
    progress: bool,
    needed: bool,
    origin: str | None = None,
) -> tuple[dict[str, Any], TokenLabelSource | None]:
    """Train the teacher (unless done), score the training images with it (resumable), open the maps.

    Returns the teacher's run record and, when ``needed`` (an annotator row is still to
    train), the maps on this rank's device. The teacher's checkpoint is
    ``<out>/annotator/teacher-<key>.pth`` and its maps ``<out>/annotator/score-maps-<key>-top<k>``.
    """
    from benchmarks._train import train_and_evaluate

    if data.train_split is None or data.train_indices is None:
        raise ValueError("the tokenlabel table's annotator rows need the tensor loader (--loader tensor): token "
                         "labels are aligned to each image's crop, which timm's folder transforms do not report")
    lead = shard.rank == 0
    teacher = planned_teacher(cfg, planned, data.num_classes)
    annotator = next(p.run.annotator for p in planned if p.run.annotator is not None)
    assert annotator is not None
    ckpt = out / "annotator" / f"teacher-{teacher.key}.pth"
    found = read_done(out / "runs", [teacher], origin) if lead else {}
    done = broadcast_from_zero(found if ckpt.is_file() else {})
    if teacher.key not in done:
        result = train_and_evaluate(teacher.run, data.make_train(teacher.seed), data.test, shard,
                                    num_classes=data.num_classes, progress=progress, desc="teacher (annotator)",
                                    checkpoint=ckpt)
        record = {"key": teacher.key, "run": teacher.run.model_dump(mode="json"), "result": asdict(result),
                  "world": shard.world, "device": str(shard.device), "finished": time.time(), "data_origin": origin}
        if lead:
            write_atomic(out / "runs" / f"{teacher.key}.json", json.dumps(record, indent=1))
            print(f"teacher (annotator): top-1 {result.top1:.2f}% ({result.steps} steps, {result.train_seconds:.0f} s)",
                  flush=True)
        done[teacher.key] = record
    barrier()
    store_dir = out / "annotator" / f"score-maps-{teacher.key}-top{annotator.k}"
    if lead:
        model = teacher.run.model.build(data.num_classes)
        model.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=True))
        meta = {"teacher": teacher.key, "model": teacher.run.model.model_dump(mode="json"),
                "img_size": [cfg.data.img_size, cfg.data.img_size]}
        store = annotate_split(model, data.train_split, data.train_indices, store_dir, mean=cfg.data.mean,
                               std=cfg.data.std, k=annotator.k, meta=meta, device=shard.device, progress=progress)
        hm, wm = store.map_size
        done[teacher.key]["score_maps"] = {"path": str(store_dir), "images": len(store), "bytes": store.nbytes,
                                           "bytes_per_image": store.nbytes / max(1, len(store)),
                                           "map_size": [hm, wm], "k": store.k}
    barrier()
    if not needed:
        return done[teacher.key], None
    patch, img = grid_of(cfg)
    source = TokenLabelSource.open(ScoreMaps(store_dir), len(data.train_split.labels),
                                   fill=annotator.fill, grid=(img // patch, img // patch), device=shard.device)
    return done[teacher.key], source
