"""The ablation's run loop: plan, skip what is done, train the rest, write the table (rank 0)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks._ablation_data import (check_base_classes, check_subsets, data_origin, default_out, load_data,
                                      locate_data, peek_sizes)
from benchmarks._ablation_outputs import render_markdown, write_atomic, write_outputs
from benchmarks._ablation_plan import base_data, plan, planned_teacher, read_done
from benchmarks._ablation_prepare import prepare_annotator, prepare_base
from benchmarks._cifar_batches import TorchvisionCIFAR10, ensure_files
from benchmarks._data import Shard
from benchmarks._ablation_config import AblationConfig
from benchmarks._dist import barrier, broadcast_from_zero, setup, teardown
from benchmarks._provenance import finish, provenance
from benchmarks._token_labels import TokenLabelSource
from mixlabels import TokenLabelingConfig

__all__ = ["Report", "run_ablation"]


@dataclass(frozen=True)
class Report:
    """What a job did and found (rank 0; other ranks get ``trained``/``skipped`` only)."""

    out: Path
    trained: int
    skipped: int
    records: list[dict[str, Any]]
    markdown: str


def run_ablation(cfg: AblationConfig, *, dry_run: bool = False) -> Report:
    """Train and evaluate every missing run of the table, then write and print the table (rank 0)."""
    from tqdm import tqdm

    from benchmarks._train import train_and_evaluate

    shard = setup(cfg.device)
    try:
        threads = cfg.threads or _free_cores(shard)
        torch.set_num_threads(threads)
        lead = shard.rank == 0
        source = locate_data(cfg)  # a missing archive or path fails now, also in a dry run
        base_cfg = cfg.model_copy(update={"data": base_data(cfg)}) if cfg.profile == "finetune" else None
        base_source = locate_data(base_cfg) if base_cfg is not None else None  # so does a missing --base-data
        origin = data_origin(source)
        out = Path(cfg.out).expanduser().resolve() if cfg.out else default_out(cfg, source)
        job = provenance(device=str(shard.device))
        if cfg.recipe.batch_size < shard.world:
            raise ValueError(f"--batch-size {cfg.recipe.batch_size} is smaller than the number of ranks "
                             f"({shard.world}): every rank needs at least 2 images to mix")
        if lead:
            print(f"resolved config ({shard.world} rank{'s' if shard.world > 1 else ''} on {shard.device}, "
                  f"{threads} torch thread{'s' if threads > 1 else ''} per rank):")
            print(cfg.model_dump_json(indent=2))
            print(f"output: {out}", flush=True)
        if isinstance(source, TorchvisionCIFAR10):
            if lead:
                print(f"data: {source.name} (the bundled archive {source.archive} was not found)", flush=True)
                if not dry_run or not cfg.download:  # a dry run downloads nothing, but fails where a run would
                    ensure_files(source, allow_download=cfg.download and not dry_run)
                elif source.missing():
                    print(f"  a run downloads it with torchvision into {source.root} first", flush=True)
            barrier()
            if not dry_run and source.missing():  # another rank downloaded onto a disk this rank does not see
                raise FileNotFoundError(f"{source.folder} lacks {', '.join(source.missing())} on rank {shard.rank}")
        data = load_data(cfg, shard, source) if not dry_run else None
        if data is not None:
            num_classes = data.num_classes
        else:  # a dry run counts class folders and images instead of decoding: it plans the real keys
            sizes = peek_sizes(cfg, source)
            check_subsets(cfg, sizes)
            num_classes = sizes.num_classes
            if base_cfg is not None and base_source is not None:  # and refuses the base the run would refuse
                base_sizes = peek_sizes(base_cfg, base_source)
                check_base_classes(base_sizes.name, base_sizes.num_classes, cfg.data.source, num_classes)
                check_subsets(base_cfg, base_sizes)  # the base run evaluates on the job's --test-subset
        planned = plan(cfg, num_classes, shard.device.type)
        if data is not None and (cfg.model.init is not None or cfg.model.pretrained):
            cfg.model.initialised(num_classes)  # a checkpoint that does not fit fails now, not after the first run
        # rank 0 alone reads the run files: every rank takes the same decision even on node-local disks
        done = broadcast_from_zero(read_done(out / "runs", planned, origin) if lead else {})
        ckpt_dir = out / "checkpoints"
        todo = [p for p in planned
                if p.key not in done or (cfg.save_checkpoints and not (ckpt_dir / f"{p.key}.pth").is_file())]
        if lead:
            print(f"table {cfg.table}: {len(planned)} runs ({len(planned) - len(todo)} already done, "
                  f"{len(todo)} to train)", flush=True)
            if any(p.run.annotator is not None for p in planned):
                print(f"  plus the annotator (teacher run {planned_teacher(cfg, planned, num_classes).key}, trained and scored "
                      "first unless done)", flush=True)
            if dry_run:
                for p in planned:
                    print(f"  {p.key}  {p.name}{'  (done)' if p.key in done else ''}")
        if dry_run or data is None:
            return Report(out, 0, len(planned) - len(todo), [], "")
        progress = lead and not cfg.quiet
        base: dict[str, Any] | None = None
        base_ckpt: Path | None = None
        if cfg.profile == "finetune":
            base, base_ckpt = prepare_base(cfg, planned, num_classes, shard, out, progress=progress, needed=bool(todo))
        teacher: dict[str, Any] | None = None
        labels_source: TokenLabelSource | None = None
        if any(p.run.annotator is not None for p in planned):
            teacher, labels_source = prepare_annotator(cfg, planned, data, shard, out, progress=progress,
                                                       needed=any(p.run.annotator is not None for p in todo),
                                                       origin=origin)
        overall = tqdm(total=len(todo), desc=f"table {cfg.table}", disable=not progress, position=0, dynamic_ncols=True)
        for i, p in enumerate(todo):
            labels = None
            if (p.run.annotator is not None and labels_source is not None
                    and isinstance(p.run.scheme, TokenLabelingConfig)):
                labels = replace(labels_source, fill=p.run.annotator.fill)
            result = train_and_evaluate(p.run, data.make_train(p.seed), data.test, shard, num_classes=data.num_classes,
                                        progress=progress, desc=p.name, token_labels=labels, init=base_ckpt,
                                        checkpoint=ckpt_dir / f"{p.key}.pth" if cfg.save_checkpoints else None)
            if lead:
                record = {"key": p.key, "run": p.run.model_dump(mode="json"), "result": asdict(result),
                          "world": shard.world, "device": str(shard.device), "finished": time.time(),
                          "data_origin": origin}
                write_atomic(out / "runs" / f"{p.key}.json", json.dumps(record, indent=1))
                done[p.key] = record
                tqdm.write(f"[{i + 1}/{len(todo)}] {p.name}: top-1 {result.top1:.2f}% "
                           f"({result.steps} steps, {result.train_seconds:.0f} s)")
            overall.update()
        overall.close()
        barrier()
        if not lead:
            return Report(out, len(todo), len(planned) - len(todo), [], "")
        records = [{"table": cfg.table, "row": p.cell.row, "label": p.cell.label, "aligned": p.cell.aligned,
                    "seed": p.seed, **done[p.key]} for p in planned]
        markdown = render_markdown(cfg, planned, records, teacher, base)
        job = {**finish(job), "data": str(source.folder if isinstance(source, TorchvisionCIFAR10) else source)}
        write_outputs(out, cfg, planned, records, markdown, teacher, base, job)
        print()
        print(markdown, flush=True)
        print(f"written: {out / 'table.md'}, runs.csv, deltas.csv, results.json, table.png")
        return Report(out, len(todo), len(planned) - len(todo), records, markdown)
    finally:
        teardown()


def _free_cores(shard: Shard) -> int:
    """Torch threads per rank when ``--threads`` is not given: the cores other processes leave idle.

    On a CPU shared with other jobs, more OpenMP threads than idle cores make every
    step wait at barriers for descheduled threads: on 2 busy cores a training step of
    the default model took 2-5 s with 2 threads and 0.5-0.6 s with 1.
    """
    cores = os.cpu_count() or 1
    if shard.device.type == "cuda":
        return max(1, min(4, cores // max(1, shard.world)))  # only the input pipeline runs on the host
    try:
        busy = os.getloadavg()[0]
    except OSError:  # not every platform has a load average
        busy = 0.0
    per_rank = cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", shard.world)))
    return max(1, min(per_rank, round(cores - busy)))
