"""Run contract cases on a target: a live rank group per world size, one :class:`CaseResult` per case.

Cases the target cannot express are settled in the parent: not applicable (a capability it does
not declare, where no overlay of it says what it runs) or skipped (unavailable here, a pinned skip);
parameters it refuses outright (:meth:`Target.check_case`) are a configuration error before anything
runs. In a rank, an :class:`Unsupported` is the rank's answer (a skip when every rank says the same);
any other exception propagates, so the launcher ends the whole group at once and the case fails with
that rank's traceback instead of a peer waiting until the timeout.
Then the target overlay's expectations apply (:func:`expectations_applied`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.contracts import collectives, memory
from harness.contracts.case import Case
from harness.contracts.judging import RankOutcome
from harness.contracts.params import Params
from harness.contracts.registry import RankContext, get_contract
from harness.errors import ConfigError, ParamError
from harness.ranks import PoolSet, RankFailure, capacity_reason, preload, rank_device
from harness.results import FAILED, NOT_APPLICABLE, PASSED, SKIPPED, XFAILED, CaseResult
from harness.targets.base import CAPABILITIES, REFERENCE_ONLY, Refusal, Refused, Target, Unsupported
from harness.targets.loader import load_target
from harness.targets.spec import TargetSpec


def check_device(device: str) -> None:
    """``--device cuda`` where torch sees no CUDA device is a configuration error (exit 2), before any work."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda but torch sees no CUDA device", key="--device")


@dataclass(frozen=True)
class RunOptions:
    """Which implementation runs the cases, where, and how long a case may take."""

    target: TargetSpec = TargetSpec()
    device: str = "cpu"
    timeout: float | None = None  # per case; None: the case file's, else the contract's own
    allow_new_skips: bool = False  # an unpinned skip stays a skip instead of failing its case (exploratory runs)

    def load(self) -> Target:
        """The target; a spec that does not load is the ``--target`` option's error (the key the user typed)."""
        try:
            return load_target(self.target)
        except ConfigError as exc:
            if exc.key != "target":
                raise
            raise ConfigError(str(exc).removeprefix("key 'target': "), key="--target") from None

    def usable(self) -> Target:
        """The target, refused (ConfigError, exit 2) where it cannot run at all: a run whose every case would be
        skipped for the target's absence checks nothing, and a CI whose install broke must not stay green."""
        check_device(self.device)
        target = self.load()
        reason = target.unavailable_reason(self.device)
        if reason:
            raise ConfigError(f"target {self.target.name!r} cannot run on {self.device}: {reason}", key="--target")
        return target


def run_case_in_rank(contract_id: str, raw: dict, target_spec: TargetSpec) -> RankOutcome:
    """The function every rank runs for one case (module level: the pool pickles a reference to it)."""
    import torch.distributed as dist

    target = load_target(target_spec)
    contract = get_contract(contract_id)
    params = Params(raw)  # validated in the parent
    ctx = RankContext(
        target,
        dist.get_rank(),
        dist.get_world_size(),
        rank_device(),
        contract.bound(params),
        deterministic=bool(params.get("deterministic", False)),
    )
    memory.reset_peaks(ctx.device)
    try:
        outcome = contract.body(ctx, params)
    except Unsupported as exc:
        return RankOutcome(skip=exc.reason, refused=exc.refused)
    finally:
        target.destroy_parallel()
    if contract.memory:  # a case whose memory was estimated reports what it held
        outcome.peak_memory = memory.peaks(ctx.device)
    if ctx.collectives["calls"]:
        outcome.figures.setdefault("collectives", collectives.figures(ctx.collectives))
    return outcome


def machine_reason(case: Case, device: str) -> str | None:
    """Why this machine cannot run ``case`` (too few ranks in the job, too little memory), or None: a property of
    the machine, not a claim about the target."""
    contract = get_contract(case.contract_id)
    fits = contract.memory(case.params, device) if contract.memory else None
    return capacity_reason(case.world_size) or (fits.reason() if fits else None)


@dataclass(frozen=True)
class NotRun:
    """Why a case is skipped before any rank starts: the words, and their typed cause (what a pinned skip is
    matched on); ``refused`` None: the machine's limits (too few ranks, too little memory), no claim about the
    target."""

    reason: str
    refused: Refused | None


def precheck(case: Case, target: Target, options: RunOptions) -> NotRun | None:
    """Why ``case`` is skipped before any rank starts (the target unavailable here, the machine, a capability the
    target does not declare), or None."""
    unavailable = target.unavailable_reason(options.device)
    machine = machine_reason(case, options.device)
    if unavailable:
        return NotRun(f"target {options.target.name}: {unavailable}", None if machine else Refused(Refusal.UNAVAILABLE))
    if machine:
        return NotRun(machine, None)
    missing = sorted(get_contract(case.contract_id).requirements(case.params) - target.capabilities())
    if not missing:
        return None
    because = target.lacks_because()
    what = "; ".join(f"{m}: {CAPABILITIES[m]}" + (f"; {because[m]}" if m in because else "") for m in missing)
    reason = f"target {options.target.name} does not support {', '.join(missing)} ({what})"
    return NotRun(reason, Refused(Refusal.LACKS, frozenset(missing)))


def validate_for_target(cases: Sequence[Case], target: Target) -> None:
    """Every case's parameters as the target judges them; a ConfigError (exit 2) names the file and key."""
    for case in cases:
        try:
            target.check_case(case.contract_id, case.params)
        except ParamError as exc:
            raise ConfigError(f"case '{case.id}': {exc}", path=case.source, key=f"cases.{case.id}.{exc.key}") from None


def run_cases(
    cases: Sequence[Case],
    options: RunOptions,
    pools: PoolSet,
    *,
    release_pools: bool = False,
    on_result: Callable[[CaseResult], None] | None = None,
) -> list[CaseResult]:
    """Results in the order of ``cases``, run in ``pools`` (every group they need started at once).

    ``release_pools`` closes each world size's group after its last case (a one-shot run); a
    caller that shares the pools across stages or tests leaves them running and closes them itself.
    """
    target = options.load()
    validate_for_target(cases, target)
    results: dict[int, CaseResult] = {}
    runnable: list[tuple[int, Case]] = []
    overlay = target.overlay or target.name
    for index, case in enumerate(cases):
        not_run = precheck(case, target, options)
        if not_run:
            results[index] = _not_run(case, options, not_run, overlay)
            if on_result:
                on_result(results[index])
        else:
            runnable.append((index, case))
    runnable.sort(key=lambda item: item[1].world_size)  # stable: file order within a world size
    preload((__name__, *target.preload_modules()))  # before the first group starts: see harness.ranks.starting
    pools.prestart(c.world_size for _, c in runnable)
    for position, (index, case) in enumerate(runnable):
        results[index] = expectations_applied(case, _run_one(case, pools, options), overlay, options.allow_new_skips)
        if on_result:
            on_result(results[index])
        last_of_world = position + 1 == len(runnable) or runnable[position + 1][1].world_size != case.world_size
        if release_pools and last_of_world:
            pools.release(case.world_size)
    return [results[i] for i in range(len(cases))]


def _not_run(case: Case, options: RunOptions, not_run: NotRun, overlay: str) -> CaseResult:
    """The result of a case :func:`precheck` keeps from running. A job with fewer ranks claims nothing about the
    target (a plain skip). A case needing a capability the target does not declare is not applicable, unless an
    overlay of the target states what it runs (there a skip must be pinned: a capability dropped is a change);
    reference_impl's own model checks are not applicable to any other target."""
    contract = get_contract(case.contract_id)
    name, reason, refused = options.target.name, not_run.reason, not_run.refused
    if refused is None:
        return contract.result(case.id, case.params, SKIPPED, reason, name)
    missing = refused.lacks
    if missing and (missing & REFERENCE_ONLY or (case.target_overlay is None and case.expected_skip is None)):
        return contract.result(case.id, case.params, NOT_APPLICABLE, reason, name, refusal=refused)
    skipped = contract.result(case.id, case.params, SKIPPED, reason, name, refusal=refused)
    return expectations_applied(case, skipped, overlay, options.allow_new_skips)


def _overlay_file(case: Case, overlay: str) -> str:
    """Where the target overlay of the case's case directory is (``parity/cases/contracts/targets/X.toml`` in a
    project), relative to the working directory where it is below it."""
    source = Path(case.source.split(" + ", 1)[0])
    path = (source.parent if source.suffix == ".toml" else Path("cases/contracts")) / "targets" / f"{overlay}.toml"
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def expectations_applied(case: Case, result: CaseResult, overlay: str, allow_new_skips: bool = False) -> CaseResult:
    """The target overlay's word on a result (``overlay``: the target's overlay name, for the message).

    A known divergence (``case.expected_failure``) that failed is ``xfailed``; one that passed fails
    (strict). A skip must be pinned (``case.expected_skip``, with its reason): an unpinned one fails
    the case (it stays a skip with ``allow_new_skips``), one for another reason than the pin's fails,
    and a pinned case that ran fails: the overlay no longer says what the target can express. A skip
    whose reason is one the case's backend overlay pins (``case.backend_skips``) is pinned by that fact.
    """
    if result.status == SKIPPED:
        return _skip_judged(case, result, overlay, allow_new_skips)
    pin = case.expected_skip
    if pin is not None:
        ran = f"it {result.status}" + (f": {result.reason}" if result.reason else "")
        result.status = FAILED
        result.reason = f"pinned to skip ({pin.where}: {pin.because}), but it ran ({ran}): remove it from the overlay"
        return result
    expected = case.expected_failure
    if expected is None:
        return result
    if result.status == FAILED:
        beyond, fixed = expected.uncovered(result.reason or "", (result.figures or {}).get("failing"))
        if beyond:
            result.reason = (
                f"fails beyond its expected failure ({expected.describe()}): {beyond}. It failed: {result.reason}"
            )
        else:
            result.status = XFAILED
            result.reason = f"expected failure: {expected.describe()}{fixed}. It failed: {result.reason}"
    elif result.status == PASSED:
        result.status = FAILED
        result.reason = (
            f"expected to fail, but passed: {expected.describe()}. If upstream fixed it, narrow or drop "
            "that entry's `versions`"
        )
    return result


def _skip_judged(case: Case, result: CaseResult, overlay: str, allow_new_skips: bool) -> CaseResult:
    """A skip is a claim: pinned (by the target overlay, or by the backend overlay's reason), else a failure."""
    reason = result.reason or ""
    pin = case.expected_skip or next((p for p in case.backend_skips if not p.mismatch(result.refusal, reason)), None)
    missed = pin.mismatch(result.refusal, reason) if pin is not None else None
    if pin is None and allow_new_skips:
        result.reason = f"{reason} (not pinned; --allow-new-skips)"
    elif pin is None:
        result.status = FAILED
        result.reason = (
            f"skipped, and this target was expected to run it: {reason}. If the target cannot express it, "
            f"pin it in {_overlay_file(case, overlay)} [expected_skips] with the fact that "
            "justifies it (--allow-new-skips for an exploratory run)"
        )
    elif missed is not None:
        result.status = FAILED
        result.reason = f"skipped for another reason than its pin ({pin.where}) expects ({missed}): {reason}"
    else:
        result.reason = f"{reason} (pinned: {pin.because})"
    return result


def _run_one(case: Case, pools: PoolSet, options: RunOptions) -> CaseResult:
    contract = get_contract(case.contract_id)
    start = time.perf_counter()
    try:
        pool = pools.get(case.world_size)
        start = time.perf_counter()  # a case's cost excludes starting its group
        outcomes = pool.run(
            run_case_in_rank,
            case.contract_id,
            dict(case.params),
            options.target,
            timeout=options.timeout or case.timeout or contract.timeout_s,
        )
    except RankFailure as exc:
        return contract.result(
            case.id,
            case.params,
            FAILED,
            str(exc).splitlines()[0],
            options.target.name,
            duration_s=time.perf_counter() - start,
            traceback=exc.traceback,
        )
    return contract.judge(case.id, case.params, outcomes, time.perf_counter() - start, options.target.name)
