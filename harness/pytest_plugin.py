"""pytest plugin (entry point ``pytest11: parity``; ``pip install 'parity[pytest]'``): parity from your own suite.

Fixtures: ``rank_pools``, ``rank_pool(world_size)``, ``assert_contract("usp.ulysses_parity", world_size=2)``
(one case on the session's target: fails with the figures, skips with the reason) and ``image_regression``
(an image against its blessed reference next to the test, by parity's metrics and thresholds). The target
is resolved as the CLI does: ``--parity-target``/``--parity-target-arg``, then the project file's, then the
test's ``target=``; a test whose ``target=`` differs from the one given above it fails (never a silent
drop). ``--parity-cases`` collects a project's contract case files as items, one per case (``pytest -k``).
Docs: docs/project.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from harness.cases.contract import Case
    from harness.contracts.runner import RunOptions
    from harness.project import Project
    from harness.ranks import PoolSet, RankPool
    from harness.results import CaseResult
    from harness.targets.spec import TargetSpec


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("parity", "parity contracts")
    group.addoption(
        "--parity-target",
        default=None,
        help="target: a built-in name or module:factory (default: the project file's, else the test's, else reference)",
    )
    group.addoption(
        "--parity-target-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument of the target's factory (repeatable; default: the project file's target_args)",
    )
    group.addoption(
        "--parity-device", default=None, choices=("cpu", "cuda"), help="device of the ranks (default: the project's)"
    )
    group.addoption(
        "--parity-no-skip",
        action="store_true",
        help="assert_contract fails a case the target cannot express instead of skipping it (a suite whose "
        "every case must run: a capability the target dropped then turns the run red, not silently skipped)",
    )
    group.addoption(
        "--parity-bless",
        action="store_true",
        help="image_regression writes the images as the new references (and fails, so the run is not a pass)",
    )
    group.addoption(
        "--parity-cases",
        action="store_true",
        help="collect the contract case files (*.toml under the project's cases/contracts) as tests, one per case",
    )


# --------------------------------------------------------------------------- resolution


def _project(config: pytest.Config) -> Project | None:
    from harness.project import find_project, load_project

    path = find_project(Path(config.invocation_params.dir))
    return None if path is None else load_project(path)


class Resolved:
    """The target, its arguments and the device, each from the first of: flags, the project file, the test."""

    def __init__(self, config: pytest.Config) -> None:
        from harness.targets.spec import parse_target_args

        project = _project(config)
        flag_target, flag_args = config.getoption("--parity-target"), config.getoption("--parity-target-arg")
        self.target: str | None = flag_target or (project.target if project else None)
        self.where = "--parity-target" if flag_target else f"{project.file}" if project and project.target else ""
        self.args = parse_target_args(flag_args) if flag_args else tuple(project.target_args) if project else ()
        self.device = config.getoption("--parity-device") or (project.device if project else None) or "cpu"
        self.cases = project.cases if project and project.cases else None

    def for_test(self, wanted: str | None) -> TargetSpec:
        """The target a test runs: the resolved one; a test's own ``target=`` only where nothing above names one."""
        from harness.targets.spec import TargetSpec

        if self.target is None:
            return TargetSpec(wanted or "reference", self.args)
        if wanted is not None and wanted != self.target:
            pytest.fail(
                f"the test asks for target {wanted!r}, {self.where} names {self.target!r}: remove one "
                "(parity never drops either silently)",
                pytrace=False,
            )
        return TargetSpec(self.target, self.args)

    def options(self, target: TargetSpec, no_skip: bool) -> RunOptions:
        from harness.contracts.runner import RunOptions

        return RunOptions(target, self.device, allow_new_skips=not no_skip)


@pytest.fixture(scope="session")
def parity_resolved(request: pytest.FixtureRequest) -> Resolved:
    return Resolved(request.config)


@pytest.fixture(scope="session")
def rank_pools(parity_resolved: Resolved) -> Iterator[PoolSet]:
    from harness.ranks import PoolSet

    with PoolSet(parity_resolved.device) as pools:
        yield pools


@pytest.fixture(scope="session")
def rank_pool(rank_pools: PoolSet) -> Callable[[int], RankPool]:
    return rank_pools.get


def _judged(result: CaseResult, what: str, target: str, no_skip: bool) -> CaseResult:
    from harness.results import FAILED, NOT_APPLICABLE, SKIPPED

    if result.status in (SKIPPED, NOT_APPLICABLE):
        word = "skipped" if result.status == SKIPPED else "not applicable"
        if no_skip:
            pytest.fail(f"{what} was {word} on target {target} under --parity-no-skip: {result.reason}", pytrace=False)
        pytest.skip(
            f"{what}: {result.reason}" if result.status == SKIPPED else f"{what}: not applicable: {result.reason}"
        )
    if result.status == FAILED:
        details = f"\n{result.traceback}" if result.traceback else ""
        pytest.fail(
            f"{what} failed on target {target}: {result.reason}\nbound: {result.bound}\n"
            f"kernel: {result.kernel}\nfigures: {result.figures}{details}",
            pytrace=False,
        )
    return result


@pytest.fixture
def assert_contract(
    request: pytest.FixtureRequest, rank_pools: PoolSet, parity_resolved: Resolved
) -> Callable[..., CaseResult]:
    from harness.contracts.case import make_case
    from harness.contracts.runner import run_cases

    def check(contract_id: str, *, target: str | None = None, **params: Any) -> CaseResult:
        no_skip = request.config.getoption("--parity-no-skip")  # else a skip skips the test, pinned or not
        chosen = parity_resolved.for_test(target)
        case = make_case(contract_id, params, case_id=f"{request.node.name}:{contract_id}", source="assert_contract")
        [result] = run_cases([case], parity_resolved.options(chosen, no_skip), rank_pools)
        return _judged(result, contract_id, chosen.name, no_skip)

    return check


# --------------------------------------------------------------------------- image_regression


class ImageRegression:
    """``check(image)``: a uint8 ``[H, W, 3]`` (or ``[T, H, W, 3]``) image against the reference blessed for this
    test in ``<test file's folder>/<test module>/``, by parity's metrics and the default thresholds (the
    project's, where its baselines hold them). A missing reference is blessed and the test fails."""

    def __init__(self, request: pytest.FixtureRequest, thresholds_dir: Path | None) -> None:
        self.directory = request.path.parent / request.path.stem
        self.name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name).strip("._") or "image"
        self.bless_all = bool(request.config.getoption("--parity-bless"))
        self.thresholds_dir = thresholds_dir

    def check(self, image: Any, basename: str | None = None) -> dict[str, float | None]:
        import numpy as np

        from harness.baselines.image_writes import bless
        from harness.baselines.images import find_reference

        name = basename or self.name
        array = np.asarray(image)
        found = None if self.bless_all else find_reference(self.directory, name)
        if found is None:
            bless(self.directory, name, array)
            why = "--parity-bless" if self.bless_all else "no reference yet"
            pytest.fail(f"{name}: {why}: blessed it in {self.directory}; check it in and run again", pytrace=False)
        if found.array.shape != array.shape:
            pytest.fail(f"{name}: shape {list(array.shape)}, its reference {list(found.array.shape)}", pytrace=False)
        return self._judge(name, found.array, array)

    def _judge(self, name: str, ref: Any, cand: Any) -> dict[str, float | None]:
        from harness.baselines.thresholds import THRESHOLDS_FILE, ThresholdSet
        from harness.gate.images import describe_bounds, measure, violations
        from harness.paths import default_baselines_dir

        kind = "video" if cand.ndim == 4 else "image"
        folder = self.thresholds_dir if self.thresholds_dir else default_baselines_dir()
        thresholds = ThresholdSet.load(folder / THRESHOLDS_FILE).for_case(name, kind)
        metrics = measure(ref, cand, kind, None)
        problems = violations(metrics, thresholds)
        if problems:
            pytest.fail(
                f"{name} differs from its reference ({describe_bounds(thresholds)}): " + "; ".join(problems),
                pytrace=False,
            )
        return metrics


@pytest.fixture
def image_regression(request: pytest.FixtureRequest) -> ImageRegression:
    project = _project(request.config)
    return ImageRegression(request, project.baselines if project else None)


# --------------------------------------------------------------------------- case files as tests


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    config = parent.config
    if not config.getoption("--parity-cases") or file_path.suffix != ".toml":
        return None
    from harness.cases.contract import contract_case_dir
    from harness.paths import default_cases_dir

    resolved = Resolved(config)
    directory = contract_case_dir(resolved.cases or default_cases_dir()).resolve()
    if file_path.resolve().parent != directory:
        return None
    return CaseFile.from_parent(parent, path=file_path)


class CaseFile(pytest.File):
    """A contract case file: one item per case, as the project's overlays make it."""

    def collect(self) -> Iterator[CaseItem]:
        from harness.cases.contract import load_cases, platform_of_device

        resolved = Resolved(self.config)
        options = resolved.options(resolved.for_test(None), no_skip=False)
        loaded = options.load()
        root = (resolved.cases or self.path.parent.parent).resolve()
        runs = loaded.unavailable_reason(resolved.device) is None
        for case in load_cases(root, platform_of_device(resolved.device), loaded.overlay or loaded.name, runs):
            if Path(case.source.split(" + ", 1)[0]).resolve() == self.path.resolve():
                yield CaseItem.from_parent(self, name=case.id, case=case, options=options)


class CaseItem(pytest.Item):
    def __init__(self, *, case: Case, options: RunOptions, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.case, self.options = case, options

    def runtest(self) -> None:
        from harness.contracts.runner import run_cases

        [result] = run_cases([self.case], self.options, _session_pools(self.config))
        _judged(result, self.case.id, self.options.target.name, no_skip=self.config.getoption("--parity-no-skip"))

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"parity case {self.case.id} ({self.case.contract_id})"


def _session_pools(config: pytest.Config) -> PoolSet:
    """One PoolSet for every collected case of the session, closed at its end."""
    pools = getattr(config, "_parity_pools", None)
    if pools is None:
        from harness.ranks import PoolSet

        pools = PoolSet(Resolved(config).device)
        pools.__enter__()
        config.add_cleanup(lambda: pools.__exit__(None, None, None))
        config._parity_pools = pools  # type: ignore[attr-defined]
    return pools
