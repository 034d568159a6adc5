"""flash-attn (whichever API is installed) against SDPA's flash and cuDNN kernels at production shapes, forward
and forward+backward, and each backend's per-rank SP cost at W = 2, side by side in one run.

    python benchmarks/fa_kernels.py [--shapes zimage_1024 hunyuan_720p] [--rounds 3] [--json FILE]

Kernels interleave within each of ``--rounds`` rounds (drift hits all alike); a figure is the best round's
median of CUDA-event timings. TFLOP/s: forward 4·B·H·S²·D, forward+backward 3.5× that (flash-attn's
convention). SP rows time one rank of two without collectives: Ulysses, S tokens × H/2 heads; ring, two
LSE calls of S/2 × S/2 merged by reference_impl's ring merge; each over half the single-rank time.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import cuda_median_ms  # noqa: E402
from reference_impl.attention.backends import AttentionBackend, FlashAttnBackend, TorchSDPABackend  # noqa: E402
from reference_impl.attention.ring import merge  # noqa: E402

Tensor = torch.Tensor


@dataclass(frozen=True)
class Shape:
    """A production attention shape (cases/production/contracts/*.toml name its source)."""

    tokens: int
    heads: int
    head_dim: int = 128

    def flops(self) -> float:
        return 4.0 * self.heads * self.tokens**2 * self.head_dim


SHAPES = {
    "zimage_1024": Shape(4096 + 512, 30),
    "zimage_2048": Shape(16384 + 512, 30),
    "wan14b_480p": Shape(32760, 40),
    "wan14b_720p": Shape(75600, 40),
    "hunyuan_720p": Shape(118800 + 256, 24),
}


def kernels() -> dict[str, AttentionBackend]:
    """The kernels to compare; flash-attn only where installed (its reason printed otherwise)."""
    chosen: dict[str, AttentionBackend] = {
        "sdpa:flash": TorchSDPABackend("flash"),
        "sdpa:cudnn": TorchSDPABackend("cudnn"),
    }
    reason = FlashAttnBackend.unavailable_reason()
    if reason:
        print(f"fa: {reason}", file=sys.stderr)
    else:
        chosen = {f"fa ({FlashAttnBackend.implementation()})": FlashAttnBackend(), **chosen}
    return chosen


def _inputs(shape: Shape, tokens: int | None = None, heads: int | None = None, grad: bool = False) -> list[Tensor]:
    size = (1, tokens or shape.tokens, heads or shape.heads, shape.head_dim)
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [
        torch.randn(size, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_(grad) for _ in range(3)
    ]


def calls(backend: AttentionBackend, shape: Shape) -> dict[str, Callable[[], object]]:
    """The timed calls of one kernel on one shape: forward, forward+backward, a Ulysses and a ring rank's forward."""
    q, k, v = _inputs(shape)
    qg, kg, vg = _inputs(shape, grad=True)
    grad_out = torch.randn_like(q)
    uq, uk, uv = _inputs(shape, heads=shape.heads // 2)
    half = shape.tokens // 2
    rq, rk, rv = _inputs(shape, tokens=half)
    rk2, rv2 = (t.clone() for t in (rk, rv))

    def backward() -> None:
        backend.forward(qg, kg, vg).backward(grad_out)

    def ring_rank() -> None:
        merge([backend.forward(rq, kk, vv, return_lse=True) for kk, vv in ((rk, rv), (rk2, rv2))])

    return {
        "fwd": lambda: backend.forward(q, k, v),
        "fwd+bwd": backward,
        "ulysses_rank": lambda: backend.forward(uq, uk, uv),
        "ring_rank": ring_rank,
    }


def measure(shape: Shape, chosen: dict[str, AttentionBackend], rounds: int, reps: int) -> dict[str, dict[str, float]]:
    """Best-round median ms per kernel and call, the kernels interleaved in every round."""
    prepared = {name: calls(backend, shape) for name, backend in chosen.items()}
    best: dict[str, dict[str, float]] = {name: {} for name in chosen}
    for _ in range(rounds):
        for name, timed in prepared.items():
            for what, call in timed.items():
                try:
                    ms = cuda_median_ms(call, reps)
                except RuntimeError as exc:
                    print(f"{name} {what}: {str(exc).splitlines()[0][:160]}", file=sys.stderr)
                    continue
                best[name][what] = min(ms, best[name].get(what, float("inf")))
    return best


def rows(label: str, shape: Shape, best: dict[str, dict[str, float]]) -> list[dict[str, object]]:
    out = []
    baseline = best.get("sdpa:flash", {})
    for name, ms in best.items():
        fwd, both = ms.get("fwd"), ms.get("fwd+bwd")
        out.append(
            {
                "shape": label,
                "tokens": shape.tokens,
                "heads": shape.heads,
                "kernel": name,
                "fwd_ms": fwd,
                "fwd_tflops": shape.flops() / (fwd * 1e-3) / 1e12 if fwd else None,
                "fwd_bwd_ms": both,
                "fwd_bwd_tflops": 3.5 * shape.flops() / (both * 1e-3) / 1e12 if both else None,
                "fwd_vs_sdpa_flash": baseline["fwd"] / fwd if fwd and "fwd" in baseline else None,
                "fwd_bwd_vs_sdpa_flash": baseline["fwd+bwd"] / both if both and "fwd+bwd" in baseline else None,
                "ulysses_rank_vs_half": ms["ulysses_rank"] / (fwd / 2) if fwd and "ulysses_rank" in ms else None,
                "ring_rank_vs_half": ms["ring_rank"] / (fwd / 2) if fwd and "ring_rank" in ms else None,
            }
        )
    return out


def _fmt(value: object) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["zimage_1024", "wan14b_480p", "hunyuan_720p"], choices=SHAPES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    chosen = kernels()
    table = []
    for label in args.shapes:
        shape = SHAPES[label]
        table += rows(label, shape, measure(shape, chosen, args.rounds, args.reps))
        torch.cuda.empty_cache()
    columns = list(table[0])
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for row in table:
        print("| " + " | ".join(_fmt(row[c]) for c in columns) + " |")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
