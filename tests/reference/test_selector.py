"""Backend selection precedence, level by level: each level beats everything below it."""

from __future__ import annotations

import pytest
import torch

from reference_impl.attention.backends import AttentionBackendEnum as B
from reference_impl.attention.selector import (
    BackendConfig,
    attention_backend_config,
    attention_component,
    select_attn_backend,
)

FP32 = torch.float32


def pick(**kwargs):
    kwargs.setdefault("head_size", 64)
    kwargs.setdefault("dtype", FP32)
    return select_attn_backend(**kwargs)


def test_platform_default_on_cpu_is_sdpa():
    sel = pick()
    assert sel.enum is B.TORCH_SDPA and sel.level == "platform default"


def test_layer_default_beats_platform_default():
    assert pick(default_attention_backend=B.MATH).enum is B.MATH


def test_global_setting_beats_layer_default():
    with attention_backend_config("torch_sdpa"):
        sel = pick(default_attention_backend=B.MATH)
    assert sel.enum is B.TORCH_SDPA and sel.level == "global setting"


def test_component_override_beats_global_setting():
    with attention_backend_config("default=torch_sdpa,video_vae=math"), attention_component("video_vae"):
        sel = pick(default_attention_backend=B.TORCH_SDPA)
    assert sel.enum is B.MATH and sel.level == "component video_vae"


def test_component_role_override_beats_component_override():
    with attention_backend_config("dit=torch_sdpa,dit.cross=math"):
        cross = pick(component="dit", is_cross_attention=True)
        self_attn = pick(component="dit", is_cross_attention=False)
    assert cross.enum is B.MATH and cross.level == "component dit.cross"
    assert self_attn.enum is B.TORCH_SDPA


def test_global_force_beats_component_role_override():
    with attention_backend_config({"force": "math", "dit.cross": "torch_sdpa", "dit": "torch_sdpa"}):
        sel = pick(component="dit", is_cross_attention=True)
    assert sel.enum is B.MATH and sel.level == "force"


def test_explicit_argument_beats_force():
    with attention_backend_config("force=math"):
        sel = pick(backend="torch_sdpa")
    assert sel.enum is B.TORCH_SDPA and sel.level == "explicit"


def test_supported_set_filters_platform_default():
    assert pick(supported_attention_backends={B.MATH}).enum is B.MATH


def test_strict_component_override_outside_supported_set_is_an_error():
    with attention_backend_config("audio_vae=math"), attention_component("audio_vae"):
        with pytest.raises(ValueError, match="component audio_vae cannot be honoured.*supported set"):
            pick(supported_attention_backends={B.FA, B.TORCH_SDPA})


def test_strict_override_of_unavailable_backend_names_the_package():
    with attention_backend_config("video_vae=fa"):
        with pytest.raises(ValueError, match="flash-attn"):
            pick(component="video_vae")


def test_global_setting_that_cannot_serve_falls_back_and_records_why():
    with attention_backend_config("fa"):
        sel = pick(default_attention_backend=B.MATH)
    assert sel.enum is B.MATH and sel.level == "layer default"
    assert any("global setting fa passed over" in n and "flash-attn" in n for n in sel.notes)


def test_layer_default_outside_supported_set_falls_back_to_platform():
    sel = pick(supported_attention_backends={B.TORCH_SDPA}, default_attention_backend=B.MATH)
    assert sel.enum is B.TORCH_SDPA and sel.level == "platform default"
    assert sel.notes


def test_global_setting_with_unsupported_dtype_falls_back():
    with attention_backend_config("sage_attn"):
        sel = pick(dtype=torch.float32)
    assert sel.enum is B.TORCH_SDPA


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="valid names: torch_sdpa, fa, sage_attn, math"):
        BackendConfig.parse("text_encoder=flashy")
    with pytest.raises(ValueError, match="valid names"):
        pick(backend="nope")


def test_config_parsing_forms():
    cfg = BackendConfig.parse("text_encoder=torch_sdpa, video_vae=fa,force=math,default=torch_sdpa")
    assert cfg.overrides == {"text_encoder": B.TORCH_SDPA, "video_vae": B.FA}
    assert cfg.force is B.MATH and cfg.default is B.TORCH_SDPA
    assert BackendConfig.parse('{"video_vae": "math"}').overrides == {"video_vae": B.MATH}
    assert BackendConfig.parse("math").default is B.MATH
    with pytest.raises(ValueError, match="not KEY=NAME"):
        BackendConfig.parse("a=fa,oops")
    with pytest.raises(ValueError, match="not valid JSON"):
        BackendConfig.parse("{bad")


def test_no_backend_at_all_is_a_clear_error():
    with pytest.raises(ValueError, match="no attention backend can serve"):
        pick(supported_attention_backends={B.FA})
