"""Targets: the small interface through which the harness builds and runs an implementation under test."""

from harness.targets.base import (
    CAPABILITIES,
    REFUSALS,
    Attention,
    AttentionSpec,
    Capability,
    PipelineFailed,
    PipelineOutput,
    PipelineTarget,
    PreparedPipeline,
    Refusal,
    Target,
    Timings,
    Unsupported,
)
from harness.targets.loader import (
    BUILTIN_PIPELINES,
    BUILTIN_TARGETS,
    load_pipeline_target,
    load_target,
)
from harness.targets.spec import TargetSpec, parse_target_args

__all__ = [
    "BUILTIN_PIPELINES",
    "BUILTIN_TARGETS",
    "CAPABILITIES",
    "REFUSALS",
    "Attention",
    "Capability",
    "Refusal",
    "AttentionSpec",
    "PipelineFailed",
    "PipelineOutput",
    "PipelineTarget",
    "PreparedPipeline",
    "Target",
    "TargetSpec",
    "Timings",
    "Unsupported",
    "load_pipeline_target",
    "load_target",
    "parse_target_args",
]
