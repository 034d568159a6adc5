"""Everything in the harness that knows ``reference_impl``: its attention target, pipeline target and model checks.

No other part of the harness imports ``reference_impl`` (``reference_impl.platform``, the platform
detector, excepted); contracts reach these through the target interface.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.targets.reference.attention import ReferenceAttention, ReferenceTarget, factory

if TYPE_CHECKING:
    from harness.targets.reference.pipeline import ReferencePipelineTarget


def pipeline_factory() -> ReferencePipelineTarget:
    """The reference pipeline target (imported on first use: the models are not needed for attention cases)."""
    from harness.targets.reference.pipeline import ReferencePipelineTarget

    return ReferencePipelineTarget()


__all__ = ["ReferenceAttention", "ReferenceTarget", "factory", "pipeline_factory"]
