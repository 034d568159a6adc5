"""The flash-attn entry points installed here, found by what the package exposes, not by an import succeeding.

Three APIs ship under two module names: FA4 (``flash_attn.cute.flash_attn_func``, Hopper and Blackwell; its
backward takes the LSE's gradient; it leaves ``flash_attn`` a namespace package without attributes), FA3
(``flash_attn_interface``, sm90) and FA2 (``flash_attn.flash_attn_func``); FA2's and FA3's backward drop the
LSE's gradient. All take ``[B, S, H, D]`` fp16/bf16 with fewer KV heads (GQA), ``softmax_scale``, ``causal``
(bottom-right aligned) and ``deterministic``, and return an fp32 ``[B, H, Sq]`` natural-log LSE on request,
each with its own flag. The newest API the GPU runs is used; ``PARITY_FA_API=fa2|fa3|fa4`` chooses one.
docs/flash-attn.md has the table.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

Tensor = torch.Tensor
FA_API_ENV = "PARITY_FA_API"
_LSE_FLAGS = ("return_lse", "return_attn_probs")
_CUTE_AUX_DATA_WARNING = r"Argument aux_data \(position \d+\) cannot be converted to a JitArgument"


@dataclass(frozen=True)
class ApiSpec:
    """What identifies one flash-attn API: its module, its distributions, the GPUs it runs on."""

    name: str
    module: str
    distributions: tuple[str, ...]
    min_capability: tuple[int, int]
    max_capability: tuple[int, int] | None
    lse_has_gradient: bool

    def cannot_run_on(self, capability: tuple[int, int] | None) -> str | None:
        """Why this API's kernels cannot run on a GPU of ``capability`` (None: unknown, not a CUDA GPU)."""
        if capability is None:
            return None
        low, high = self.min_capability, self.max_capability
        if capability < low or (high is not None and capability > high):
            upper = f" to sm{high[0]}{high[1]}" if high else " and later"
            return f"{self.name} runs on sm{low[0]}{low[1]}{upper}, this GPU is sm{capability[0]}{capability[1]}"
        return None


FA4 = ApiSpec("FA4", "flash_attn.cute", ("flash-attn-4", "fa4"), (9, 0), None, lse_has_gradient=True)
FA3 = ApiSpec("FA3", "flash_attn_interface", ("flash_attn_3", "flash-attn-3"), (9, 0), (9, 0), lse_has_gradient=False)
FA2 = ApiSpec("FA2", "flash_attn", ("flash-attn", "flash_attn"), (8, 0), None, lse_has_gradient=False)
SPECS = (FA4, FA3, FA2)


@dataclass(frozen=True)
class FlashAttnApi:
    """One installed flash-attn API: its entry point and what it accepts."""

    spec: ApiSpec
    version: str | None
    func: Callable[..., object]
    parameters: frozenset[str]
    varlen: Callable[..., object] | None = None  # flash_attn_varlen_func, where the module has one

    def describe(self) -> str:
        """``FA4: flash_attn.cute.flash_attn_func (flash-attn-4 4.0.0b36)`` for doctor and results."""
        return f"{self.spec.name}: {self.spec.module}.flash_attn_func ({self.version or 'version unknown'})"

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool,
        softmax_scale: float | None,
        return_lse: bool,
        deterministic: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """``(out, lse)`` on ``[B, S, H, D]``; ``lse`` is None unless asked for."""
        kwargs = self._flags(causal, softmax_scale, return_lse, deterministic)
        result = self.func(*(_last_dim_contiguous(t) for t in (q, k, v)), **kwargs)
        return self._split(result, return_lse)

    def key_masked_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        keep: Tensor,
        softmax_scale: float | None,
        return_lse: bool,
        deterministic: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """Non-causal attention of every query to the keys ``keep [B, S_k]`` (bool) marks, through the varlen entry:
        each item's kept keys packed (``cu_seqlens_k``), its queries whole. An item without a kept key gets zeros
        and an LSE of -inf, as the MATH backend gives (a ring merges it as no contribution)."""
        if self.varlen is None:
            raise NotImplementedError(f"{self.describe()}: the module has no flash_attn_varlen_func")
        b, sq, h, _ = q.shape
        lens = keep.sum(dim=1)
        items = lens.nonzero().flatten()
        out = q.new_zeros(b, sq, h, v.shape[-1])
        lse = torch.full((b, h, sq), float("-inf"), device=q.device)
        if len(items):
            flat = keep[items].reshape(-1).nonzero().flatten()
            packed_k, packed_v = (t[items].reshape(-1, *t.shape[2:]).index_select(0, flat) for t in (k, v))
            cu_k = torch.nn.functional.pad(lens[items].cumsum(0), (1, 0)).to(torch.int32)
            cu_q = torch.arange(len(items) + 1, device=q.device, dtype=torch.int32) * sq
            kwargs = self._flags(False, softmax_scale, return_lse, deterministic)
            kwargs.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=sq, max_seqlen_k=int(lens.max()))
            packed_q = q[items].reshape(-1, *q.shape[2:])
            result = self.varlen(*(_last_dim_contiguous(t) for t in (packed_q, packed_k, packed_v)), **kwargs)
            got, got_lse = self._split(result, return_lse)
            out = out.index_copy(0, items, got.reshape(len(items), sq, h, -1))
            if got_lse is not None:  # [H, items · S_q]
                lse = lse.index_copy(0, items, got_lse.reshape(h, len(items), sq).transpose(0, 1))
        return out, (lse if return_lse else None)

    def _flags(
        self, causal: bool, softmax_scale: float | None, return_lse: bool, deterministic: bool
    ) -> dict[str, object]:
        kwargs: dict[str, object] = {"softmax_scale": softmax_scale, "causal": causal}
        if "deterministic" in self.parameters:
            kwargs["deterministic"] = deterministic
        elif deterministic:
            raise NotImplementedError(f"{self.describe()} takes no deterministic flag")
        flag = next((f for f in _LSE_FLAGS if f in self.parameters), None)
        if return_lse and flag:
            kwargs[flag] = True
        return kwargs

    def _split(self, result: object, return_lse: bool) -> tuple[Tensor, Tensor | None]:
        out, lse = (result[0], result[1]) if isinstance(result, (tuple, list)) else (result, None)
        if return_lse and lse is None:
            raise NotImplementedError(f"{self.describe()} returned no log-sum-exp")
        return out, (lse.float() if return_lse and lse is not None else None)  # type: ignore[union-attr]


def _last_dim_contiguous(t: Tensor) -> Tensor:
    """flash-attn needs unit stride in the head dimension, any other stride being its own."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _distribution_version(spec: ApiSpec) -> str | None:
    for name in spec.distributions:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _find(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def probe(spec: ApiSpec, capability: tuple[int, int] | None = None) -> FlashAttnApi | str:
    """The API ``spec`` describes as installed here, or why not (a sentence)."""
    if not _find(spec.module):
        return f"{spec.name}: {spec.module} is not installed"
    try:
        module = importlib.import_module(spec.module)
    except Exception as exc:  # an extension built for another torch raises anything
        return f"{spec.name}: {spec.module} does not import ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
    func = getattr(module, "flash_attn_func", None)
    if not callable(func):
        return f"{spec.name}: {spec.module} imports but has no flash_attn_func"
    try:
        parameters = frozenset(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return f"{spec.name}: {spec.module}.flash_attn_func has no inspectable signature"
    missing = {"softmax_scale", "causal"} - parameters
    if missing:
        return f"{spec.name}: {spec.module}.flash_attn_func takes no {', '.join(sorted(missing))}: not a flash-attn API"
    reason = spec.cannot_run_on(capability)
    if reason:
        return reason
    varlen = getattr(module, "flash_attn_varlen_func", None)
    return FlashAttnApi(spec, _distribution_version(spec), func, parameters, varlen if callable(varlen) else None)


def _capability() -> tuple[int, int] | None:
    if torch.version.hip is not None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


@functools.cache
def installed_api() -> FlashAttnApi | str:
    """The API the ``fa`` backend calls: ``PARITY_FA_API``'s, else the newest that runs here; else why none does."""
    wanted = os.environ.get(FA_API_ENV, "").strip().upper()
    specs = [s for s in SPECS if s.name == wanted] if wanted else list(SPECS)
    if not specs:
        return f"{FA_API_ENV}={wanted.lower()} names no flash-attn API (fa2, fa3, fa4)"
    capability = _capability()
    reasons = []
    for spec in specs:
        found = probe(spec, capability)
        if isinstance(found, FlashAttnApi):
            if spec is FA4:  # its CuTe DSL warns about one argument on every compile, forward and backward: noise
                warnings.filterwarnings("ignore", message=_CUTE_AUX_DATA_WARNING, category=UserWarning)
            return found
        reasons.append(found)
    return (
        "no usable flash-attn: "
        + "; ".join(reasons)
        + " (pip install flash-attn, or flash-attn-4 for Hopper/Blackwell)"
    )
