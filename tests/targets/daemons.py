"""A target whose every rank makes a temporary folder and starts two grandchildren, one in its own process group
and one in a session of its own (a daemon), writes their pids into ``marker`` (a directory), then never returns
from building a layer: what a signal or a SIGKILL of parity must still leave nothing behind of."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from harness.targets.base import AttentionSpec
from harness.targets.reference import ReferenceAttention, ReferenceTarget


class DaemonsTarget(ReferenceTarget):
    name = "daemons"

    def __init__(self, marker: str) -> None:
        self.marker = Path(marker)

    def make_attention(self, spec: AttentionSpec) -> ReferenceAttention:
        tempfile.mkdtemp(prefix="parity-daemons-")  # never removed by the rank: it never returns
        children = [subprocess.Popen(["sleep", "600"]), subprocess.Popen(["sleep", "600"], start_new_session=True)]
        pids = [os.getpid(), *(c.pid for c in children)]
        (self.marker / f"rank-{dist.get_rank()}").write_text(" ".join(map(str, pids)))
        while True:
            time.sleep(60)


def factory(marker: str) -> DaemonsTarget:
    return DaemonsTarget(marker)
