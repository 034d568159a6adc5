"""The gate's image stage: run every image case, compare with its blessed single-rank reference, judge by thresholds.

Per case: the pipeline runs on ``world_size`` ranks of a persistent pool (one per world size,
all started in the background at once); rank 0's output is compared with the hash-verified
reference (``<baselines>/images``) by PSNR, SSIM, mean abs diff and, when a CLIP model is
configured, CLIP cosine. clip, ssim and psnr pass at ``value >= threshold``, mean_abs_diff at
``value <= threshold``. A metric that is not computed (CLIP without a model) is ``null`` with its
reason, never passed silently; the case is judged on the metrics that were computed.

Thresholds: ``<baselines>/consistency_threshold.json`` with the overlay
``<baselines>/platforms/<platform>.json`` of this hardware merged over it when one exists
(:func:`harness.baselines.platforms.platform_name`). Everything that can be wrong in the
configuration (case files, thresholds, references and their hashes, the CLIP directory) is
checked before any rank starts, and is a ConfigError (exit 2), not a failed case.

The stage also fills the results document's top-level ``cases`` map, in the schema
:func:`harness.recalibrate.parse_results` reads, and ``platform``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from rich.markup import escape
from rich.table import Table

from harness.baselines.thresholds import HIGHER_IS_BETTER, METRICS, Thresholds, ThresholdSet
from harness.contracts.verdict import FAILED, PASSED, SKIPPED
from harness.report_junit import JUnitCase

if TYPE_CHECKING:  # the stage is imported by every ``parity`` call: metrics (scipy) and models load when it runs
    from harness.commands.gate import GateContext, StageResult
    from harness.image_cases import ImageCase
    from harness.metrics import ClipScorer

THRESHOLDS_FILE = "consistency_threshold.json"
REFERENCES_DIR = "images"
OVERLAYS_DIR = "platforms"
DEFAULT_CASE_TIMEOUT_S = 300.0


def load_thresholds(baselines_dir: Path, platform: str) -> ThresholdSet:
    """The base thresholds with this platform's overlay (if any) merged over them."""
    from harness.baselines.platforms import find_overlay

    overlay = find_overlay(baselines_dir / OVERLAYS_DIR, platform)
    return ThresholdSet.load(baselines_dir / THRESHOLDS_FILE, [overlay] if overlay else [])


@dataclass
class ImageVerdict:
    """One image case's outcome: figures (None = not computed), the bounds used, where they came from."""

    case: ImageCase
    status: str
    reason: str | None
    metrics: dict[str, float | None]
    thresholds: Thresholds
    skipped_metrics: dict[str, str] = field(default_factory=dict)
    duration_s: float = 0.0
    e2e_ms: float | None = None
    backends: dict[str, str] = field(default_factory=dict)
    triptych: str | None = None  # PNG path relative to the report directory
    diff_scale: float | None = None

    @property
    def case_id(self) -> str:
        return self.case.id

    def to_dict(self) -> dict[str, Any]:
        from harness.metrics import metric_to_json

        figures: dict[str, Any] = {m: metric_to_json(v) for m, v in self.metrics.items()}
        figures["thresholds"] = {m: self.thresholds.get(m) for m in METRICS}
        if self.skipped_metrics:
            figures["skipped_metrics"] = self.skipped_metrics
        record: dict[str, Any] = {
            "case_id": self.case.id,
            "kind": self.case.kind,
            "status": self.status,
            "reason": self.reason,
            "world_size": self.case.world_size,
            "ulysses_degree": self.case.ulysses_degree,
            "ring_degree": self.case.ring_degree,
            "figures": figures,
            "bound": describe_bounds(self.thresholds),
            "threshold_source": dict(self.thresholds.source),
            "duration_s": self.duration_s,
            "e2e_ms": self.e2e_ms,
            "backends": self.backends,
            "source": self.case.source,
        }
        if self.triptych:
            record["triptych"], record["diff_scale"] = self.triptych, self.diff_scale
        return record

    def results_entry(self) -> dict[str, Any]:
        """The entry of the top-level ``cases`` map (recalibration input)."""
        from harness.metrics import metric_to_json

        return {
            "kind": self.case.kind,
            "passed": self.status == PASSED,
            "metrics": {m: metric_to_json(v) for m, v in self.metrics.items()},
            "thresholds": {m: self.thresholds.get(m) for m in METRICS},
            "threshold_source": dict(self.thresholds.source),
            "skipped_metrics": self.skipped_metrics,
            "world_size": self.case.world_size,
        }


def measure(ref: np.ndarray, cand: np.ndarray, kind: str, scorer: ClipScorer | None) -> dict[str, float | None]:
    """The four metrics of a candidate against its reference (clip None without a scorer)."""
    from harness.metrics import mean_abs_diff, psnr, ssim

    clip: float | None = None
    if scorer is not None:
        clip = scorer.similarity([ref], [cand])[0] if kind == "image" else scorer.video_similarity(ref, cand)
    return {"clip": clip, "ssim": ssim(ref, cand), "psnr": psnr(ref, cand), "mean_abs_diff": mean_abs_diff(ref, cand)}


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
        ok = value >= bound if metric in HIGHER_IS_BETTER else value <= bound
        if not ok:
            op = "<" if metric in HIGHER_IS_BETTER else ">"
            out.append(f"{metric} {value:.6g} {op} {bound:g} ({thresholds.source.get(metric, '?')})")
    return out


def judge_case(case: ImageCase, ref: np.ndarray, cand: np.ndarray, thresholds: Thresholds,
               scorer: ClipScorer | None, clip_skip: str | None) -> ImageVerdict:
    if ref.shape != cand.shape:
        reason = f"candidate shape {cand.shape} differs from the reference's {ref.shape} (re-bless if the case changed)"
        return ImageVerdict(case, FAILED, reason, dict.fromkeys(METRICS), thresholds)
    metrics = measure(ref, cand, case.kind, scorer)
    problems = violations(metrics, thresholds)
    skipped = {"clip": clip_skip} if metrics["clip"] is None and clip_skip else {}
    return ImageVerdict(case, FAILED if problems else PASSED, "; ".join(problems) or None, metrics, thresholds, skipped)


@dataclass
class _Inputs:
    """Everything a run reads besides the pipeline's output, loaded and validated up front."""

    platform: str
    cases: list[ImageCase]
    thresholds: ThresholdSet
    bounds: dict[str, Thresholds]
    references: dict[str, np.ndarray]
    scorer: ClipScorer | None
    clip_skip: str | None


def load_inputs(ctx: GateContext) -> _Inputs:
    """Cases, thresholds (every case's bounds resolved), hash-verified references and the CLIP scorer."""
    from harness.baselines.images import load_reference
    from harness.baselines.platforms import platform_name
    from harness.image_cases import load_image_cases
    from harness.metrics import load_clip_scorer

    platform = platform_name(ctx.args.device)
    cases = sorted(load_image_cases(ctx.cases_root), key=lambda c: c.world_size)  # stable: file order per world
    thresholds = load_thresholds(ctx.baselines_dir, platform)
    bounds = {c.id: thresholds.for_case(c.id, c.kind) for c in cases}
    references = {c.id: load_reference(ctx.baselines_dir / REFERENCES_DIR, c.id) for c in cases}
    scorer, clip_skip = load_clip_scorer(getattr(ctx.args, "clip_model", None))
    return _Inputs(platform, cases, thresholds, bounds, references, scorer, clip_skip)


class ImageStage:
    """Every image case under ``<cases>/images`` against ``<baselines>``."""

    name = "images"

    def __init__(self) -> None:
        self._prepared: tuple[GateContext, _Inputs] | None = None

    def skip_reason(self, ctx: GateContext) -> str | None:
        from harness.image_cases import image_case_dir

        directory = image_case_dir(ctx.cases_root)
        return None if directory.is_dir() else f"no image cases ({directory} does not exist)"

    def preflight(self, ctx: GateContext) -> None:
        """Load and validate the inputs before any stage runs (a ConfigError here exits 2 at once)."""
        self._prepared = (ctx, load_inputs(ctx))

    def run(self, ctx: GateContext) -> StageResult:
        from harness.commands.gate import StageResult
        from harness.console import progress
        from harness.image_cases import run_image_case

        prepared, self._prepared = self._prepared, None
        inputs = prepared[1] if prepared is not None and prepared[0] is ctx else load_inputs(ctx)
        cases, device = inputs.cases, ctx.args.device
        if inputs.clip_skip:
            ctx.out.print(f"images: clip skipped: {inputs.clip_skip}")
        timeout = ctx.args.timeout or DEFAULT_CASE_TIMEOUT_S

        start = time.perf_counter()
        verdicts: list[ImageVerdict] = []
        pools = ctx.pools  # shared by the gate's stages: groups started once
        with progress(ctx.err, len(cases), self.name) as advance:
            pools.prestart(c.world_size for c in cases)
            for case in cases:
                pools.get(case.world_size)  # a case's duration excludes starting its group
                t0 = time.perf_counter()
                result = run_image_case(case, pools, device, timeout)
                ref = inputs.references[case.id]
                verdict = judge_case(case, ref, result.output, inputs.bounds[case.id], inputs.scorer, inputs.clip_skip)
                verdict.duration_s, verdict.e2e_ms, verdict.backends = time.perf_counter() - t0, result.timings.e2e_ms, result.backends
                if verdict.status == FAILED and ctx.report_dir is not None:
                    _write_triptych(ctx.report_dir, verdict, ref, result.output)
                verdicts.append(verdict)
                advance(cast(Any, verdict))
            startup = dict(pools.startup_s)
        wall = time.perf_counter() - start

        ctx.out.print(image_table(verdicts))
        count = {s: sum(v.status == s for v in verdicts) for s in (PASSED, FAILED, SKIPPED)}
        ctx.out.print(f"images: {count[PASSED]} passed, {count[FAILED]} failed in {wall:.1f} s")
        return StageResult(
            self.name, [v.to_dict() for v in verdicts], [_junit(v, self.name) for v in verdicts],
            count[PASSED], count[FAILED], count[SKIPPED], wall,
            extra={
                "platform": inputs.platform,
                "thresholds_files": inputs.thresholds.paths,
                "clip_skipped": inputs.clip_skip,
                "cases_s": sum(v.duration_s for v in verdicts),
                "pool_startup_s": {str(w): s for w, s in sorted(startup.items())},
            },
            top_level={"platform": inputs.platform, "cases": {v.case_id: v.results_entry() for v in verdicts}},
        )


def _write_triptych(report_dir: Path, verdict: ImageVerdict, ref: np.ndarray, cand: np.ndarray) -> None:
    from harness.report_html import triptych, write_png

    if ref.shape != cand.shape:
        return  # nothing to put side by side; the reason says why
    picture, scale = triptych(ref, cand)
    relative = f"{REFERENCES_DIR}/{verdict.case_id}.png"
    write_png(report_dir / relative, picture)
    verdict.triptych, verdict.diff_scale = relative, scale


def _fmt(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "-"
    return "inf" if value == float("inf") else f"{value:.{digits}g}"


def image_table(verdicts: list[ImageVerdict]) -> Table:
    style = {PASSED: "green", FAILED: "bold red", SKIPPED: "yellow"}
    table = Table(title="gate: images")
    for column in ("case", "W", "kind", "status", "clip", "ssim", "psnr", "mad", "bounds / reason", "ms"):
        table.add_column(column, overflow="fold")
    for v in verdicts:
        detail = v.reason or describe_bounds(v.thresholds)
        table.add_row(
            escape(v.case_id), str(v.case.world_size), v.case.kind, f"[{style[v.status]}]{v.status}[/]",
            *(_fmt(v.metrics[m]) for m in METRICS), escape(detail), f"{v.duration_s * 1000:.0f}",
        )
    return table


def _junit(v: ImageVerdict, suite: str) -> JUnitCase:
    import json

    details = json.dumps(v.to_dict()["figures"], sort_keys=True)
    message = v.reason or (f"clip skipped: {v.skipped_metrics['clip']}" if v.skipped_metrics else None)
    return JUnitCase(suite, f"images.{v.case.kind}", v.case_id, v.duration_s, v.status, message, details)
