"""The paper's Table 7 (mixers x TL-Align) and Table 8 (TL-Align operations) on real data.

Run from the repository root::

    python benchmarks/ablation.py                       # Table 7, CIFAR-10, CPU, about 20 minutes
    python benchmarks/ablation.py --table 8             # Table 8's rows
    python benchmarks/ablation.py --data imagenette --model deit_small_patch16_224 --device cuda --epochs 100
    torchrun --nproc-per-node 8 benchmarks/ablation.py --data imagenette --device cuda ...   # DDP
    python benchmarks/ablation.py --init base.pth       # fine-tune every cell from a checkpoint
    python benchmarks/ablation.py --profile finetune --seeds 0-9   # base model on Imagenette at 32 px, once,
                                                        # then every cell fine-tuned from it on CIFAR-10

Data: ``--data cifar10`` (the default) reads the bundled ``cifar10-jpg.tar.gz`` from
``--data-root`` (default ``<project>/../shared/data``); without it, CIFAR-10 in
torchvision's format from ``<cache>/torchvision``, which torchvision downloads there
once (announced first; ``--no-download`` forbids it). Runs on those files keep apart
from the archive's (``<out>`` ends in ``cifar10-torchvision``; their records say so).
Any other data set (``imagenette`` or a path) switches the recipe to an ImageNet-like one
(DeiT-S at 224 px, 100 epochs, batch 256, timm's folder transforms, ImageNet statistics):
the end of ``--help`` lists it, and the job's first line names what changed and the flags
that keep the CIFAR-10 recipe. A subset larger than the data is refused, in a dry run too.

Every cell of the table is trained and evaluated once per seed. Each finished
run is written at once to ``<out>/runs/<run_key>.json`` (the key hashes the
run's whole configuration), so a rerun skips what is done and an interrupted job
loses at most the run in progress. At the end the table is printed in the
paper's shape and written as ``table.md``, ``runs.csv``, ``deltas.csv`` (every
delta: the mean paired per-seed difference, its 95% t interval, the seeds where
it was positive, and "no significant difference" where the interval spans 0),
``results.json`` (the resolved config, every run and every delta) and ``table.png``.

Default sizing (CIFAR-10 on 2 CPU cores, about 20 minutes for Table 7's 9 cells x 2 seeds):

    model   deit_tiny_patch16_224 through timm at 32 px, patch 4 (an 8x8 grid + class token),
            width 64, depth 6, 2 heads: 0.3 M parameters
    data    a fixed random 7,500-image training subset, a fixed 2,000-image test subset;
            random crop (pad 4) + flip + random erasing 0.25 on uint8 tensors decoded once
    recipe  DeiT's: AdamW lr 1e-3 at batch 64, wd 0.05, cosine with 5% warmup, label
            smoothing 0.1, stochastic depth 0.1; 2 epochs = 234 steps of 64 per run
    seeds   0 and 1: 9 cells x 2 seeds = 18 runs

    Measured on this 2-core machine, one training step of batch 64 (forward, backward,
    AdamW; CutMix and TL-Align included) took 0.17-0.19 s with 2 torch threads while the
    cores were nearly idle (TL-Align within the noise of the plain step), and 0.4-0.9 s
    with 1 thread while three other jobs shared the cores; evaluating 2,000 images takes
    2-5 s. Planning at a conservative 0.25 s per step:
        18 runs x (234 steps x 0.25 s + 3 s eval) = 18 x 61.5 s = 18.5 min,
    plus about 15 s of start-up and, on the very first run only, about 25 s to decode
    the archive into the cache. On idle cores it takes about 14 min; on cores shared with
    other jobs it takes longer (about 3x at the contention measured above), and the run
    files make an interrupted job resumable. In shortened trial runs, no mixing reached
    23.7% top-1 after 30 steps of 128 and CutMix 21.9% after 120 steps of 64, so the full
    runs land well above chance (10%); the spread over seeds is printed next to every mean, and every
    delta carries its paired 95% interval (``--seeds 0-9`` for ten seeds; with two, t(0.975, 1) = 12.7
    makes the interval wide).

Layout: this file is the entry point; each concern is a module beside it: the command line
(``_ablation_cli``: flags derived from ``AblationConfig``), the runs and their files
(``_ablation_plan``), the data (``_ablation_data``), the run loop (``_ablation_run``), the
base model and the annotator trained before the cells (``_ablation_prepare``), the numbers
(``_ablation_stats``), the files (``_ablation_outputs``) and the chart (``_ablation_plots``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # ``python benchmarks/ablation.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._ablation_cli import build_parser, load_config_file, resolve, resolve_config
from benchmarks._ablation_cli import _int_list as _int_list  # the seeds parser (tests)
from benchmarks._ablation_data import Data, data_origin, default_out, load_data, locate_data
from benchmarks._ablation_outputs import render_markdown, write_atomic, write_outputs
from benchmarks._ablation_plan import Planned, base_run, plan, planned_teacher, read_done, teacher_run
from benchmarks._ablation_plan import read_done as _read_done  # its name before the split
from benchmarks._ablation_plan import record_problem as _record_problem
from benchmarks._ablation_plots import plot
from benchmarks._ablation_prepare import prepare_annotator, prepare_base
from benchmarks._ablation_run import Report, run_ablation
from benchmarks._ablation_stats import Delta, Stat, summarise, table_deltas
from benchmarks._init import PretrainedUnavailable

__all__ = ["main", "resolve_config", "plan", "run_ablation", "Planned", "Report", "summarise", "render_markdown",
           # the names other modules and the tests reach through this entry point
           "build_parser", "load_config_file", "Data", "data_origin", "default_out", "load_data", "locate_data",
           "write_atomic", "write_outputs", "base_run", "planned_teacher", "read_done", "teacher_run", "plot",
           "prepare_annotator", "prepare_base", "Delta", "Stat", "table_deltas", "_read_done", "_record_problem", "_int_list"]


def main(argv: Sequence[str] | None = None) -> int:
    """The command line entry point; returns the exit status."""
    try:
        cfg, dry_run, note = resolve(argv)
        if note is not None and os.environ.get("RANK", "0") == "0":  # said once, before the resolved config
            print(f"ablation: {note}", flush=True)
        run_ablation(cfg, dry_run=dry_run)
    except (FileNotFoundError, ValueError, PretrainedUnavailable) as err:
        from pydantic import ValidationError

        if isinstance(err, ValidationError):
            print(f"ablation: invalid configuration:\n{err}", file=sys.stderr)
        else:
            print(f"ablation: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
