"""Qwen3 text encoder: parity with transformers' Qwen3Model, masked causal semantics, loading errors."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.contracts.model_checks import judge_masked_causal
from harness.targets.reference.encoder import check_masked_causal_lengths
from reference_impl.attention.backends import AttentionBackendEnum
from reference_impl.attention.selector import attention_backend_config
from reference_impl.forward_context import set_forward_context
from reference_impl.models.layers import ModelConfigError
from reference_impl.models.qwen3 import CausalMaskPlan, Qwen3TextEncoder

transformers = pytest.importorskip("transformers")

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
)
LENGTHS = [7, 3, 10]
# fp32 max abs difference from transformers on valid tokens, every hidden state; measured 1.9e-6.
HF_BOUND = 1e-5


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights that make every tensor matter (transformers initialises norms to exactly 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))


def _save(model: torch.nn.Module, directory: Path, **kwargs) -> Path:
    model.save_pretrained(str(directory), safe_serialization=True, **kwargs)
    return directory


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = transformers.Qwen3Model(transformers.Qwen3Config(**TINY)).eval()
    _randomize(model, 0)
    return _save(model, tmp_path_factory.mktemp("qwen3")), model


def _inputs(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    seq = max(lengths)
    ids = torch.randint(0, TINY["vocab_size"], (len(lengths), seq), generator=torch.Generator().manual_seed(seed))
    return ids, (torch.arange(seq)[None] < torch.tensor(lengths)[:, None]).long()


def _encode(enc: Qwen3TextEncoder, ids: torch.Tensor, mask: torch.Tensor | None, hidden: bool = False):
    with torch.no_grad(), set_forward_context():
        return enc(ids, mask, output_hidden_states=hidden)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def test_every_hidden_state_matches_transformers_on_valid_tokens(hf) -> None:
    directory, ref_model = hf
    enc = Qwen3TextEncoder.from_pretrained(directory)
    ids, mask = _inputs(LENGTHS)
    out = _encode(enc, ids, mask, hidden=True)
    with torch.no_grad():
        ref = ref_model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert len(out.hidden_states) == len(ref.hidden_states) == TINY["num_hidden_layers"] + 1
    assert torch.equal(out.hidden_states[-1], out.last_hidden_state)
    pairs = list(zip((*out.hidden_states, out.last_hidden_state), (*ref.hidden_states, ref.last_hidden_state)))
    errors = {
        (layer, row): _max_abs(ours[row, :n], theirs[row, :n])
        for layer, (ours, theirs) in enumerate(pairs)
        for row, n in enumerate(LENGTHS)
    }
    assert {at: e for at, e in errors.items() if not e <= HF_BOUND} == {}  # (hidden state, row): error past the bound


def test_padding_rows_also_match_transformers_under_right_padding(hf) -> None:
    """A padding query sits after every valid key, so transformers' causal+padding mask lets it see
    exactly the valid keys: the same rule as ours (non-causal over valid keys)."""
    directory, ref_model = hf
    ids, mask = _inputs(LENGTHS)
    out = _encode(Qwen3TextEncoder.from_pretrained(directory), ids, mask).last_hidden_state
    with torch.no_grad():
        ref = ref_model(input_ids=ids, attention_mask=mask).last_hidden_state
    errors = {row: _max_abs(out[row, n:], ref[row, n:]) for row, n in enumerate(LENGTHS) if n < ids.shape[1]}
    assert errors and {row: e for row, e in errors.items() if not e <= HF_BOUND} == {}


def test_all_full_batch_takes_plain_causal_and_matches_transformers(hf) -> None:
    directory, ref_model = hf
    enc = Qwen3TextEncoder.from_pretrained(directory)
    ids, mask = _inputs([9, 9])
    assert CausalMaskPlan.from_lengths(mask.sum(-1), 9).mask is None
    no_mask = _encode(enc, ids, None).last_hidden_state
    assert torch.equal(no_mask, _encode(enc, ids, mask).last_hidden_state)
    with torch.no_grad():
        assert _max_abs(no_mask, ref_model(input_ids=ids).last_hidden_state) <= HF_BOUND


def test_zero_length_row_is_finite_and_leaves_other_rows_exact(hf) -> None:
    directory, ref_model = hf
    ids, mask = _inputs([0, 5, 10])
    out = _encode(Qwen3TextEncoder.from_pretrained(directory), ids, mask).last_hidden_state
    assert torch.isfinite(out).all()
    with torch.no_grad():
        ref = ref_model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert _max_abs(out[1, :5], ref[1, :5]) <= HF_BOUND
    assert _max_abs(out[2], ref[2]) <= HF_BOUND


@pytest.mark.parametrize("backend", [None, "math"])
def test_masked_causal_attention_against_explicit_reference(backend: str | None) -> None:
    figures = check_masked_causal_lengths(lengths=(7, 3, 10, 0, 1), backend=backend)
    assert judge_masked_causal(figures)[0] == [], figures
    assert figures.backend_masked == (backend or "torch_sdpa")


def test_mask_plan_rows() -> None:
    plan = CausalMaskPlan.from_lengths(torch.tensor([3, 0, 4]), 4)
    m = plan.mask[:, 0].int()
    assert m[0].tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 0],
    ]  # last row: padding, all valid keys
    assert m[2].tolist() == torch.ones(4, 4).tril().int().tolist()
    assert plan.empty_rows.tolist() == [False, True, False]
    with pytest.raises(ValueError, match="lengths"):
        CausalMaskPlan.from_lengths(torch.tensor([5]), 4)


def test_backend_override_reaches_the_encoder(hf) -> None:
    directory, _ = hf
    with attention_backend_config("text_encoder=math"):
        enc = Qwen3TextEncoder.from_pretrained(directory)
    attn = enc.layers[0].self_attn.attn
    assert attn.causal.backend is attn.masked.backend is AttentionBackendEnum.MATH
    ids, mask = _inputs(LENGTHS)
    default = _encode(Qwen3TextEncoder.from_pretrained(directory), ids, mask).last_hidden_state
    assert _max_abs(_encode(enc, ids, mask).last_hidden_state, default) <= HF_BOUND


def test_causal_lm_checkpoint_loads_its_base_model(tmp_path: Path) -> None:
    lm = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY)).eval()
    _randomize(lm, 1)
    enc = Qwen3TextEncoder.from_pretrained(_save(lm, tmp_path))  # model.* names; lm_head unused
    ids, mask = _inputs(LENGTHS, seed=1)
    out = _encode(enc, ids, mask).last_hidden_state
    with torch.no_grad():
        ref = lm.model(input_ids=ids, attention_mask=mask).last_hidden_state
    errors = {row: _max_abs(out[row, :n], ref[row, :n]) for row, n in enumerate(LENGTHS)}
    assert {row: e for row, e in errors.items() if not e <= HF_BOUND} == {}


def test_sharded_checkpoint_loads_like_a_single_file(hf, tmp_path: Path) -> None:
    directory, ref_model = hf
    sharded = _save(ref_model, tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    ids, mask = _inputs(LENGTHS)
    a = _encode(Qwen3TextEncoder.from_pretrained(sharded), ids, mask).last_hidden_state
    assert torch.equal(a, _encode(Qwen3TextEncoder.from_pretrained(directory), ids, mask).last_hidden_state)


def test_packed_projections_load_through_the_shard_weight_loader(hf) -> None:
    directory, ref_model = hf
    enc = Qwen3TextEncoder.from_pretrained(directory)
    ours, theirs = enc.layers[1], ref_model.layers[1]
    qkv = ours.self_attn.qkv_proj
    assert qkv.weight.weight_loader == qkv.weight_loader and qkv.shard_ids == ("q", "k", "v")
    a = theirs.self_attn
    assert torch.equal(qkv.weight, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
    assert torch.equal(
        ours.mlp.gate_up_proj.weight, torch.cat([theirs.mlp.gate_proj.weight, theirs.mlp.up_proj.weight])
    )


def _edited(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_tensor_is_named(hf, tmp_path: Path) -> None:
    directory, _ = hf
    bad = _edited(directory, tmp_path / "bad", lambda t: t.pop("layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks tensors: layers\.1\.self_attn\.k_proj\.weight"):
        Qwen3TextEncoder.from_pretrained(bad)


def test_misshapen_tensor_is_named(hf, tmp_path: Path) -> None:
    directory, _ = hf

    def shrink(t: dict) -> None:
        t["layers.0.self_attn.v_proj.weight"] = t["layers.0.self_attn.v_proj.weight"][:-1]

    bad = _edited(directory, tmp_path / "bad", shrink)
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.v_proj\.weight.*\[31, 64\].*\[32, 64\]"):
        Qwen3TextEncoder.from_pretrained(bad)


def test_unexpected_tensor_is_named(hf, tmp_path: Path) -> None:
    directory, _ = hf
    bad = _edited(directory, tmp_path / "bad", lambda t: t.update({"layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"layers\.0\.extra\.weight"):
        Qwen3TextEncoder.from_pretrained(bad)


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_parameters.rope_type"),
        ({"vocab_size": None}, "vocab_size"),
        ({"hidden_size": "64"}, "hidden_size"),
        ({"dtype": "int8"}, "dtype"),
        ({"use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_bad_config_names_the_key(hf, tmp_path: Path, edit: dict, key: str) -> None:
    directory, _ = hf
    bad = shutil.copytree(directory, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(edit)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError) as info:
        Qwen3TextEncoder.from_pretrained(bad)
    assert info.value.key == key and f"'{key}'" in str(info.value)


def test_left_padding_and_missing_context_are_refused(hf) -> None:
    directory, _ = hf
    enc = Qwen3TextEncoder.from_pretrained(directory)
    ids, mask = _inputs([3, 5])
    with pytest.raises(ValueError, match="right-padded"):
        _encode(enc, ids, mask.flip(-1))
    with pytest.raises(RuntimeError, match="forward context"):
        enc(ids, mask)
