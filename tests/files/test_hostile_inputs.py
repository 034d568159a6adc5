"""Hostile inputs for all 15 input kinds, each through the real loader: 0 tracebacks, 0 hangs, 0 wrongly accepted.

One pytest id per input (``kind:name``). Each must either be accepted (it is legitimate) or be
refused with a ConfigError (exit 2) whose message names the file (or, for an environment
variable, the variable) and the key. Every case runs under a 20 s timeout (pytest-timeout's
signal method interrupts a blocking open of a FIFO) and an address-space limit, so a hang or an
unbounded read fails the test instead of the machine. A few go through the real CLI as well.
"""

from __future__ import annotations

import math
import os
import re
import resource
import shutil
import subprocess
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from harness.errors import ConfigError
from tests.files.hostile import ACCEPT, DELETE, Hostile, file_level, mutations, png_cases
from tests.files.kinds import CASE, KINDS, PLATFORM, build_project

pytestmark = [
    pytest.mark.timeout(300),  # a hang guard (a FIFO read would block forever), not a bound
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="FIFOs, /dev/zero and RLIMIT_AS"),
]
REPO = Path(__file__).resolve().parents[2]
HUGE = 10**400  # serialised by json.dumps as 400 digits

C, IM, T = ("cases", "uly"), ("cases", CASE), ("cases", CASE)  # contract case, image case, threshold case tables
REF = ("cases", CASE, "files")  # a manifest case's files
MUTATIONS = [
    *mutations(
        "thresholds",
        [
            ("psnr_int_kept", {(*T, "psnr_threshold"): 19}, ACCEPT),
            ("psnr_negative", {(*T, "psnr_threshold"): -1}, "cases.case_a.psnr_threshold"),
            ("psnr_1e308", {(*T, "psnr_threshold"): 1e308}, "cases.case_a.psnr_threshold"),
            ("psnr_huge_int", {(*T, "psnr_threshold"): HUGE}, "cases.case_a.psnr_threshold"),
            ("psnr_string", {(*T, "psnr_threshold"): "25"}, "cases.case_a.psnr_threshold"),
            ("psnr_bool", {(*T, "psnr_threshold"): True}, "cases.case_a.psnr_threshold"),
            ("psnr_null", {(*T, "psnr_threshold"): None}, "cases.case_a.psnr_threshold"),
            ("psnr_nan", {(*T, "psnr_threshold"): math.nan}, "cases.case_a.psnr_threshold"),
            ("ssim_above_1", {(*T, "ssim_threshold"): 1.5}, "cases.case_a.ssim_threshold"),
            ("ssim_negative", {(*T, "ssim_threshold"): -0.1}, "cases.case_a.ssim_threshold"),
            ("ssim_one", {(*T, "ssim_threshold"): 1}, ACCEPT),
            ("clip_2", {(*T, "clip_threshold"): 2}, "cases.case_a.clip_threshold"),
            ("mad_256", {(*T, "mean_abs_diff_threshold"): 256}, "cases.case_a.mean_abs_diff_threshold"),
            ("mad_negative", {(*T, "mean_abs_diff_threshold"): -1}, "cases.case_a.mean_abs_diff_threshold"),
            ("mad_zero", {(*T, "mean_abs_diff_threshold"): 0}, ACCEPT),
            ("default_psnr_negative", {("default_psnr_threshold_image",): -5}, "default_psnr_threshold_image"),
            (
                "default_missing",
                {(*T, "mean_abs_diff_threshold"): DELETE, ("default_mean_abs_diff_threshold_image",): DELETE},
                "cases.case_a.mean_abs_diff_threshold",
            ),
            ("cases_array", {("cases",): []}, "cases"),
            ("case_number", {T: 5}, "cases.case_a"),
            ("case_id_escape", {("cases", "../x"): {}}, "cases.../x"),
            ("case_id_300_chars", {("cases", "a" * 300): {}}, "cases." + "a" * 300),
            ("case_id_space", {("cases", "a b"): {}}, "cases.a b"),
            ("unknown_case_key", {(*T, "audio_threshold"): "x"}, "cases.case_a.audio_threshold"),
            ("misspelt_case_key", {(*T, "psnr_treshold"): 40.0}, "cases.case_a.psnr_treshold"),
            ("misspelt_default", {("default_psnr_threshold_imag",): 40.0}, "default_psnr_threshold_imag"),
            ("unknown_top_key", {("case",): {}}, "case"),
            ("case_comment_kept", {(*T, "_why"): "measured on a loaded box"}, ACCEPT),
            ("upstream_default_kept", {("default_audio_rms_db_diff_threshold",): 2.0}, ACCEPT),
            (
                "upstream_default_string",
                {("default_audio_rms_db_diff_threshold",): "2"},
                "default_audio_rms_db_diff_threshold",
            ),
            ("upstream_case_key_kept", {(*T, "audio_duration_diff_threshold"): 0.1}, ACCEPT),
        ],
    ),
    *mutations(
        "threshold_overlay",
        [
            ("empty_object", {("cases",): DELETE, ("_comment",): DELETE}, ACCEPT),
            ("psnr_negative", {(*T, "psnr_threshold"): -3}, "cases.case_a.psnr_threshold"),
            ("mad_1e308", {(*T, "mean_abs_diff_threshold"): 1e308}, "cases.case_a.mean_abs_diff_threshold"),
            ("clip_string", {(*T, "clip_threshold"): "high"}, "cases.case_a.clip_threshold"),
            ("cases_string", {("cases",): "x"}, "cases"),
            ("case_id_300_chars", {("cases", "b" * 300): {"psnr_threshold": 1}}, "cases." + "b" * 300),
            ("new_case_kept", {("cases", "other"): {"psnr_threshold": 20}}, ACCEPT),
            ("misspelt_case_key", {(*T, "psnr_treshold"): 30.0}, "cases.case_a.psnr_treshold"),
            ("misspelt_default", {("default_ssim_treshold_video",): 0.5}, "default_ssim_treshold_video"),
        ],
    ),
    *mutations(
        "perf_baselines",
        [
            ("tol_negative", {("tolerances", "pr_test", "e2e"): -1}, "tolerances.pr_test.e2e"),
            ("tol_1e308", {("tolerances", "pr_test", "e2e"): 1e308}, "tolerances.pr_test.e2e"),
            ("tol_huge_int", {("tolerances", "pr_test", "e2e"): HUGE}, "tolerances.pr_test.e2e"),
            ("tol_string", {("tolerances", "pr_test", "e2e"): "0.2"}, "tolerances.pr_test.e2e"),
            ("tol_null", {("tolerances", "pr_test", "e2e"): None}, "tolerances.pr_test.e2e"),
            ("tol_nan", {("tolerances", "pr_test", "denoise_step"): math.nan}, "tolerances.pr_test.denoise_step"),
            ("tol_generous_kept", {("tolerances", "pr_test", "e2e"): 1e5}, ACCEPT),
            ("tol_missing", {("tolerances", "pr_test", "e2e"): DELETE}, "tolerances.pr_test.e2e"),
            ("profile_missing", {("tolerances", "pr_test"): DELETE}, "tolerances"),
            ("floor_1e308", {("tolerances", "pr_test", "abs_floor_ms"): 1e308}, "tolerances.pr_test.abs_floor_ms"),
            ("tolerances_array", {("tolerances",): []}, "tolerances"),
            ("hardware_number", {("metadata", "hardware"): 5}, "metadata.hardware"),
            ("platform_number", {("metadata", "platform"): 5}, "metadata.platform"),
            ("scenario_e2e_1e308", {("scenarios", "s"): {"expected_e2e_ms": 1e308}}, "scenarios.s.expected_e2e_ms"),
            ("scenario_id_300_chars", {("scenarios", "s" * 300): {"expected_e2e_ms": 1}}, "scenarios." + "s" * 300),
            ("unknown_profile", {("tolerances", "nightly"): {"e2e": 0.5}}, "tolerances.nightly"),
            ("misspelt_profile", {("tolerances", "pr_tset"): {"e2e": 0.5}}, "tolerances.pr_tset"),
            ("ab_profile_kept", {("tolerances", "ab"): {"e2e": 0.05}}, ACCEPT),
            ("misspelt_tolerance", {("tolerances", "pr_test", "e2ee"): 0.1}, "tolerances.pr_test.e2ee"),
            ("tolerance_comment_kept", {("tolerances", "pr_test", "_why"): "CI pool"}, ACCEPT),
            ("misspelt_top_key", {("scenario",): {}}, "scenario"),
            (
                "misspelt_scenario_key",
                {("scenarios", "s"): {"expected_e2e_ms": 1, "expected_avg_denoise_mss": 2}},
                "scenarios.s.expected_avg_denoise_mss",
            ),
            (
                "upstream_top_keys_kept",
                {("improvement_reporting",): {"threshold": 0.2}, ("sampling",): {"step_fractions": [0.0, 0.5, 1.0]}},
                ACCEPT,
            ),
            ("upstream_top_key_not_a_table", {("sampling",): [0.0, 1.0]}, "sampling"),
            ("free_form_metadata_kept", {("metadata", "last_updated"): "2026-04-15"}, ACCEPT),
        ],
    ),
    *mutations(
        "perf_overlay",
        [
            ("e2e_negative", {("scenarios", CASE, "expected_e2e_ms"): -1}, "scenarios.case_a.expected_e2e_ms"),
            ("e2e_1e308", {("scenarios", CASE, "expected_e2e_ms"): 1e308}, "scenarios.case_a.expected_e2e_ms"),
            ("e2e_missing", {("scenarios", CASE, "expected_e2e_ms"): DELETE}, "scenarios.case_a"),
            ("e2e_string", {("scenarios", CASE, "expected_e2e_ms"): "10"}, "scenarios.case_a.expected_e2e_ms"),
            (
                "stage_nan",
                {("scenarios", CASE, "stages_ms", "DenoisingStage"): math.nan},
                "scenarios.case_a.stages_ms.DenoisingStage",
            ),
            ("stages_array", {("scenarios", CASE, "stages_ms"): []}, "scenarios.case_a.stages_ms"),
            (
                "step_key_word",
                {("scenarios", CASE, "denoise_step_ms", "first"): 1.0},
                "scenarios.case_a.denoise_step_ms",
            ),
            (
                "step_key_7_digits",
                {("scenarios", CASE, "denoise_step_ms", "1234567"): 1.0},
                "scenarios.case_a.denoise_step_ms",
            ),
            (
                "step_key_5000_digits",
                {("scenarios", CASE, "denoise_step_ms", "9" * 5000): 1.0},
                "scenarios.case_a.denoise_step_ms",
            ),
            (
                "step_negative",
                {("scenarios", CASE, "denoise_step_ms", "0"): -2.5},
                "scenarios.case_a.denoise_step_ms.0",
            ),
            ("agg_zero_kept", {("scenarios", CASE, "expected_avg_denoise_ms"): 0.0}, ACCEPT),
            ("extra_measurement", {("scenarios", CASE, "peak_memory_mb"): 512.0}, "scenarios.case_a.peak_memory_mb"),
            ("misspelt_e2e", {("scenarios", CASE, "expected_e2e_mss"): 9.0}, "scenarios.case_a.expected_e2e_mss"),
            (
                "misspelt_stages",
                {("scenarios", CASE, "stage_ms"): {"DenoisingStage": 1.0}},
                "scenarios.case_a.stage_ms",
            ),
            ("upstream_test_time_kept", {("scenarios", CASE, "estimated_full_test_time_s"): 121.1}, ACCEPT),
            (
                "upstream_test_time_string",
                {("scenarios", CASE, "estimated_full_test_time_s"): "121"},
                "scenarios.case_a.estimated_full_test_time_s",
            ),
            ("per_frame_null_kept", {("scenarios", CASE, "stages_ms", "per_frame_generation"): None}, ACCEPT),
            ("per_frame_number_kept", {("scenarios", CASE, "stages_ms", "per_frame_generation"): 40.5}, ACCEPT),
            (
                "per_frame_string",
                {("scenarios", CASE, "stages_ms", "per_frame_generation"): "40"},
                "scenarios.case_a.stages_ms.per_frame_generation",
            ),
            ("scenario_comment_kept", {("scenarios", CASE, "_note"): "measured on a quiet runner"}, ACCEPT),
            ("misspelt_profile", {("tolerances", "long_trem"): {"e2e": 0.5}}, "tolerances.long_trem"),
            ("tolerance_override_kept", {("tolerances", "pr_test", "e2e"): 0.5}, ACCEPT),
            ("scenarios_string", {("scenarios",): "x"}, "scenarios"),
        ],
    ),
    *mutations(
        "manifest",
        [
            ("hash_not_hex", {(*REF, f"{CASE}.png"): "not-a-hash"}, f"cases.{CASE}.files.{CASE}.png"),
            ("hash_uppercase", {(*REF, f"{CASE}.png"): "A" * 64}, f"cases.{CASE}.files.{CASE}.png"),
            ("hash_number", {(*REF, f"{CASE}.png"): 5}, f"cases.{CASE}.files.{CASE}.png"),
            ("entry_removed", {("cases", CASE): DELETE}, None, f"baselines/images/{CASE}.png"),  # "never blessed"
            ("other_entry_kept", {("cases", "other"): {"files": {"other.png": "0" * 64}}}, ACCEPT),
            ("format_1_refused", {("format",): DELETE}, "format"),
            ("misspelt_entry_key", {("cases", CASE, "fingerprnt"): "0" * 64}, f"cases.{CASE}.fingerprnt"),
        ],
    ),
    *mutations(
        "contract_cases",
        [
            ("backend_unknown", {(*C, "backend"): "flashy"}, "cases.uly.backend"),
            ("backend_number", {(*C, "backend"): 3}, "cases.uly.backend"),
            ("backend_math_kept", {(*C, "backend"): "math"}, ACCEPT),
            ("backend_alias_kept", {(*C, "backend"): "TORCH_SDPA"}, ACCEPT),
            ("sdpa_kernel_unknown", {(*C, "sdpa_kernel"): "flashy"}, "cases.uly.sdpa_kernel"),
            ("sdpa_kernel_with_math", {(*C, "backend"): "math", (*C, "sdpa_kernel"): "flash"}, "cases.uly.sdpa_kernel"),
            ("sdpa_kernel_kept", {(*C, "sdpa_kernel"): "efficient"}, ACCEPT),
            ("world_size_4096", {(*C, "world_size"): 4096}, "cases.uly.world_size"),
            ("world_size_1025", {(*C, "world_size"): 1025, (*C, "heads"): 1025}, "cases.uly.world_size"),
            ("world_size_zero", {(*C, "world_size"): 0}, "cases.uly.world_size"),
            ("world_size_float", {(*C, "world_size"): 2.0}, "cases.uly.world_size"),
            ("world_size_nan", {(*C, "world_size"): math.nan}, "cases.uly.world_size"),
            ("tokens_per_rank_1e9", {(*C, "tokens_per_rank"): 10**9}, "cases.uly.tokens_per_rank"),
            ("heads_1e6", {(*C, "heads"): 10**6}, "cases.uly.heads"),
            ("head_dim_zero", {(*C, "head_dim"): 0}, "cases.uly.head_dim"),
            ("seed_2_pow_63", {(*C, "seed"): 2**63}, "cases.uly.seed"),
            ("bound_abs_inf", {(*C, "bound"): "abs:inf"}, "cases.uly.bound"),
            ("bound_abs_nan", {(*C, "bound"): "abs:nan"}, "cases.uly.bound"),
            (
                "matrix_10_pow_10",
                {("cases", "grid", "matrix"): {f"axis{i}": list(range(10)) for i in range(10)}},
                "cases.grid.matrix",
            ),
            ("matrix_1025", {("cases", "grid", "matrix"): {"seed": list(range(1025))}}, "cases.grid.matrix"),
            ("matrix_64_kept", {("cases", "grid", "matrix"): {"seed": list(range(64))}}, ACCEPT),
            ("matrix_empty_axis", {("cases", "grid", "matrix"): {"seed": []}}, "cases.grid.matrix.seed"),
            (
                "case_id_300_chars",
                {("cases", "u" * 300): {"contract": "usp.ulysses_parity", "world_size": 1}},
                "cases." + "u" * 300,
            ),
            ("case_id_escape", {("cases", "../x"): {"contract": "usp.ulysses_parity", "world_size": 1}}, "cases.../x"),
            ("contract_unknown", {(*C, "contract"): "usp.nope"}, "cases.uly.contract"),
            ("dtype_unknown", {("defaults", "dtype"): "fp8"}, "cases.uly.dtype"),
        ],
    ),
    *mutations(
        "contract_overlay",
        [
            ("unknown_table", {("extra",): {"a": 1}}, "extra"),
            ("glob_matches_nothing", {("overrides", "nothing*"): {"bound": "bitwise"}}, "overrides.nothing*"),
            ("backend_unknown", {("overrides", "uly*", "backend"): "flashy"}, "cases.uly.backend"),
            ("world_size_4096", {("overrides", "uly*", "world_size"): 4096}, "cases.uly.world_size"),
        ],
    ),
    *mutations(
        "image_cases",
        [
            ("flow_shift_nan", {(*IM, "flow_shift"): math.nan}, "cases.case_a.flow_shift"),
            ("flow_shift_inf", {(*IM, "flow_shift"): math.inf}, "cases.case_a.flow_shift"),
            ("flow_shift_negative", {(*IM, "flow_shift"): -1.0}, "cases.case_a.flow_shift"),
            (
                "flow_shift_nan_default",
                {("defaults", "flow_shift"): math.nan, (*IM, "flow_shift"): DELETE},
                "defaults.flow_shift",
            ),
            ("flow_shift_huge_int", {(*IM, "flow_shift"): 2**62}, ACCEPT),
            ("height_1e9", {(*IM, "height"): 10**9}, "cases.case_a.height"),
            ("width_2_pow_70", {(*IM, "width"): 2**70}, "cases.case_a.width"),
            ("steps_1e6", {(*IM, "steps"): 10**6}, "cases.case_a.steps"),
            ("steps_zero", {(*IM, "steps"): 0}, "cases.case_a.steps"),
            ("num_frames_1e6", {(*IM, "num_frames"): 10**6}, "cases.case_a.num_frames"),
            ("world_size_4096", {(*IM, "world_size"): 4096}, "cases.case_a.world_size"),
            ("world_size_2_kept", {(*IM, "world_size"): 2}, ACCEPT),
            ("seed_negative_kept", {(*IM, "seed"): -1}, ACCEPT),
            ("prompt_10k_kept", {(*IM, "prompt"): "fox " * 2500}, ACCEPT),
            ("dtype_unknown", {(*IM, "dtype"): "fp8"}, "cases.case_a.dtype"),
            ("unknown_field", {(*IM, "stepz"): 3}, "cases.case_a.stepz"),
            ("case_id_300_chars", {("cases", "i" * 300): {"world_size": 1}}, "cases." + "i" * 300),
            ("case_id_escape", {("cases", "../x"): {"world_size": 1}}, "cases.../x"),
            ("case_id_dot_first", {("cases", ".hidden"): {"world_size": 1}}, "cases..hidden"),
        ],
    ),
    *[
        h
        for name in ("policy_json", "policy_toml")
        for h in mutations(
            name,
            [
                ("psnr_margin_1e308", {("psnr", "margin"): 1e308}, "psnr.margin"),
                ("mad_margin_1e308", {("mean_abs_diff", "margin"): 1e308}, "mean_abs_diff.margin"),
                ("mad_floor_300", {("mean_abs_diff", "floor"): 300}, "mean_abs_diff.floor"),
                ("margin_negative", {("clip", "margin"): -0.1}, "clip.margin"),
                ("clip_cap_1_5", {("clip", "cap"): 1.5}, "clip.cap"),
                ("psnr_cap_nan", {("psnr", "cap"): math.nan}, "psnr.cap"),
                ("psnr_cap_40_kept", {("psnr", "cap"): 40}, ACCEPT),
                ("unknown_metric", {("pnsr",): {"margin": 1}}, "pnsr"),
                ("unknown_key", {("psnr", "floor"): 1}, "psnr.floor"),
                ("section_number", {("ssim",): 3}, "ssim"),
            ],
        )
    ],
    *mutations(
        "results",
        [
            ("psnr_minus_5", {("cases", CASE, "metrics", "psnr"): -5}, "cases.case_a.metrics.psnr"),
            ("psnr_1e308", {("cases", CASE, "metrics", "psnr"): 1e308}, "cases.case_a.metrics.psnr"),
            ("psnr_nan_string", {("cases", CASE, "metrics", "psnr"): "nan"}, "cases.case_a.metrics.psnr"),
            ("psnr_finite_kept", {("cases", CASE, "metrics", "psnr"): 48.5}, ACCEPT),
            ("ssim_5", {("cases", CASE, "metrics", "ssim"): 5}, "cases.case_a.metrics.ssim"),
            ("ssim_inf_string", {("cases", CASE, "metrics", "ssim"): "inf"}, "cases.case_a.metrics.ssim"),
            ("ssim_minus_1_kept", {("cases", CASE, "metrics", "ssim"): -1}, ACCEPT),
            ("clip_minus_3", {("cases", CASE, "metrics", "clip"): -3}, "cases.case_a.metrics.clip"),
            ("mad_minus_1", {("cases", CASE, "metrics", "mean_abs_diff"): -1}, "cases.case_a.metrics.mean_abs_diff"),
            ("mad_1e308", {("cases", CASE, "metrics", "mean_abs_diff"): 1e308}, "cases.case_a.metrics.mean_abs_diff"),
            ("mad_255_kept", {("cases", CASE, "metrics", "mean_abs_diff"): 255}, ACCEPT),
            ("metric_missing", {("cases", CASE, "metrics", "ssim"): DELETE}, "cases.case_a.metrics.ssim"),
            ("passed_string", {("cases", CASE, "passed"): "yes"}, "cases.case_a.passed"),
            ("kind_audio", {("cases", CASE, "kind"): "audio"}, "cases.case_a.kind"),
            ("cases_missing", {("cases",): DELETE}, "cases"),
            (
                "case_id_300_chars",
                {("cases", "r" * 300): {"kind": "image", "passed": True, "metrics": {}}},
                "cases." + "r" * 300,
            ),
            ("perf_e2e_negative", {("perf", CASE, "expected_e2e_ms"): -1}, "perf.case_a.expected_e2e_ms"),
            ("perf_e2e_1e308", {("perf", CASE, "expected_e2e_ms"): 1e308}, "perf.case_a.expected_e2e_ms"),
            ("perf_e2e_inf_string", {("perf", CASE, "expected_e2e_ms"): "inf"}, "perf.case_a.expected_e2e_ms"),
            (
                "perf_step_key_5000_digits",
                {("perf", CASE, "denoise_step_ms", "9" * 5000): 1.0},
                "perf.case_a.denoise_step_ms",
            ),
            (
                "perf_stage_nan",
                {("perf", CASE, "stages_ms", "DenoisingStage"): math.nan},
                "perf.case_a.stages_ms.DenoisingStage",
            ),
            ("perf_new_scenario_kept", {("perf", "other"): {"expected_e2e_ms": 3.0}}, ACCEPT),
            ("platform_number", {("platform",): 5}, "platform"),
        ],
    ),
    *mutations(
        "sweep",
        [
            ("max_abs_nan", {("cells", "0", "figures", "max_abs"): math.nan}, "cells.0.figures.max_abs"),
            ("max_abs_nan_string_on_pass", {("cells", "0", "figures", "max_abs"): "nan"}, "cells.0.figures.max_abs"),
            ("max_abs_word", {("cells", "0", "figures", "max_abs"): "small"}, "cells.0.figures.max_abs"),
            ("max_abs_negative", {("cells", "0", "figures", "max_abs"): -1}, "cells.0.figures.max_abs"),
            ("max_abs_large_kept", {("cells", "1", "figures", "max_abs"): 1e30}, ACCEPT),
            ("bitwise_string", {("cells", "0", "figures", "bitwise"): "yes"}, "cells.0.figures.bitwise"),
            ("figures_array", {("cells", "0", "figures"): []}, "cells.0.figures"),
            ("figures_null_kept", {("cells", "0", "figures"): None}, ACCEPT),
            ("status_unknown", {("cells", "0", "status"): "pass"}, "cells.0.status"),
            ("status_xfailed_kept", {("cells", "1", "status"): "xfailed"}, ACCEPT),
            ("contract_number", {("cells", "0", "contract"): 5}, "cells.0.contract"),
            ("backend_empty", {("cells", "0", "backend"): ""}, "cells.0.backend"),
            ("kernel_number", {("cells", "0", "kernel"): 5}, "cells.0.kernel"),
            ("world_size_string", {("cells", "0", "world_size"): "2"}, "cells.0.world_size"),
            ("cell_string", {("cells", "0"): "x"}, "cells.0"),
            ("cells_object", {("cells",): {}}, "cells"),
            ("kernel_ms_negative", {("kernels", "0", "median_ms"): -1}, "kernels.0.median_ms"),
            ("kernel_tflops_word", {("kernels", "0", "tflops"): "fast"}, "kernels.0.tflops"),
            ("kernel_shape_missing", {("kernels", "0", "shape"): DELETE}, "kernels.0.shape"),
            ("platform_string", {("platform",): "cpu"}, "platform"),
            ("platform_label_number", {("platform", "label"): 5}, "platform.label"),
            ("simulated_string", {("platform", "simulated"): "no"}, "platform.simulated"),
            ("schema_other", {("schema",): "parity.sweep/2"}, "schema"),
        ],
    ),
]


def _env(var: str, cases: list[tuple[str, dict[str, str], str | None]]) -> list[Hostile]:
    def setter(env: dict[str, str]):
        return lambda kind, project: project.env.update(env)

    return [Hostile(var, name, setter(env), expect) for name, env, expect in cases]


E2E, FLOOR = "PARITY_PERF_TOL_E2E", "PARITY_PERF_TOL_ABS_FLOOR_MS"
ENV_CASES = [
    *_env(
        "env_tolerances",
        [
            ("word", {E2E: "abc"}, E2E),
            ("nan", {E2E: "nan"}, E2E),
            ("inf", {E2E: "inf"}, E2E),
            ("negative", {E2E: "-1"}, E2E),
            ("1e308", {E2E: "1e308"}, E2E),
            ("hex", {E2E: "0x10"}, E2E),
            ("fraction_kept", {E2E: " 0.3 "}, ACCEPT),
            ("empty_kept", {E2E: ""}, ACCEPT),
            ("generous_kept", {E2E: "1e5"}, ACCEPT),
            ("unknown_name", {"PARITY_PERF_TOL_E2": "0.1"}, "PARITY_PERF_TOL_E2"),
            ("floor_1e9_kept", {FLOOR: "1e9"}, ACCEPT),
            ("floor_1e10", {FLOOR: "1e10"}, FLOOR),
            ("step_word", {"PARITY_PERF_TOL_DENOISE_STEP": "x"}, "PARITY_PERF_TOL_DENOISE_STEP"),
        ],
    ),
    *_env(
        "platform_env",
        [
            ("tpu", {"PARITY_PLATFORM": "tpu"}, "PARITY_PLATFORM"),
            ("cuda_arch", {"PARITY_PLATFORM": "cuda:sm90"}, "PARITY_PLATFORM"),
            ("rocm_path", {"PARITY_PLATFORM": "rocm:../x"}, "PARITY_PLATFORM"),
            ("rocm_empty_arch", {"PARITY_PLATFORM": "rocm:"}, "PARITY_PLATFORM"),
            ("rocm_gfx950_kept", {"PARITY_PLATFORM": "rocm:gfx950"}, ACCEPT),
            ("upper_case_kept", {"PARITY_PLATFORM": " ROCM:GFX942 "}, ACCEPT),
            ("cpu_kept", {"PARITY_PLATFORM": "cpu"}, ACCEPT),
            ("unset_kept", {}, ACCEPT),
        ],
    ),
]

CASES = (
    [h for kind in KINDS.values() if kind.fmt != "env" for h in file_level(kind)] + png_cases() + MUTATIONS + ENV_CASES
)


@contextmanager
def bounded_memory(extra: int = 2**30) -> Iterator[None]:
    """Cap this process's address space at its current size + ``extra``: an unbounded read fails fast."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    size = int(re.search(r"VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _named(message: str, key: str) -> bool:
    """The refusal's key is ``key`` or lies inside it (``_hostile.0.0...`` for a nesting under ``_hostile``)."""
    return f"key '{key}'" in message or f"key '{key}." in message


@pytest.mark.parametrize("hostile", CASES, ids=[h.id for h in CASES])
def test_hostile_input(hostile: Hostile, tmp_path: Path) -> None:
    kind = KINDS[hostile.kind]
    project = build_project(tmp_path)
    hostile.apply(kind, project)
    try:
        with bounded_memory():
            kind.load(project)
    except ConfigError as exc:
        message = str(exc)
        assert hostile.expect != ACCEPT, f"a legitimate input was refused: {message}"
        if kind.fmt == "env":
            where = f"key '{next(iter(project.env))}'"
        elif hostile.where:
            where = str(project.root / hostile.where)
        elif hostile.name == "missing":
            where = str(kind.path(project).parent)  # a case directory without its file: the directory is named
        else:
            where = str(kind.path(project))
        assert where in message, f"the refusal does not name {where}: {message}"
        if hostile.expect:
            assert _named(message, hostile.expect), f"the refusal does not name key {hostile.expect!r}: {message}"
    except Exception:  # noqa: BLE001 - a traceback is exactly what this test exists to catch
        pytest.fail(f"traceback instead of a ConfigError:\n{traceback.format_exc()}")
    else:
        assert hostile.expect == ACCEPT, f"wrongly accepted (expected a refusal naming {hostile.expect or 'the file'})"


def test_the_matrix_covers_15_kinds_and_every_outcome() -> None:
    kinds = {h.kind for h in CASES}
    assert kinds == set(KINDS) and len(kinds) == 15
    assert sum(h.expect == ACCEPT for h in CASES) >= 60 and sum(h.expect != ACCEPT for h in CASES) >= 400


# ------------------------------------------------------------------------------ the real CLI


def _cli(args: list[str], tmp_path: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", *args],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )


CLI = [
    (
        "contract_backend",
        lambda p: KINDS["contract_cases"].write(
            p,
            {
                **KINDS["contract_cases"].valid,
                "cases": {"uly": {**KINDS["contract_cases"].valid["cases"]["uly"], "backend": "flashy"}},
            },
        ),
        ["check", "--cases", "{cases}"],
        "cases/contracts/c.toml",
        "cases.uly.backend",
    ),
    (
        "contract_world_size",
        lambda p: KINDS["contract_cases"].write(
            p,
            {
                **KINDS["contract_cases"].valid,
                "cases": {"uly": {**KINDS["contract_cases"].valid["cases"]["uly"], "world_size": 4096}},
            },
        ),
        ["check", "--cases", "{cases}"],
        "cases/contracts/c.toml",
        "cases.uly.world_size",
    ),
    (
        "image_flow_shift_nan",
        lambda p: KINDS["image_cases"].write(
            p, {**KINDS["image_cases"].valid, "cases": {CASE: {"world_size": 1, "flow_shift": math.nan}}}
        ),
        ["gate", "--cases", "{cases}", "--baselines", "{baselines}"],
        "cases/images/i.toml",
        "cases.case_a.flow_shift",
    ),
    (
        "threshold_overlay_fifo",
        None,
        ["gate", "--cases", "{cases}", "--baselines", "{baselines}"],
        "baselines/platforms/{platform}.json",
        None,
    ),
    (
        "perf_overlay_dangling",
        None,
        ["gate", "--perf", "--cases", "{cases}", "--baselines", "{baselines}"],
        "baselines/platforms/perf/{platform}.json",
        None,
    ),
    (
        "sweep_nan",
        lambda p: KINDS["sweep"].path(p).write_text(KINDS["sweep"].text().replace('"max_abs": 0.0', '"max_abs": NaN')),
        ["matrix", "{root}/sweep.json"],
        "sweep.json",
        "cells.0.figures.max_abs",
    ),
    (
        "results_psnr_minus_5",
        lambda p: KINDS["results"].path(p).write_text(KINDS["results"].text().replace('"psnr": "inf"', '"psnr": -5')),
        ["recalibrate", "thresholds", "--results", "{root}/results.json", "--baselines", "{baselines}"],
        "results.json",
        "cases.case_a.metrics.psnr",
    ),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("name", "setup", "args", "file", "key"), CLI, ids=[c[0] for c in CLI])
def test_cli_exits_2_naming_file_and_key(
    name: str, setup, args: list[str], file: str, key: str | None, tmp_path: Path
) -> None:
    from harness.baselines.platforms import platform_name

    project = build_project(tmp_path)
    platform = platform_name("cpu")
    if name == "threshold_overlay_fifo":
        os.mkfifo(project.baselines / "platforms" / f"{platform}.json")
    elif name == "perf_overlay_dangling":
        (project.baselines / "platforms" / "perf" / f"{platform}.json").symlink_to("gone.json")
    else:
        setup(project)
    fields = {"cases": project.cases, "baselines": project.baselines, "root": project.root, "platform": platform}
    done = _cli([a.format(**fields) for a in args], tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert str(project.root / file.format(**fields)) in done.stderr, done.stderr
    assert "contracts:" not in done.stdout  # refused before the first stage ran a case
    if key:
        assert f"key '{key}'" in done.stderr, done.stderr


def test_platform_env_is_refused_by_the_cli_before_any_verb(tmp_path: Path) -> None:
    done = _cli(["doctor"], tmp_path, {"PARITY_PLATFORM": "tpu"})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert (
        "key 'PARITY_PLATFORM': unknown platform 'tpu'" in done.stderr and "valid: cuda, rocm, mps, cpu" in done.stderr
    )


@pytest.mark.timeout(120)
def test_an_image_case_directory_that_is_a_fifo_is_an_error_not_no_cases(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from harness.cli import main

    project = build_project(tmp_path)
    images = project.cases / "images"
    shutil.rmtree(images)
    os.mkfifo(images)  # was: "images: skipped (no image cases)", and the gate passed without them
    assert main(["gate", "--cases", str(project.cases), "--baselines", str(project.baselines)]) == 2
    assert f"{images}: exists but is a FIFO (named pipe), not a directory" in capsys.readouterr().err


def test_thresholds_absent_overlay_means_base_alone(tmp_path: Path) -> None:
    """The counterpart of the overlay refusals: nothing at the overlay path is the legitimate 'no overlay'."""
    from harness.baselines.thresholds import ThresholdSet

    project = build_project(tmp_path)
    KINDS["threshold_overlay"].path(project).unlink()
    assert ThresholdSet.for_platform(project.baselines, PLATFORM).for_case(CASE).psnr == 25.0
