"""How often the two stochastic-depth rules of TL-Align give different targets, on the ablation's batches.

``TLAlign(drop_path="follow")`` keeps the labels of a sample whose attention branch was
dropped; ``"official"`` (the official code) mixes them anyway. This runs the
ablation's model (or a checkpoint: ``--init``) in train mode on its CutMix batches
and, with the same stochastic-depth draws, counts the steps and samples whose
targets differ and by how much (L-inf over the classes). Takes the ablation's flags::

    python benchmarks/drop_path_rules.py --steps 30                 # default model, drop-path 0.1
    python benchmarks/drop_path_rules.py --init runs/.../checkpoints/<key>.pth --steps 30
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # ``python benchmarks/drop_path_rules.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks import ablation
from benchmarks._data import Shard
from mixlabels import TLAlign
from mixlabels.backbones import adapt
from mixlabels.strategies import CutMixConfig

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/drop_path_rules.py", add_help=False)
    parser.add_argument("--steps", type=int, default=30, help="batches to compare")
    parser.add_argument("--tol", type=float, default=1e-6, help="a target differs when |difference| exceeds this")
    ours, rest = parser.parse_known_args(argv)
    cfg, _ = ablation.resolve_config(rest)
    torch.manual_seed(0)
    shard = Shard(0, 1, torch.device(cfg.device))
    data = ablation.load_data(cfg, shard)
    model = cfg.model.initialised(data.num_classes).to(shard.device).train()
    r = cfg.recipe
    mixer = CutMixConfig(num_classes=data.num_classes, label_smoothing=r.label_smoothing, prob=r.mix_prob).build()
    mixer.generator = torch.Generator().manual_seed(1)
    steps = samples = diff_steps = diff_samples = 0
    worst = 0.0
    with torch.no_grad():
        for images, labels in data.make_train(0).epoch(0):
            mixed, label_map = mixer(images, labels)
            targets = []
            for rule in ("follow", "official"):
                torch.manual_seed(1000 + steps)  # the same stochastic-depth draws for both rules
                targets.append(adapt(model, TLAlign(drop_path=rule))(mixed, label_map).target)
            gap = (targets[0] - targets[1]).abs().amax(dim=-1)  # b
            differs = gap > ours.tol
            diff_steps += int(differs.any())
            diff_samples += int(differs.sum())
            worst = max(worst, float(gap.max()))
            steps += 1
            samples += len(gap)
            if steps >= ours.steps:
                break
    print(f"{cfg.model.name} (dim {cfg.model.embed_dim}, depth {cfg.model.depth}), drop-path {cfg.model.drop_path}, "
          f"init {cfg.model.init or ('timm hub' if cfg.model.pretrained else 'random')}, batch {r.batch_size}, CutMix:")
    print(f"  steps with different targets: {diff_steps}/{steps}; samples: {diff_samples}/{samples}; "
          f"largest |target difference|: {worst:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
