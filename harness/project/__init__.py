"""A user's project: the project file (``parity.toml`` or ``[tool.parity]``) that says where its cases and
baselines live and what it gates, the skeleton ``parity init`` writes, and the options a printed command
must carry to run as the run that printed it did."""

from harness.project.config import PROJECT_FILE, Project, find_project, load_project
from harness.project.hints import carried_options

__all__ = ["PROJECT_FILE", "Project", "carried_options", "find_project", "load_project"]
