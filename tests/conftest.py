"""Shared test settings: deterministic, small, and single-threaded enough for 2 cores."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# pytest-xdist (pyproject's addopts: ``-n auto``, at most 4 workers) runs a worker per core: each takes its
# share of the cores, at most 2 threads, so that the workers do not oversubscribe the machine
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers, torch.get_num_threads())))
