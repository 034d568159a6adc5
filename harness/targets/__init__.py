"""Targets: the small interface through which contracts build and run an implementation."""

from harness.targets.base import CAPABILITIES, Attention, AttentionSpec, Target, Unsupported
from harness.targets.loader import BUILTIN_TARGETS, load_target

__all__ = ["BUILTIN_TARGETS", "CAPABILITIES", "Attention", "AttentionSpec", "Target", "Unsupported", "load_target"]
