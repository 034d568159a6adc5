"""The gate's image stage: run every image case, compare with its blessed single-rank reference, judge by thresholds.

Rank 0's output of each case (run on ``world_size`` ranks of the gate's pools, or in this process
for an external command) is compared with its hash-verified reference by PSNR, SSIM, mean abs diff
and, with a CLIP model, CLIP; a metric not computed is ``null`` with its reason, never a silent
pass. Every configuration problem (case files, thresholds, references, the CLIP directory) is a
ConfigError from :meth:`ImageStage.preflight`, before any rank starts. A case with no reference, or
changed since it was blessed, runs but fails with ``parity bless CASE`` as its next step, not as a
regression. With a report directory the candidates of failing cases (all with ``keep_outputs``) are
saved for ``parity bless --from-results``; the stage fills the results' ``cases`` and ``platform``.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from harness.baselines.image_writes import blessing, write_set
from harness.baselines.images import REFERENCES_DIR, Reference, changed_fields, find_reference, fingerprint
from harness.baselines.thresholds import HIGHER_IS_BETTER, METRICS, Thresholds, ThresholdSet, meets
from harness.cases.image import ImageCase, image_case_dir, load_image_cases
from harness.files.reading import is_directory_present
from harness.gate.stage import GateContext, GateOptions, case_params, run_each_case
from harness.pipelines.sessions import generate
from harness.project.hints import command
from harness.report.console import Column, print_results
from harness.report.format import figure
from harness.results import FAILED, PASSED, CaseResult, StageResult, image_entry, summary_line

if TYPE_CHECKING:  # metrics (scipy, transformers) load only when the stage runs
    from harness.metrics import ClipScorer

DEFAULT_CASE_TIMEOUT_S = 300.0
CANDIDATES_DIR = "candidates"  # <report>/candidates: the outputs a gate run saved, a reference set of their own
TRIPTYCHS_DIR = "triptychs"
IMAGE_COLUMNS: tuple[Column, ...] = (
    ("kind", lambda r: str(r.params.get("kind", ""))),
    *(
        (
            name,
            lambda r, m=metric: (
                "skipped" if m in (r.figures.get("skipped_metrics") or {}) else figure(r.figures.get(m))
            ),
        )
        for name, metric in zip(("clip", "ssim", "psnr", "mad"), METRICS)
    ),
)


def measure(ref: np.ndarray, cand: np.ndarray, kind: str, scorer: ClipScorer | None) -> dict[str, float | None]:
    """The four metrics of a candidate against its reference (clip None without a scorer)."""
    from harness.metrics import mean_abs_diff, psnr, ssim

    clip: float | None = None
    if scorer is not None:
        clip = scorer.similarity([ref], [cand])[0] if kind == "image" else scorer.video_similarity(ref, cand)
    return {"clip": clip, "ssim": ssim(ref, cand), "psnr": psnr(ref, cand), "mean_abs_diff": mean_abs_diff(ref, cand)}


def nonfinite_reason(count: int) -> str:
    return f"the pipeline produced {count} NaN/Inf values (latents or decoded pixels) before the uint8 conversion"


def describe_bounds(t: Thresholds) -> str:
    return f"clip ≥ {t.clip:g}, ssim ≥ {t.ssim:g}, psnr ≥ {t.psnr:g}, mean_abs_diff ≤ {t.mean_abs_diff:g}"


def violations(metrics: dict[str, float | None], thresholds: Thresholds) -> list[str]:
    """One line per metric outside its bound, naming the bound's file and key."""
    out = []
    for metric in METRICS:
        value = metrics[metric]
        if value is None:
            continue
        bound = thresholds.get(metric)
        if not meets(metric, value, bound):
            op = "<" if metric in HIGHER_IS_BETTER else ">"
            out.append(f"{metric} {value:.6g} {op} {bound:g} ({thresholds.source.get(metric, '?')})")
    return out


def judge_case(
    case: ImageCase,
    ref: np.ndarray,
    cand: np.ndarray,
    thresholds: Thresholds,
    scorer: ClipScorer | None,
    clip_skip: str | None,
) -> CaseResult:
    """The case's result: the metrics of ``cand`` (from the case's target) against ``ref``, judged by ``thresholds``."""
    figures: dict[str, object] = {
        "thresholds": {m: thresholds.get(m) for m in METRICS},
        "threshold_source": dict(thresholds.source),
    }
    result = CaseResult(
        case.id,
        f"images.{case.kind}",
        PASSED,
        bound=describe_bounds(thresholds),
        params=case_params(case),
        target=case.target.name,
        figures=figures,
    )
    if ref.shape != cand.shape:
        result.status = FAILED
        result.reason = (
            f"candidate shape {cand.shape} differs from the reference's {ref.shape} (re-bless if the case changed)"
        )
        figures.update(dict.fromkeys(METRICS))
        return result
    metrics = measure(ref, cand, case.kind, scorer)
    nan = sorted(m for m, v in metrics.items() if v is not None and math.isnan(v))
    metrics.update(dict.fromkeys(nan))  # recorded as not measured, and the case fails saying why
    figures.update(metrics)
    skipped = {m: "came out NaN" for m in nan}
    if metrics["clip"] is None and clip_skip and "clip" not in skipped:
        skipped["clip"] = clip_skip
    if skipped:
        figures["skipped_metrics"] = skipped
    unpinned = [
        f"{m} bound not measured ({why}), and the case does not pin it: measure it, or pin it with "
        f'unmeasured = {{ {m} = "{why}" }} in {case.source}'
        for m, why in skipped.items()
        if m not in nan and case.unmeasured.get(m, "\0") not in why
    ]
    problems = [f"{m} is NaN: it can neither pass nor fail" for m in nan] + unpinned + violations(metrics, thresholds)
    if problems:
        result.status, result.reason = FAILED, "; ".join(problems)
    return result


@dataclass
class _Inputs:
    """Everything a run reads besides the pipeline's output, loaded and validated up front."""

    platform: str
    cases: list[ImageCase]
    thresholds: ThresholdSet
    bounds: dict[str, Thresholds]
    references: dict[str, Reference | None]
    scorer: ClipScorer | None
    clip_skip: str | None


def load_inputs(ctx: GateContext) -> _Inputs:
    """Cases, thresholds (every case's bounds resolved), hash-verified references and the CLIP scorer."""
    from harness.baselines.platforms import platform_name
    from harness.metrics import load_clip_scorer

    options = ctx.options
    platform = platform_name(ctx.device)
    cases = sorted(
        load_image_cases(options.cases_root, options.pipeline), key=lambda c: c.world_size
    )  # stable: file order per world
    thresholds = ThresholdSet.for_platform(options.baselines_dir, platform)
    bounds = {c.id: thresholds.for_case(c.id, c.kind) for c in cases}
    references = {c.id: find_reference(options.baselines_dir / REFERENCES_DIR, c.id) for c in cases}
    scorer, clip_skip = load_clip_scorer(options.clip_model)
    return _Inputs(platform, cases, thresholds, bounds, references, scorer, clip_skip)


class ImageStage:
    """Every image case under ``<cases>/images`` against ``<baselines>``."""

    name = "images"

    def skip_reason(self, ctx: GateContext) -> str | None:
        directory = image_case_dir(ctx.options.cases_root)
        return None if is_directory_present(directory) else f"no image cases ({directory} does not exist)"

    def preflight(self, ctx: GateContext) -> _Inputs:
        return load_inputs(ctx)

    def run(self, ctx: GateContext, inputs: _Inputs) -> StageResult:
        if inputs.clip_skip:
            ctx.out.print(f"images: clip skipped: {inputs.clip_skip}")
        options = ctx.options
        timeout = options.run.timeout or DEFAULT_CASE_TIMEOUT_S
        if (
            options.report_dir is not None
        ):  # only this run's candidates: bless --from-results must not promote an older one
            shutil.rmtree(options.report_dir / CANDIDATES_DIR, ignore_errors=True)

        def judge(case: ImageCase) -> CaseResult:
            produced = generate(case.pipeline_run, ctx.pools, timeout)
            ref = inputs.references[case.id]
            result = unjudged(case, ref, inputs.bounds[case.id], options.carried())
            if result is None:
                assert ref is not None  # unjudged() answers for a missing reference
                result = judge_case(
                    case, ref.array, produced.output, inputs.bounds[case.id], inputs.scorer, inputs.clip_skip
                )
                _name_reference_pipeline(result, ref, case)
            if produced.nonfinite:  # its uint8 pixels hide NaN as 0: whatever the metrics say, the run is broken
                result.status, result.reason = FAILED, nonfinite_reason(produced.nonfinite)
                result.figures["nonfinite"] = produced.nonfinite
            result.figures.update(e2e_ms=produced.timings.e2e_ms, backends=produced.backends)
            result.kernel = ", ".join(f"{k}: {v}" for k, v in produced.backends.items()) or None
            _keep_evidence(options, case, result, ref, produced.output)
            return result

        results, wall = run_each_case(ctx, self.name, inputs.cases, "images", judge)
        print_results(ctx.out, results, "gate: images", IMAGE_COLUMNS, options.tables)
        ctx.out.print(f"images: {summary_line(results, wall)}")
        return StageResult(
            self.name,
            results,
            wall,
            extra={
                "platform": inputs.platform,
                "thresholds_files": inputs.thresholds.paths,
                "clip_skipped": inputs.clip_skip,
                "cases_s": sum(r.duration_s for r in results),
                "pool_startup_s": dict(sorted(ctx.pools.startup_s.items())),
            },
            top_level={"platform": inputs.platform, "cases": {r.case_id: image_entry(r) for r in results}},
        )


def _keep_evidence(
    options: GateOptions, case: ImageCase, result: CaseResult, ref: Reference | None, output: np.ndarray
) -> None:
    """A failed (or ``--keep-outputs``) case's candidate image; a failed one with a reference (a changed case
    too) also its triptych against that reference and the step that would bless or investigate it."""
    report = options.report_dir
    if report is not None and (result.status == FAILED or options.keep_outputs):
        save_candidate(report, case, result, output)
    if result.status == FAILED and ref is not None:
        if report is not None:
            _write_triptych(report, result, ref.array, output)
        if result.next_step is None:
            result.next_step = _regression_step(case, report, options.carried())


def unjudged(
    case: ImageCase, ref: Reference | None, bounds: Thresholds, carried: Sequence[str] = ()
) -> CaseResult | None:
    """The failed result of a case that has no reference, or whose fields changed since it was blessed; None
    when the reference is this case's (a reference blessed before fingerprints were recorded counts as this case's)."""
    if ref is not None and ref.entry.fingerprint in (None, fingerprint(case.pinned)):
        return None
    bless = command(["bless", case.id], carried)
    if ref is None:
        reason, state = f"no reference yet: run `{bless}`", "missing"
    else:
        changes = "; ".join(changed_fields(ref.entry.fields, case.pinned))
        reason, state = f"case changed since it was blessed ({changes}): run `{bless}`", "changed"
    figures: dict[str, object] = {
        "reference": state,
        **dict.fromkeys(METRICS),
        "thresholds": {m: bounds.get(m) for m in METRICS},
        "threshold_source": dict(bounds.source),
    }
    return CaseResult(
        case.id,
        f"images.{case.kind}",
        FAILED,
        reason,
        figures,
        describe_bounds(bounds),
        params=case_params(case),
        target=case.target.name,
        next_step=bless,
    )


def _name_reference_pipeline(result: CaseResult, ref: Reference, case: ImageCase) -> None:
    """Which pipeline target blessed the reference; a failure says so when this run's target is another one
    (gating a candidate stack against references blessed from another is allowed, and easy to misread)."""
    result.figures["reference_pipeline"] = ref.entry.pipeline
    if result.status == FAILED and ref.entry.pipeline not in (None, case.target.name):
        result.reason = f"{result.reason} [reference blessed from pipeline target {ref.entry.pipeline!r}, this run: {case.target.name!r}]"


def _regression_step(case: ImageCase, report: Path | None, carried: Sequence[str]) -> str:
    """Where to look, and how to bless if the change is intended: ``parity bless CASE``, the one form every hint of
    a run uses (it serves every case; ``--from-results`` serves only one-rank candidates, so a run's hints mixed
    both forms)."""
    bless = command(["bless", case.id], carried)
    if report is None:
        return (
            f"{command(['gate', '--report', 'parity-report'], carried)}  (writes the triptych of {case.id}); "
            f"if the change is intended: {bless}"
        )
    from harness.report.html import anchor

    return f"see {report / 'index.html'}#{anchor('images', case.id)}; if the change is intended: {bless}"


def save_candidate(report: Path, case: ImageCase, result: CaseResult, output: np.ndarray) -> None:
    """Keep ``output`` in ``<report>/candidates`` with the fields, world size and pipeline target it was made with."""
    one = blessing(case.id, output, case.pinned, case.world_size, case.target.name)
    write_set(report / CANDIDATES_DIR, [one])
    result.artifacts["candidate"] = f"{CANDIDATES_DIR}/{next(iter(one.data))}"


def _write_triptych(report_dir: Path, result: CaseResult, ref: np.ndarray, cand: np.ndarray) -> None:
    from harness.report.triptych import frame_metrics, triptych, write_png

    if ref.shape != cand.shape:
        return  # nothing to put side by side; the reason says why
    relative = f"{TRIPTYCHS_DIR}/{result.case_id}.png"
    write_png(report_dir / relative, triptych(ref, cand).picture)
    result.artifacts["triptych"] = relative
    if ref.ndim == 4:
        result.figures["frames"] = frame_metrics(ref, cand)
