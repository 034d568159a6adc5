"""Case files: the default set, matrix expansion, and refusal of bad files naming file, case and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.cases import load_case_file, load_cases
from harness.contracts.case import with_overrides
from harness.errors import ConfigError
from harness.paths import default_cases_dir

SGLANG = {"batch": 1, "tokens_per_rank": 64, "heads": 30, "head_dim": 128, "replicated": 6, "dtype": "bf16"}


def test_default_set_covers_sglang_world_sizes_dtypes_causal_and_gqa():
    cases = load_cases(default_cases_dir())
    by_id = {c.id: c for c in cases}
    assert by_id["sglang_suffix_w4"].world_size == 4 and by_id["sglang_suffix_w4"].params["heads"] == 32
    assert {c.world_size for c in cases} == {1, 2, 3, 4}  # 3: a ring direction bug shows from ring degree 3
    assert {c.params.get("ring_degree") for c in cases} >= {2, 3, 4}
    assert any(c.params.get("softmax_scale") for c in cases)  # scale.toml: a non-default scale on every path
    numeric = [c for c in cases if "dtype" in c.params]
    assert {c.params["dtype"] for c in numeric} >= {"fp32", "bf16"}
    assert {c.params["causal"] for c in numeric if "causal" in c.params} == {False, True}
    assert any(c.params.get("kv_heads", 0) < c.params.get("heads", 0) for c in cases)
    hybrid = [c for c in cases if c.contract_id == "usp.hybrid_parity"]
    assert hybrid and all((c.params["ulysses_degree"], c.params["ring_degree"]) == (2, 2) for c in hybrid)
    contracts = {c.contract_id for c in cases}
    assert contracts >= {
        "usp.replicated_suffix_bitwise",
        "usp.replicated_prefix_drift",
        "usp.replicated_kv_prefix",
        "usp.ulysses_parity",
        "usp.ring_parity",
        "usp.hybrid_parity",
        "usp.varlen_parity",
        "usp.masked_parity",
        "usp.masked_rejects_replicated",
        "usp.ring_admission",
        "usp.skip_sequence_parallel_local",
        "backend.selection_precedence",
    }


@pytest.mark.parametrize(
    ("cid", "contract"),
    [("sglang_suffix_w2", "usp.replicated_suffix_bitwise"), ("sglang_prefix_w2", "usp.replicated_prefix_drift")],
)
def test_default_set_has_sglangs_own_case(cid, contract):
    case = {c.id: c for c in load_cases(default_cases_dir())}[cid]
    assert case.contract_id == contract
    assert case.world_size == 2
    assert {k: case.params[k] for k in SGLANG} == SGLANG


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    return path


def test_matrix_expands_and_defaults_apply(tmp_path):
    path = _write(
        tmp_path,
        """
[defaults]
dtype = "bf16"
[cases.u]
contract = "usp.ulysses_parity"
matrix = { world_size = [1, 2], causal = [false, true] }
""",
    )
    cases = load_case_file(path)
    assert [c.id for c in cases] == [
        "u[world_size=1,causal=false]",
        "u[world_size=1,causal=true]",
        "u[world_size=2,causal=false]",
        "u[world_size=2,causal=true]",
    ]
    assert {c.params["dtype"] for c in cases} == {"bf16"}
    assert cases[3].params["ulysses_degree"] == 2 and cases[3].params["tokens"] == 32


BAD = [
    (
        "unknown contract",
        '[cases.x]\ncontract = "usp.nope"\nworld_size = 2\n',
        "cases.x.contract",
        "unknown contract 'usp.nope'",
    ),
    (
        "wrong type",
        '[cases.x]\ncontract = "usp.ulysses_parity"\nworld_size = "two"\n',
        "cases.x.world_size",
        "expected int, got str",
    ),
    (
        "missing key",
        '[cases.x]\ncontract = "usp.ulysses_parity"\nheads = 4\n',
        "cases.x.world_size",
        "missing required parameter",
    ),
    (
        "unknown key",
        '[cases.x]\ncontract = "usp.ulysses_parity"\nworld_size = 2\nhead = 4\n',
        "cases.x.head",
        "unknown parameter",
    ),
    (
        "tokens not divisible",
        '[cases.x]\ncontract = "usp.ulysses_parity"\nworld_size = 4\ntokens = 30\n',
        "cases.x.tokens",
        "30 tokens are not divisible by world_size 4",
    ),
    (
        "heads not divisible",
        '[cases.x]\ncontract = "usp.replicated_suffix_bitwise"\nworld_size = 4\nheads = 30\n',
        "cases.x.heads",
        "30 heads are not divisible by the Ulysses degree 4",
    ),
    (
        "kv heads not divisible",
        '[cases.x]\ncontract = "usp.hybrid_parity"\nworld_size = 4\nheads = 8\nkv_heads = 1\n',
        "cases.x.kv_heads",
        "not divisible by the Ulysses degree 2",
    ),
    (
        "degrees",
        '[cases.x]\ncontract = "usp.hybrid_parity"\nworld_size = 4\nring_degree = 3\n',
        "cases.x.ulysses_degree",
        "must equal world_size (4)",
    ),
    (
        "bad dtype",
        '[cases.x]\ncontract = "usp.ring_parity"\nworld_size = 2\ndtype = "fp8"\n',
        "cases.x.dtype",
        "unknown dtype 'fp8'",
    ),
    ("bad bound", '[cases.x]\ncontract = "usp.ring_parity"\nworld_size = 2\nbound = "fa:x"\n', "cases.x.bound", "fa:x"),
    (
        "too few ranks",
        '[cases.x]\ncontract = "usp.ring_parity"\nworld_size = 1\n',
        "cases.x.world_size",
        "needs world_size >= 2",
    ),
    (
        "seq_lens",
        '[cases.x]\ncontract = "usp.varlen_parity"\nworld_size = 2\nseq_lens = [4]\n',
        "cases.x.seq_lens",
        "one length per rank",
    ),
    ("toml syntax", "[cases.x\ncontract = 1\n", None, "invalid TOML"),
    ("no cases", '[defaults]\ndtype = "bf16"\n', "cases", "no cases"),
    ("unknown table", '[case.x]\ncontract = "usp.ulysses_parity"\n', "case", "unknown top-level table"),
]


@pytest.mark.parametrize("label,text,key,message", BAD, ids=[b[0] for b in BAD])
def test_bad_case_files_are_refused_naming_file_case_and_key(tmp_path, label, text, key, message):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_case_file(path)
    assert info.value.path == str(path)
    assert info.value.key == key
    assert message in str(info.value)
    assert str(path) in str(info.value)
    if key and key.startswith("cases.x"):
        assert "case 'x'" in str(info.value)


def test_a_bad_value_from_defaults_says_so(tmp_path):
    path = _write(tmp_path, '[defaults]\nheads = 6\n[cases.x]\ncontract = "usp.ulysses_parity"\nworld_size = 4\n')
    with pytest.raises(ConfigError, match=r"value from \[defaults\]") as info:
        load_case_file(path)
    assert info.value.key == "cases.x.heads"


def test_defaults_apply_where_the_contract_has_the_parameter(tmp_path):
    path = _write(
        tmp_path,
        '[defaults]\nreplicated = 3\n[cases.s]\ncontract = "usp.replicated_suffix_bitwise"\nworld_size = 2\n'
        '[cases.u]\ncontract = "usp.ulysses_parity"\nworld_size = 2\n',
    )
    suffix, ulysses = load_case_file(path)
    assert suffix.params["replicated"] == 3 and "replicated" not in ulysses.params
    typo = _write(tmp_path, '[defaults]\nreplicatd = 3\n[cases.u]\ncontract = "usp.ulysses_parity"\nworld_size = 2\n')
    with pytest.raises(ConfigError, match="applies to no case") as info:
        load_case_file(typo)
    assert info.value.key == "defaults.replicatd"


def test_duplicate_ids_across_files_are_refused(tmp_path):
    for name in ("a.toml", "b.toml"):
        (tmp_path / name).write_text('[cases.same]\ncontract = "usp.ulysses_parity"\nworld_size = 1\n')
    with pytest.raises(ConfigError, match=r"also defined in .*a\.toml") as info:
        load_cases(tmp_path)
    assert info.value.path.endswith("b.toml")


def test_overrides_are_revalidated(tmp_path):
    path = _write(
        tmp_path,
        '[cases.x]\ncontract = "usp.ulysses_parity"\nworld_size = 2\n[cases.y]\ncontract = "backend.selection_precedence"\n',
    )
    cases = with_overrides(load_case_file(path), dtype="bf16", backend="math")
    assert cases[0].params["dtype"] == "bf16" and cases[0].params["backend"] == "math"
    assert cases[1].params["dtype"] == "bf16" and "backend" not in cases[1].params
    with pytest.raises(ConfigError) as info:
        with_overrides(load_case_file(path), dtype="int8")
    assert info.value.key == "cases.x.dtype"


def test_platform_overlay_changes_only_matching_cases_on_that_platform(tmp_path):
    from harness.cases import load_cases
    from harness.paths import default_cases_dir

    base = {c.id: c for c in load_cases(default_cases_dir())}
    cuda = {c.id: c for c in load_cases(default_cases_dir(), "cuda")}
    assert set(base) == set(cuda)
    changed = {i for i in base if base[i].params != cuda[i].params}
    assert changed and all("dtype=fp32" in i and i.startswith(("zimage_sp", "hunyuan_sp")) for i in changed)
    assert all(cuda[i].params["bound"] == "fa:2" for i in changed)


def test_platform_overlay_errors_name_file_and_key(tmp_path):
    import shutil

    import pytest

    from harness.cases import load_cases
    from harness.errors import ConfigError
    from harness.paths import default_cases_dir

    root = tmp_path / "cases"
    shutil.copytree(default_cases_dir() / "contracts", root / "contracts")
    overlay = root / "contracts" / "platforms" / "cuda.toml"
    overlay.write_text('[overrides."nothing_like_this*"]\nbound = "fa:2"\n')
    with pytest.raises(ConfigError, match=r"cuda.toml.*overrides.nothing_like_this\*.*matches no case"):
        load_cases(root, "cuda")
    overlay.write_text('[overrides."zimage_sp*"]\nbound = 3\n')
    with pytest.raises(ConfigError, match="cuda.toml"):
        load_cases(root, "cuda")
