"""pytest wiring for parity's own suite: the parity plugin and GPU-aware skipping.

Markers (declared in pyproject.toml): ``gpu`` needs one CUDA device, ``multi_gpu`` needs two
or more, ``slow`` is long-running (tens of seconds): slow tests are collected first, so that pytest-xdist's
workers start the longest ones at once rather than finishing on one of them alone (the suite's wall time is
the busiest worker's). GPU tests are skipped *with the reason* on machines without the hardware, never
silently dropped.
"""

from __future__ import annotations

import importlib

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    # The plugin normally arrives through its pytest11 entry point; register it here when the
    # project runs from a checkout that was not pip-installed.
    plugin = importlib.import_module("harness.pytest_plugin")
    if not config.pluginmanager.is_registered(plugin):
        config.pluginmanager.register(plugin, "parity")
    # parity's own assert_contract calls must run: a pass test that the target skipped fails (--parity-no-skip)
    config.option.parity_no_skip = True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)")
    few_gpus = pytest.mark.skip(reason=f"needs 2 or more CUDA GPUs; {gpus} visible")
    for item in items:
        if "gpu" in item.keywords and gpus == 0:
            item.add_marker(no_gpu)
        if "multi_gpu" in item.keywords and gpus < 2:
            item.add_marker(few_gpus)
    items.sort(key=lambda item: "slow" not in item.keywords)  # stable: file order otherwise
