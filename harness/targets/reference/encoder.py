"""Model checks of the text-encoder contracts (sglang seeds 002 and 003): figures only, judged in contracts.

Masked causal attention of the Qwen3 encoder against an fp64 per-row reference; admission of a
quantized checkpoint (counted reads: a refusal must come before any); packed q/k/v scales in their
shard of the fused parameter; the FP8 encoder against bf16. Each builds its own tiny checkpoint
(config.json + safetensors under Qwen3ForCausalLM names, written without transformers and
independently of the encoder's parameter table, so the loader is tested against the real layout).
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from harness.files.jsonio import read_json
from harness.targets.figures import Admission, Fp8Parity, MaskedCausal, PackedQkv, Rejection
from reference_impl.attention.selector import attention_backend_config
from reference_impl.forward_context import set_forward_context
from reference_impl.models.checkpoint import SafetensorsCheckpoint
from reference_impl.models.encoder_loader import ComponentCheckpointUnsupportedError, load_text_encoder
from reference_impl.models.qwen3 import CausalMaskPlan, MaskedCausalAttention, Qwen3TextEncoder
from reference_impl.quantization import dequantize_fp8, quantize_fp8, quantized_linear_layers

Tensor = torch.Tensor

TINY_QWEN3: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "hidden_act": "silu",
    "attention_bias": False,
    "dtype": "bfloat16",
}
# Small blocks so the tiny dims hold several: N boundaries (64, 96; 128) fall on 32-row blocks,
# K = 64 and 128 are not multiples of 48, so edge blocks are cropped.
TINY_BLOCK = (32, 48)

LINEAR_WEIGHTS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


# ---------------------------------------------------------------------------- tiny checkpoints
def qwen3_tensors(config: Mapping[str, Any], seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, Tensor]:
    """Random weights under Qwen3ForCausalLM names (``model.`` prefix, an ``lm_head``).

    q, k and v get different magnitudes (x1, x2, x3) so their per-tensor scales differ.
    """
    gen = torch.Generator().manual_seed(seed)
    h, d, inter = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]

    def rand(*shape: int, std: float) -> Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def norm(n: int) -> Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(dtype)

    shapes = {
        "self_attn.q_proj": (heads * d, h, 1.0),
        "self_attn.k_proj": (kv * d, h, 2.0),
        "self_attn.v_proj": (kv * d, h, 3.0),
        "self_attn.o_proj": (h, heads * d, 1.0),
        "mlp.gate_proj": (inter, h, 1.0),
        "mlp.up_proj": (inter, h, 1.0),
        "mlp.down_proj": (h, inter, 1.0),
    }
    tensors = {"model.embed_tokens.weight": rand(config["vocab_size"], h, std=1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for name, (n, k, gain) in shapes.items():
            tensors[f"{p}.{name}.weight"] = rand(n, k, std=gain / math.sqrt(k))
        tensors[f"{p}.self_attn.q_norm.weight"] = norm(d)
        tensors[f"{p}.self_attn.k_norm.weight"] = norm(d)
        tensors[f"{p}.input_layernorm.weight"] = norm(h)
        tensors[f"{p}.post_attention_layernorm.weight"] = norm(h)
    tensors["model.norm.weight"] = norm(h)
    tensors["lm_head.weight"] = rand(config["vocab_size"], h, std=1.0 / math.sqrt(h))
    return tensors


def is_linear_weight(name: str) -> bool:
    return name.startswith("model.layers.") and any(name.endswith(f".{w}.weight") for w in LINEAR_WEIGHTS)


def fp8_tensors(tensors: Mapping[str, Tensor], block_size: Sequence[int] | None) -> dict[str, Tensor]:
    """Every linear weight as FP8 + ``weight_scale_inv`` (per tensor, or per block); the rest unchanged."""
    out: dict[str, Tensor] = {}
    for name, tensor in tensors.items():
        if is_linear_weight(name):
            out[name], out[name.removesuffix(".weight") + ".weight_scale_inv"] = quantize_fp8(tensor, block_size)
        else:
            out[name] = tensor
    return out


def dequantized_tensors(
    tensors: Mapping[str, Tensor], block_size: Sequence[int] | None, dtype: torch.dtype
) -> dict[str, Tensor]:
    """The FP8 checkpoint's linear weights dequantized to ``dtype`` (its scales dropped)."""
    out: dict[str, Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight_scale_inv"):
            continue
        if is_linear_weight(name):
            scale = tensors[name.removesuffix(".weight") + ".weight_scale_inv"]
            out[name] = dequantize_fp8(tensor, scale, block_size, dtype)
        else:
            out[name] = tensor
    return out


def write_checkpoint(
    directory: str | Path,
    config: Mapping[str, Any],
    tensors: Mapping[str, Tensor],
    quantization_config: Mapping[str, Any] | None = None,
) -> Path:
    """config.json + model.safetensors in ``directory`` (created)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(config)
    if quantization_config is not None:
        cfg["quantization_config"] = dict(quantization_config)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def fp8_quantization_config(block_size: Sequence[int] | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
    if block_size is not None:
        cfg["weight_block_size"] = list(block_size)
    return cfg


def tiny_inputs(config: Mapping[str, Any], lengths: Sequence[int], seed: int = 0) -> tuple[Tensor, Tensor]:
    """``input_ids`` and a right-padded ``attention_mask`` for ``lengths`` (S = max length)."""
    seq = max(lengths)
    ids = torch.randint(0, config["vocab_size"], (len(lengths), seq), generator=torch.Generator().manual_seed(seed + 1))
    mask = (torch.arange(seq)[None] < torch.tensor(lengths)[:, None]).long()
    return ids, mask


def _encode(model: nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
    with torch.no_grad(), set_forward_context():
        return model(ids, mask).last_hidden_state


def _valid(t: Tensor, lengths: Sequence[int]) -> Tensor:
    return torch.cat([t[i, :n] for i, n in enumerate(lengths)]).double()


# ---------------------------------------------------------------------------- masked causal
def masked_causal_reference(q: Tensor, k: Tensor, v: Tensor, lengths: Sequence[int]) -> Tensor:
    """Row by row in fp64, from the definition: query i of a row of length n sees keys
    ``j <= i, j < n`` when ``i < n`` and keys ``j < n`` otherwise; n = 0 gives zeros."""
    b, s, h, d = q.shape
    rep = h // k.shape[2]
    out = torch.zeros(b, s, h, d, dtype=torch.float64)
    for row, n in enumerate(lengths):
        for i in range(s):
            keys = (i + 1 if i < n else n) if n else 0
            if not keys:
                continue
            for head in range(h):
                qi = q[row, i, head].double()
                kk, vv = k[row, :keys, head // rep].double(), v[row, :keys, head // rep].double()
                weights = torch.softmax(kk @ qi / math.sqrt(d), dim=0)
                out[row, i, head] = weights @ vv
    return out


def check_masked_causal_lengths(
    lengths: Sequence[int] = (7, 3, 10, 0, 1),
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    backend: str | None = None,
    seed: int = 0,
) -> MaskedCausal:
    """The encoder's masked causal attention vs the fp64 reference, for ``lengths`` and for an all-full batch."""
    seq = max(lengths)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(lengths), seq, num_heads, head_dim, generator=gen)
    k = torch.randn(len(lengths), seq, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(len(lengths), seq, num_kv_heads, head_dim, generator=gen)
    with attention_backend_config(f"text_encoder={backend}" if backend else None):
        attn = MaskedCausalAttention(num_heads, head_dim, num_kv_heads, torch.float32, "text_encoder")
    with set_forward_context():
        plan = CausalMaskPlan.from_lengths(torch.tensor(lengths), seq)
        out = attn(q, k, v, plan)
        full = [seq] * len(lengths)
        full_plan = CausalMaskPlan.from_lengths(torch.tensor(full), seq)
        out_full = attn(q, k, v, full_plan)
    ref = masked_causal_reference(q, k, v, lengths)
    ref_full = masked_causal_reference(q, k, v, full)
    zero_rows = [i for i, n in enumerate(lengths) if n == 0]
    return MaskedCausal(
        backend_masked=attn.masked.backend.value,
        backend_causal=attn.causal.backend.value,
        max_abs=(out.double() - ref).abs().max().item(),
        max_abs_full=(out_full.double() - ref_full).abs().max().item(),
        finite=bool(torch.isfinite(out).all()),
        zero_rows_exactly_zero=all(bool((out[i] == 0).all()) for i in zero_rows),
        full_batch_plain_causal=full_plan.mask is None,
    )


# ---------------------------------------------------------------------------- admission
class UnquantizedQwen3(Qwen3TextEncoder):
    """A native encoder that ignores the quant config: it builds no quantized linear, so admission must refuse it."""

    @classmethod
    def from_config(cls, hf_config, quant_config=None, dtype=None, component="text_encoder"):
        return super().from_config(hf_config, None, dtype, component)


class ForeignEncoder(nn.Module):
    """Not a native encoder (no NativeEncoderMixin): quantized checkpoints must be refused for it."""


def _rejection(directory: Path, model_cls: type, quantization_config: Mapping[str, Any] | None = None) -> Rejection:
    if quantization_config is not None:
        cfg = read_json(directory / "config.json")
        cfg["quantization_config"] = dict(quantization_config)
        (directory / "config.json").write_text(json.dumps(cfg))
    checkpoint = SafetensorsCheckpoint(directory)
    try:
        load_text_encoder(checkpoint, model_cls=model_cls, component="text_encoder")
    except ComponentCheckpointUnsupportedError as exc:
        message = str(exc)  # what a user reads must name the class and the component it refuses
        return Rejection(
            True,
            checkpoint.tensors_read,
            names_class=model_cls.__name__ in message,
            names_component="'text_encoder'" in message,
            message=message,
        )
    return Rejection(False, checkpoint.tensors_read)


def check_quantized_admission(block_size: Sequence[int] | None = TINY_BLOCK, seed: int = 0) -> Admission:
    """Admitted: the native Qwen3 encoder. Rejected before any read: a native encoder without
    quantized layers, a non-native class, an unsupported quant method."""
    tensors = fp8_tensors(qwen3_tensors(TINY_QWEN3, seed), block_size)
    with tempfile.TemporaryDirectory(prefix="parity-admission-") as tmp:
        root = Path(tmp)
        qcfg = fp8_quantization_config(block_size)
        admitted_dir = write_checkpoint(root / "admitted", TINY_QWEN3, tensors, qcfg)
        checkpoint = SafetensorsCheckpoint(admitted_dir)
        model = load_text_encoder(checkpoint, model_cls=Qwen3TextEncoder)
        cases = {
            "native_without_quantized_layers": (UnquantizedQwen3, None),
            "not_native": (ForeignEncoder, None),
            "unsupported_method": (Qwen3TextEncoder, {"quant_method": "awq", "bits": 4}),
        }
        rejections = {
            case: _rejection(write_checkpoint(root / case, TINY_QWEN3, tensors, qcfg), cls, qoverride)
            for case, (cls, qoverride) in cases.items()
        }
    return Admission(
        checkpoint_tensors=len(tensors),
        admitted_tensors_read=checkpoint.tensors_read,
        quantized_layers=len(quantized_linear_layers(model)),
        processed_layers=sum(bool(getattr(m, "fp8_ready", False)) for m in quantized_linear_layers(model)),
        expected_quantized_layers=4 * TINY_QWEN3["num_hidden_layers"],  # qkv, o, gate_up, down per layer
        rejections=rejections,
    )


# ---------------------------------------------------------------------------- packed qkv scale
def check_packed_qkv_scale(block_size: Sequence[int] | None = None, seed: int = 0) -> PackedQkv:
    """Each of q/k/v (and gate/up) lands in its own shard of the fused weight and ``weight_scale_inv``, bit for bit."""
    tensors = fp8_tensors(qwen3_tensors(TINY_QWEN3, seed), block_size)
    with tempfile.TemporaryDirectory(prefix="parity-qkv-scale-") as tmp:
        model = load_text_encoder(
            write_checkpoint(tmp, TINY_QWEN3, tensors, fp8_quantization_config(block_size)), Qwen3TextEncoder
        )
    bn = block_size[0] if block_size is not None else None
    exact = True
    distinct_scales = True
    for i, layer in enumerate(model.layers):
        for fused, parts in (
            (layer.self_attn.qkv_proj, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            (layer.mlp.gate_up_proj, ("mlp.gate_proj", "mlp.up_proj")),
        ):
            scales = []
            for shard, (part, offset, size) in enumerate(zip(parts, fused.shard_offsets, fused.output_sizes)):
                w = tensors[f"model.layers.{i}.{part}.weight"]
                s = tensors[f"model.layers.{i}.{part}.weight_scale_inv"]
                got_w = fused.weight.data[offset : offset + size]
                rows = slice(shard, shard + 1) if bn is None else slice(offset // bn, math.ceil((offset + size) / bn))
                got_s = fused.weight_scale_inv.data[rows]
                exact &= torch.equal(got_w.view(torch.uint8), w.view(torch.uint8)) and torch.equal(
                    got_s, s.reshape(got_s.shape)
                )
                scales.append(s.flatten()[0].item())
            distinct_scales &= len(set(scales)) == len(scales)
    return PackedQkv(
        bool(exact), bool(distinct_scales), "per_tensor" if block_size is None else f"block {list(block_size)}"
    )


# ---------------------------------------------------------------------------- fp8 parity
def _use_kernel(model: nn.Module, kernel: str) -> None:
    for layer in quantized_linear_layers(model):
        layer.quant_method.kernel = kernel


def check_fp8_parity(
    block_size: Sequence[int] | None = TINY_BLOCK,
    lengths: Sequence[int] = (7, 3, 10),
    config: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> Fp8Parity:
    """FP8 encoder vs (a) a bf16 encoder on its dequantized weights and (b) its bf16 source."""
    config = dict(config or TINY_QWEN3)
    source = qwen3_tensors(config, seed)
    quantized = fp8_tensors(source, block_size)
    ids, mask = tiny_inputs(config, lengths, seed)
    with tempfile.TemporaryDirectory(prefix="parity-fp8-") as tmp:
        root = Path(tmp)
        bf16 = load_text_encoder(write_checkpoint(root / "bf16", config, source), Qwen3TextEncoder)
        twin = load_text_encoder(
            write_checkpoint(root / "dequant", config, dequantized_tensors(quantized, block_size, torch.bfloat16)),
            Qwen3TextEncoder,
        )
        fp8 = load_text_encoder(
            write_checkpoint(root / "fp8", config, quantized, fp8_quantization_config(block_size)), Qwen3TextEncoder
        )
    ref, out_twin, out = (_valid(_encode(m, ids, mask), lengths) for m in (bf16, twin, fp8))
    figures = Fp8Parity(
        layout="per_tensor" if block_size is None else f"block {list(block_size)}",
        bitwise_vs_dequantized_bf16=bool(torch.equal(out, out_twin)),
        max_abs_vs_bf16=(out - ref).abs().max().item(),
        rel_l2_vs_bf16=((out - ref).norm() / ref.norm()).item(),
        ref_max_abs=ref.abs().max().item(),
    )
    if block_size is not None:
        return figures
    probe = {layer: torch.zeros(1, layer.input_size, dtype=torch.bfloat16) for layer in quantized_linear_layers(fp8)}
    missing = {
        reason
        for layer, x in probe.items()
        for variant, reason in [layer.quant_method.scaled_mm_variant(layer, x)]
        if variant is None
    }
    if missing:  # this torch cannot run scaled_mm on the CPU for some layer: say so
        return dataclasses.replace(figures, scaled_mm_skipped="; ".join(sorted(missing)))
    # Per tensor, the scaled_mm path runs on the CPU too (tensor-wise and row-wise).
    _use_kernel(fp8, "scaled_mm")
    kernels = sorted({layer.quant_method.kernel_for(layer, x) for layer, x in probe.items()})
    out_mm = _valid(_encode(fp8, ids, mask), lengths)
    return dataclasses.replace(
        figures, scaled_mm_kernels=kernels, rel_l2_scaled_mm_vs_bf16=((out_mm - ref).norm() / ref.norm()).item()
    )


__all__ = [
    "TINY_QWEN3",
    "check_fp8_parity",
    "check_masked_causal_lengths",
    "check_packed_qkv_scale",
    "check_quantized_admission",
    "fp8_quantization_config",
    "fp8_tensors",
    "qwen3_tensors",
    "write_checkpoint",
]
