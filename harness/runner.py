"""Run contract cases on a target: one persistent rank pool per world size, one verdict per case.

Cases the target cannot express (a missing capability, the target unavailable on this device)
are skipped in the parent without starting a rank. The others run through
:class:`harness.launcher.RankPool`: starting a group costs seconds (every rank imports torch),
a case in a live pool costs milliseconds, so pools are started together in the background
and each is closed, in the background too, as soon as its last case is done.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future

from harness.cases import Case
from harness.contracts import get_contract
from harness.contracts.params import Params
from harness.contracts.registry import RankContext
from harness.contracts.verdict import FAILED, SKIPPED, RankOutcome, Verdict
from harness.launcher import RankFailure, RankPool, rank_device
from harness.targets.base import CAPABILITIES, Target, Unsupported
from harness.targets.loader import TargetArgs, load_target

PoolGetter = Callable[[int], RankPool]


class PoolSet:
    """Lazily started, background-started, background-closed pools, one per world size."""

    def __init__(self, device: str = "cpu", timeout: float = 120.0) -> None:
        self.device = device
        self.timeout = timeout
        self.startup_s: dict[int, float] = {}  # how long each group took to start (reports show it apart from cases)
        self._starting: dict[int, Future[RankPool]] = {}
        self._closers: list[threading.Thread] = []

    def prestart(self, world_sizes: Iterable[int]) -> None:
        for world in sorted(set(world_sizes)):
            if world not in self._starting:
                future: Future[RankPool] = Future()
                self._starting[world] = future
                threading.Thread(target=self._start, args=(world, future), daemon=True, name=f"pool-start-{world}").start()

    def _start(self, world: int, future: Future[RankPool]) -> None:
        start = time.perf_counter()
        try:
            pool = RankPool(world, self.device, self.timeout)
            self.startup_s[world] = time.perf_counter() - start
            future.set_result(pool)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever asks for this pool
            future.set_exception(exc)

    def get(self, world: int) -> RankPool:
        self.prestart([world])
        return self._starting[world].result()

    __call__ = get  # a PoolSet is a pool getter

    def release(self, world: int) -> None:
        """Close the pool of ``world`` in the background (closing a group takes seconds)."""
        future = self._starting.pop(world, None)
        if future is None:
            return
        thread = threading.Thread(target=_close_when_started, args=(future,), daemon=True, name=f"pool-close-{world}")
        thread.start()
        self._closers.append(thread)

    def close(self) -> None:
        for world in list(self._starting):
            self.release(world)
        for thread in self._closers:
            thread.join()
        self._closers.clear()

    def __enter__(self) -> PoolSet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _close_when_started(future: Future[RankPool]) -> None:
    try:
        pool = future.result()
    except BaseException:  # noqa: BLE001 - a pool that never started has nothing to close
        return
    pool.close()


def run_case_in_rank(contract_id: str, params: dict, target_spec: str, target_args: TargetArgs = ()) -> RankOutcome:
    """The function every rank runs for one case (module level: the pool pickles a reference to it)."""
    import torch.distributed as dist

    target = load_target(target_spec, target_args)
    contract = get_contract(contract_id)
    ctx = RankContext(target, dist.get_rank(), dist.get_world_size(), rank_device())
    try:
        return contract.body(ctx, Params(params))  # validated in the parent
    except Unsupported as exc:
        return RankOutcome(skip=str(exc))
    except Exception:  # noqa: BLE001 - reported in the verdict with its traceback
        return RankOutcome(error=traceback.format_exc())
    finally:
        target.destroy_parallel()


def precheck(case: Case, target: Target, target_spec: str, device: str) -> str | None:
    """Why ``case`` is skipped before any rank starts, or None."""
    reason = target.unavailable_reason(device)
    if reason:
        return f"target {target_spec}: {reason}"
    missing = sorted(get_contract(case.contract_id).requirements(case.params) - target.capabilities())
    if missing:
        what = "; ".join(f"{m}: {CAPABILITIES[m]}" for m in missing)
        return f"target {target_spec} does not support {', '.join(missing)} ({what})"
    return None


def run_cases(
    cases: Sequence[Case],
    target: str = "reference",
    device: str = "cpu",
    *,
    pools: PoolGetter | None = None,
    timeout: float | None = None,
    on_verdict: Callable[[Verdict], None] | None = None,
    target_args: TargetArgs = (),
) -> list[Verdict]:
    """Verdicts in the order of ``cases``.

    ``pools`` lends a live pool per world size. A :class:`PoolSet` is driven fully (all its
    groups started at once, each released after its last case; the caller closes it); any other
    getter (the pytest plugin's session pools) is only asked; None: a PoolSet of this call.
    ``target_args`` are the ``--target-arg`` pairs (``parse_target_args``), handed to every rank too.
    """
    target_obj = load_target(target, target_args)
    verdicts: dict[int, Verdict] = {}
    runnable: list[tuple[int, Case]] = []
    for index, case in enumerate(cases):
        reason = precheck(case, target_obj, target, device)
        if reason:
            verdicts[index] = _verdict(case, SKIPPED, reason, 0.0, target)
            if on_verdict:
                on_verdict(verdicts[index])
        else:
            runnable.append((index, case))
    runnable.sort(key=lambda item: item[1].world_size)  # stable: file order within a world size
    own = PoolSet(device) if pools is None else None
    getter: PoolGetter = own or pools  # type: ignore[assignment]
    managed = getter if isinstance(getter, PoolSet) else None
    try:
        if managed:
            managed.prestart(c.world_size for _, c in runnable)
        for position, (index, case) in enumerate(runnable):
            verdicts[index] = _run_one(case, getter, target, target_args, timeout)
            if on_verdict:
                on_verdict(verdicts[index])
            last_of_world = position + 1 == len(runnable) or runnable[position + 1][1].world_size != case.world_size
            if managed and last_of_world:
                managed.release(case.world_size)
    finally:
        if own:
            own.close()
    return [verdicts[i] for i in range(len(cases))]


def _run_one(case: Case, pools: PoolGetter, target: str, target_args: TargetArgs, timeout: float | None) -> Verdict:
    contract = get_contract(case.contract_id)
    start = time.perf_counter()
    try:
        pool = pools(case.world_size)
        start = time.perf_counter()  # a case's cost excludes starting its group
        outcomes = pool.run(
            run_case_in_rank, case.contract_id, dict(case.params), target, target_args, timeout=timeout or contract.timeout_s
        )
    except RankFailure as exc:
        verdict = _verdict(case, FAILED, str(exc).splitlines()[0], time.perf_counter() - start, target)
        verdict.figures["traceback"] = exc.traceback
        return verdict
    return contract.judge(case.id, case.params, outcomes, time.perf_counter() - start, target)


def _verdict(case: Case, status: str, reason: str, duration: float, target: str) -> Verdict:
    contract = get_contract(case.contract_id)
    return Verdict(
        case.id, case.contract_id, status, reason, {}, contract.bound(case.params).describe(), None, duration,
        dict(case.params), target,
    )
