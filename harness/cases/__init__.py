"""Case files (TOML): contract cases with their platform overlays, and image cases.

Parsing and validation only; running a case is the business of the contracts runner and the gate.
"""

from harness.cases.contract import CaseSelection, load_case_file, load_cases, platform_of_device, select_cases
from harness.cases.image import ImageCase, load_image_case_file, load_image_cases, select_image_cases

__all__ = [
    "CaseSelection",
    "ImageCase",
    "load_case_file",
    "load_cases",
    "load_image_case_file",
    "load_image_cases",
    "platform_of_device",
    "select_cases",
    "select_image_cases",
]
