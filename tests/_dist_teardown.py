"""The end of a ``torchrun`` test worker: rank 0 prints its report, then an explicit, synchronised teardown.

Under load, about one run in forty of ``_fsdp_worker.py`` (2 gloo ranks on the CPU) aborted after rank 0 had
printed its whole report: "terminate called without an active exception" (SIGABRT) in one rank, while it
destroyed the process group or tore the interpreter down (CI on a2c2425; here once in 45 runs beside other
load). The findings are complete by then, so the end is made deterministic instead of left to
the interpreter: the modules nothing refers to any more (the refusals' sharded models, whose states may hold
all-gathers a refused forward never waited for) are collected while the group lives; both ranks meet at a
barrier, so neither closes its connections under the other's traffic; the group is destroyed; and the
process leaves with its output flushed and without the interpreter's teardown of gloo's threads.
An error before this point still raises, and torchrun still reports it.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from typing import Any

import torch.distributed as dist


def finish(report: dict[str, Any]) -> None:
    """Print ``report`` from rank 0 as one ``REPORT {json}`` line, end the process group, exit 0."""
    if dist.get_rank() == 0:
        print("REPORT " + json.dumps(report))
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
