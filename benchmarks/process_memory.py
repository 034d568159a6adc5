"""Peak memory of a command and every process it starts (ranks, servers), sampled while it runs.

    python benchmarks/process_memory.py -- parity check --suite long

Prints the peaks of the summed proportional set size (PSS: shared pages divided among the processes
sharing them, so torch's libraries count once, not once per rank) and of the summed resident set size
(RSS: an upper bound). A rank forked from a server is a descendant too, so the whole check is counted.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

GIB = 1 << 30


@dataclass
class Peaks:
    """The largest summed PSS and RSS seen over the process tree, in bytes, and the most processes at once."""

    pss: int = 0
    rss: int = 0
    processes: int = 0

    def sample(self, root: psutil.Process) -> None:
        pss = rss = 0
        tree = [root, *root.children(recursive=True)]
        for process in tree:
            try:
                info = process.memory_full_info()
            except psutil.Error:
                continue  # it ended between the listing and the reading
            pss, rss = pss + info.pss, rss + info.rss
        self.pss, self.rss, self.processes = max(self.pss, pss), max(self.rss, rss), max(self.processes, len(tree))


def run_measured(command: Sequence[str], interval_s: float = 0.2, **popen: object) -> tuple[int, Peaks]:
    """Run ``command`` to its end; its exit code and the peaks of its process tree."""
    peaks, done = Peaks(), threading.Event()
    process = subprocess.Popen(command, **popen)  # type: ignore[call-overload]
    root = psutil.Process(process.pid)

    def watch() -> None:
        while not done.is_set():
            try:
                peaks.sample(root)
            except psutil.Error:
                return
            time.sleep(interval_s)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        code = process.wait()
    finally:
        done.set()
        watcher.join()
    return code, peaks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="+", help="the command (after --)")
    args = parser.parse_args()
    start = time.perf_counter()
    code, peaks = run_measured(args.command)
    print(
        f"exit {code} in {time.perf_counter() - start:.1f} s; peak over {peaks.processes} processes: "
        f"PSS {peaks.pss / GIB:.2f} GiB, RSS {peaks.rss / GIB:.2f} GiB",
        file=sys.stderr,
    )
    return code


if __name__ == "__main__":
    sys.exit(main())
