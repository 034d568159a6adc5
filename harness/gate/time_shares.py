"""Where a run's time goes: host work, waiting on the device, communication between ranks.

A machine's calibration (:mod:`harness.gate.calibration`) says how fast its host, its device and
its rank group are; to turn that into the time a *scenario* should take there, the gate needs
the scenario's mix. It is measured once per timed case by profiling one more, untimed, run
with ``torch.profiler`` in every rank at once (so the ranks stay in step as when timed):

- ``comm``: the union of the intervals of collective events (``gloo:*``, ``nccl:*``, ``c10d::*``,
  ``record_param_comms``): a rank's time in collectives, waiting for its peers included;
- ``device``: the union of the runtime calls that hold the host until the device is done
  (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, ``cudaMemcpy*``,
  and their HIP names), outside ``comm``;
- ``host``: the rest of the run's *unprofiled* wall time (the median of the timed runs).

The profiler slows host work (it records every op) but hardly how long a collective or a device
wait lasts, so taking those two in milliseconds from the profile and the rest of the unprofiled
wall as host keeps the profiler's own cost out of the shares.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile, supported_activities

from harness.baselines.perf import COMM, DEVICE, HOST

_COMM_EVENT = re.compile(r"^(gloo:|nccl:|c10d::|record_param_comms$)")
_DEVICE_WAIT_EVENT = re.compile(r"^(cuda|hip)(StreamSynchronize|DeviceSynchronize|EventSynchronize|Memcpy)")
# kineto prints these on fd 2 at every profile's start and stop, whatever its log level says
_KINETO_LINE = re.compile(rb"^(USDT|STAGE):\S+ \S+ \d+:\d+ \S+\.cpp:\d+\] ")

Interval = tuple[float, float]


def merged(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def covered(intervals: Iterable[Interval]) -> float:
    """The length of the union of ``intervals``."""
    return sum(end - start for start, end in merged(intervals))


def shares_from_events(events: Iterable[tuple[str, float, float]], wall_us: float) -> dict[str, float]:
    """The three shares of ``wall_us`` from profiler events ``(name, start_us, end_us)`` (rules in the module docstring)."""
    comm: list[Interval] = []
    waits: list[Interval] = []
    for name, start, end in events:
        if _COMM_EVENT.match(name):
            comm.append((start, end))
        elif _DEVICE_WAIT_EVENT.match(name):
            waits.append((start, end))
    comm_us = covered(comm)
    device_us = covered(comm + waits) - comm_us
    spent = comm_us + device_us
    if spent > wall_us:  # a profile longer than the unprofiled run: no host time left to give
        return {HOST: 0.0, DEVICE: device_us / spent, COMM: comm_us / spent}
    return {HOST: 1.0 - spent / wall_us, DEVICE: device_us / wall_us, COMM: comm_us / wall_us}


@contextmanager
def _without_kineto_lines() -> Iterator[None]:
    """Capture fd 2 around the profiler's start or stop; write back every line but kineto's notices."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [line for line in capture.read().splitlines(keepends=True) if not _KINETO_LINE.match(line)]
            if kept:
                os.write(2, b"".join(kept))


def measure_time_shares(run: Callable[[], object], wall_s: float, device: str) -> tuple[dict[str, float] | None, str | None]:
    """Call ``run`` once, profiled, and return ``(shares, None)``, or ``(None, why)`` where the profile cannot say.

    ``run`` is called in every case, profiled or not, so ranks that run collectives together stay
    in step whatever one rank's profiler does. ``wall_s`` is the unprofiled wall time of one
    call. On a GPU the profiler must see the device's runtime calls (CUPTI); without them a wait
    on the device would count as host work.
    """
    activities = [ProfilerActivity.CPU]
    why = None if wall_s > 0 else "no unprofiled wall time to share out"
    if torch.device(device).type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        if ProfilerActivity.CUDA not in supported_activities():
            why = "torch.profiler cannot see CUDA runtime calls here (no CUPTI)"
    prof = profile(activities=activities) if why is None else None
    if prof is not None:
        try:
            with _without_kineto_lines():
                prof.start()
        except RuntimeError as exc:  # another profiler active, CUPTI refusing: the gate falls back, saying why
            prof, why = None, f"torch.profiler did not start: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    try:
        run()  # the target's own errors propagate; its output is not held back
    finally:
        if prof is not None:
            with _without_kineto_lines():
                prof.stop()
    if prof is None:
        return None, why
    events = ((e.name, e.time_range.start, e.time_range.end) for e in prof.events())
    return shares_from_events(events, wall_s * 1e6), None
