"""Attention backends: one class per kernel family, each declaring what it can do.

All backends take ``[B, S, H, D]`` tensors (sequence before heads, the layout USPAttention
works in), accept fewer KV heads than query heads (GQA), and can return the log-sum-exp of
the scaled scores (``[B, H, S]``, fp32) when they support it: the LSE is what lets ring
attention merge partial results, hence ``supports_ring_rotation``.

A backend whose package or hardware is missing still exists; ``unavailable_reason()`` says
why it cannot run, so reports can name the missing piece instead of failing obscurely.
"""

from __future__ import annotations

import enum
import importlib.util
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import ClassVar

import torch
import torch.nn.functional as F

from reference_impl.attention.blocked_math import BlockedAttention
from reference_impl.attention.flash_attn_api import FlashAttnApi, installed_api
from reference_impl.platform import current_platform

Tensor = torch.Tensor
AttnOutput = Tensor | tuple[Tensor, Tensor]


class AttentionBackendEnum(enum.Enum):
    TORCH_SDPA = "torch_sdpa"
    FA = "fa"
    SAGE_ATTN = "sage_attn"
    MATH = "math"

    @classmethod
    def parse(cls, name: str | AttentionBackendEnum) -> AttentionBackendEnum:
        """Accept ``fa``, ``FA``, ``torch_sdpa`` ...; unknown names list the valid ones."""
        if isinstance(name, cls):
            return name
        key = str(name).strip()
        for member in cls:
            if key.lower() in (member.value, member.name.lower()):
                return member
        valid = ", ".join(m.value for m in cls)
        raise ValueError(f"unknown attention backend {name!r}; valid names: {valid}")


class AttentionBackend(ABC):
    """A kernel family. Subclasses declare capabilities as class attributes."""

    enum: ClassVar[AttentionBackendEnum]
    supported_dtypes: ClassVar[frozenset[torch.dtype]]
    platforms: ClassVar[frozenset[str]]
    supports_varlen: ClassVar[bool] = False
    supports_mask: ClassVar[bool] = False
    max_head_size: ClassVar[int] = 1 << 30

    @classmethod
    def supports_ring_rotation(cls) -> bool:
        """True when ``forward(..., return_lse=True)`` works: ring attention merges through the LSE."""
        return False

    def lse_has_gradient(self) -> bool:
        """True when the LSE of ``forward(..., return_lse=True)`` carries its gradient, so a ring merge
        through it can be differentiated. The aten kernels' LSE has none (derivatives.yaml declares
        their logsumexp output not differentiable), nor has flash-attn's."""
        return False

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return 0 < head_size <= cls.max_head_size

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in cls.supported_dtypes

    @classmethod
    def preferred_dtype(cls, dtype: torch.dtype) -> torch.dtype:
        """The dtype to cast to when the caller's dtype is not supported (fused kernels: bf16)."""
        return dtype if cls.supports_dtype(dtype) else torch.bfloat16

    @classmethod
    def implementation(cls) -> str | None:
        """What this backend calls, where a package decides it (flash-attn's API and version)."""
        return None

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when the backend can run here, else a sentence naming what is missing."""
        kind = current_platform.kind
        if kind not in cls.platforms:
            return f"{cls.enum.value} does not run on {kind} (runs on: {', '.join(sorted(cls.platforms))})"
        return None

    @classmethod
    def is_available(cls) -> bool:
        return cls.unavailable_reason() is None

    @abstractmethod
    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        softmax_scale: float | None = None,
        return_lse: bool = False,
        attn_mask: Tensor | None = None,
    ) -> AttnOutput:
        """Attention on ``[B, S, H, D]``; with ``return_lse`` also the fp32 LSE ``[B, H, Sq]``."""

    def _check_lse(self, return_lse: bool) -> None:
        if return_lse and not self.supports_ring_rotation():
            raise NotImplementedError(f"{self.enum.value} does not return the log-sum-exp")

    def _check_mask(self, attn_mask: Tensor | None) -> None:
        if attn_mask is not None and not self.supports_mask:
            raise NotImplementedError(f"{self.enum.value} does not take an attention mask")


def requires_grad(*tensors: Tensor) -> bool:
    """Whether autograd records an op on ``tensors`` now (a backward will be asked for)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def expand_kv_heads(k: Tensor, v: Tensor, num_q_heads: int) -> tuple[Tensor, Tensor]:
    """Repeat KV heads for GQA on ``[B, S, H, D]``; each KV head serves a contiguous group of Q heads."""
    num_kv = k.shape[2]
    if num_kv == num_q_heads:
        return k, v
    if num_q_heads % num_kv:
        raise ValueError(f"GQA: {num_q_heads} query heads are not a multiple of {num_kv} KV heads")
    rep = num_q_heads // num_kv
    return k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)


def _scale(q: Tensor, softmax_scale: float | None) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _bool_mask_to_additive(attn_mask: Tensor, dtype: torch.dtype) -> Tensor:
    if attn_mask.dtype == torch.bool:
        return torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(~attn_mask, float("-inf"))
    return attn_mask.to(dtype)


def _with_causal(attn_mask: Tensor, sq: int, sk: int) -> Tensor:
    """``attn_mask`` (bool or additive) combined with the top-left aligned causal limit, as SDPA defines it."""
    keep = torch.ones(sq, sk, dtype=torch.bool, device=attn_mask.device).tril()
    if attn_mask.dtype == torch.bool:
        return attn_mask & keep
    return attn_mask.masked_fill(~keep, float("-inf"))


class MathBackend(AttentionBackend):
    """Explicit fp32 softmax(QKᵀ)V that returns the LSE: the oracle, and the CPU ring backend.

    Computed in blocks of query rows with its own backward (:mod:`.blocked_math`), so memory is O(S)
    at any length and the LSE carries its gradient. Rows whose keys are all masked give zeros and an
    LSE of -inf (not NaN), so a fully masked ring block merges as "no contribution".
    """

    enum = AttentionBackendEnum.MATH
    supported_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
    platforms = frozenset({"cuda", "rocm", "mps", "cpu"})
    supports_mask = True
    supports_varlen = True

    @classmethod
    def supports_ring_rotation(cls) -> bool:
        return True

    def lse_has_gradient(self) -> bool:
        return True  # torch arithmetic throughout

    def forward(self, q, k, v, causal=False, softmax_scale=None, return_lse=False, attn_mask=None):
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        k, v = expand_kv_heads(k, v, q.shape[2])
        qf, kf, vf = (t.transpose(1, 2).to(compute).contiguous() for t in (q, k, v))
        additive = None if attn_mask is None else _bool_mask_to_additive(attn_mask, compute)
        out, lse = BlockedAttention.apply(qf, kf, vf, _scale(q, softmax_scale), causal, additive)
        out = out.transpose(1, 2).to(q.dtype)
        if return_lse:
            return out, lse.float()
        return out


SDPA_KERNELS = ("math", "flash", "efficient", "cudnn")
_NO_KERNEL = ("No available kernel", "No viable backend")  # torch's words on CUDA and on the CPU


class KernelRefused(RuntimeError):
    """A kernel refuses these inputs before computing anything, so callers may treat it as "this case
    cannot run here" (flash-attn with a mask)."""


class PinnedKernelRefused(KernelRefused):
    """torch refused the pinned SDPA kernel for these inputs (flash with fp32, cudnn with a mask...)."""


def _sdpa_backend_enum(kernel: str):
    from torch.nn.attention import SDPBackend

    return {
        "math": SDPBackend.MATH,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }[kernel]


@contextmanager
def pinned_sdpa_kernel(kernel: str | None) -> Iterator[None]:
    """Restrict F.scaled_dot_product_attention to one kernel (None: let torch choose)."""
    if kernel is None:
        with nullcontext():
            yield
        return
    if kernel not in SDPA_KERNELS:
        raise ValueError(f"unknown SDPA kernel {kernel!r}; valid: {', '.join(SDPA_KERNELS)}")
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([_sdpa_backend_enum(kernel)]):
        yield


class TorchSDPABackend(AttentionBackend):
    """``F.scaled_dot_product_attention``, optionally pinned to one kernel.

    Ring-capable: with ``return_lse`` it calls the aten flash op that returns the LSE
    (``_scaled_dot_product_flash_attention_for_cpu`` on the CPU; on CUDA the flash, efficient
    or cudnn op, following the pinned kernel). A pinned ``math`` kernel has no LSE-returning
    aten op, so that combination computes the LSE through the MATH backend; so does an unpinned
    one under autograd, because the aten ops' LSE has no gradient. A pinned flash, efficient or
    cudnn kernel cannot give the LSE a gradient: ``lse_has_gradient`` is False and the ring refuses.
    """

    enum = AttentionBackendEnum.TORCH_SDPA
    supported_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
    platforms = frozenset({"cuda", "rocm", "mps", "cpu"})
    supports_mask = True

    def __init__(self, kernel: str | None = None) -> None:
        if kernel is not None and kernel not in SDPA_KERNELS:
            raise ValueError(f"unknown SDPA kernel {kernel!r}; valid: {', '.join(SDPA_KERNELS)}")
        self.kernel = kernel

    @classmethod
    def supports_ring_rotation(cls) -> bool:
        return True

    def lse_has_gradient(self) -> bool:
        return self.kernel in (None, "math")

    def forward(self, q, k, v, causal=False, softmax_scale=None, return_lse=False, attn_mask=None):
        if return_lse:
            return self._forward_with_lse(q, k, v, causal, softmax_scale, attn_mask)
        # KV heads are expanded explicitly rather than through enable_gqa (torch >= 2.5 only).
        k, v = expand_kv_heads(k, v, q.shape[2])
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        if attn_mask is not None and causal:
            # torch refuses an explicit mask together with is_causal: fold the causal limit in.
            attn_mask = _with_causal(attn_mask, qt.shape[-2], kt.shape[-2])
            causal = False
        try:
            with pinned_sdpa_kernel(self.kernel):
                out = F.scaled_dot_product_attention(
                    qt, kt, vt, attn_mask=attn_mask, is_causal=causal, scale=softmax_scale
                )
        except RuntimeError as exc:
            if self.kernel and any(m in str(exc) for m in _NO_KERNEL):
                raise PinnedKernelRefused(
                    f"torch SDPA kernel {self.kernel} cannot run this case here ({q.dtype}): {exc}"
                ) from exc
            raise
        return out.transpose(1, 2)

    def _forward_with_lse(self, q, k, v, causal, softmax_scale, attn_mask):
        under_autograd = requires_grad(q, k, v)
        if under_autograd and not self.lse_has_gradient():
            raise PinnedKernelRefused(f"torch SDPA kernel {self.kernel} returns a log-sum-exp without a gradient")
        if attn_mask is not None or self.kernel == "math" or q.dtype == torch.float64 or under_autograd:
            return MathBackend().forward(q, k, v, causal, softmax_scale, True, attn_mask)
        k, v = expand_kv_heads(k, v, q.shape[2])
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        sq = qt.shape[2]
        if not q.is_cuda:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qt, kt, vt, 0.0, causal, scale=softmax_scale
            )
        elif self.kernel == "cudnn":
            if q.dtype == torch.float32:
                # Measured on an H200 (torch 2.11, cu130): the cudnn op accepts fp32 and returns a NaN
                # log-sum-exp, which the ring would merge into every output. Refused before computing.
                raise PinnedKernelRefused(
                    f"torch SDPA kernel cudnn cannot return the log-sum-exp for {q.dtype} "
                    "(it computes in fp16/bf16; for fp32 it returned NaN)"
                )
            out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
                qt, kt, vt, None, True, 0.0, causal, scale=softmax_scale
            )[:2]
        elif self.kernel == "flash" or (self.kernel is None and q.dtype in (torch.float16, torch.bfloat16)):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal, scale=softmax_scale)[
                :2
            ]
        else:
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                qt, kt, vt, None, True, 0.0, causal, scale=softmax_scale
            )[:2]
        if lse.dim() == 4:  # cudnn returns [B, H, S, 1]
            lse = lse.squeeze(-1)
        # The efficient kernel pads the LSE's sequence dim to a multiple of 32.
        return out.transpose(1, 2), lse[..., :sq].float()


class FlashAttnBackend(AttentionBackend):
    """The flash-attn package, through whichever of its APIs is installed (:mod:`.flash_attn_api`).

    GQA, the softmax scale and causal go to the kernel as they are; the LSE is the kernel's own. The
    backward's dQ is deterministic when the backend was built so or torch's deterministic algorithms
    are on (``torch.use_deterministic_algorithms``), as torch's own flash backward behaves.
    """

    enum = AttentionBackendEnum.FA
    supported_dtypes = frozenset({torch.float16, torch.bfloat16})
    platforms = frozenset({"cuda", "rocm"})
    max_head_size = 256

    def __init__(self, deterministic: bool = False) -> None:
        self.deterministic = deterministic

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return 8 <= head_size <= cls.max_head_size and head_size % 8 == 0  # the kernels' 16-byte alignment

    @classmethod
    def api(cls) -> FlashAttnApi:
        found = installed_api()
        if isinstance(found, str):
            raise RuntimeError(found)
        return found

    @classmethod
    def implementation(cls) -> str | None:
        found = installed_api()
        return None if isinstance(found, str) else found.describe()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        found = installed_api()
        if isinstance(found, str):
            return f"{found}; from a parity checkout: pip install -e '.[fa]' (FA2) or '.[fa4]' (FA4)"
        return super().unavailable_reason()

    @classmethod
    def supports_ring_rotation(cls) -> bool:
        return True

    def lse_has_gradient(self) -> bool:
        """FA4's backward takes the LSE's gradient; FA2's and FA3's drop it."""
        found = installed_api()
        return not isinstance(found, str) and found.spec.lse_has_gradient

    def forward(self, q, k, v, causal=False, softmax_scale=None, return_lse=False, attn_mask=None):
        keep = None if attn_mask is None else _key_padding(attn_mask, causal)
        if causal and q.shape[1] != k.shape[1]:
            raise KernelRefused(
                f"flash-attn aligns a causal mask bottom-right, USPAttention top-left: {q.shape[1]} queries "
                f"and {k.shape[1]} keys would differ"
            )
        deterministic = self.deterministic or torch.are_deterministic_algorithms_enabled()
        api = self.api()
        if keep is not None:
            if api.varlen is None:
                raise KernelRefused(f"{api.describe()} has no flash_attn_varlen_func: a key mask cannot run on fa")
            out, lse = api.key_masked_attention(q, k, v, keep, softmax_scale, return_lse, deterministic)
        else:
            out, lse = api.attention(q, k, v, causal, softmax_scale, return_lse, deterministic)
        return (out, lse) if return_lse else out


def _key_padding(attn_mask: Tensor, causal: bool) -> Tensor:
    """The ``[B, S_k]`` keys a boolean key-padding mask (``[B, 1, 1, S_k]``) keeps: what flash-attn's varlen entry
    expresses. A dense mask, an additive one, or one with causal (varlen aligns causal to each item's kept
    keys) is refused before computing."""
    if attn_mask.dtype != torch.bool or attn_mask.dim() != 4 or attn_mask.shape[1] != 1 or attn_mask.shape[2] != 1:
        raise KernelRefused(
            "flash-attn takes no dense attention mask (a boolean key-padding mask only, through its varlen entry); "
            "a dense-masked case cannot run on fa"
        )
    if causal:
        raise KernelRefused(
            "flash-attn takes no key mask together with causal (its varlen entry would align causal to the kept keys)"
        )
    return attn_mask[:, 0, 0]


class SageAttnBackend(AttentionBackend):
    """The sageattention package: int8 QKᵀ, so close to but never bitwise with SDPA."""

    enum = AttentionBackendEnum.SAGE_ATTN
    supported_dtypes = frozenset({torch.float16, torch.bfloat16})
    platforms = frozenset({"cuda"})
    max_head_size = 128

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size in (64, 96, 128)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("sageattention") is None:
            return "the sageattention package is not installed (pip install sageattention; from a parity checkout: pip install -e '.[sage]')"
        return super().unavailable_reason()

    def forward(self, q, k, v, causal=False, softmax_scale=None, return_lse=False, attn_mask=None):
        self._check_lse(return_lse)
        self._check_mask(attn_mask)
        reason = self.unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        from sageattention import sageattn

        k, v = expand_kv_heads(k, v, q.shape[2])
        return sageattn(q, k, v, tensor_layout="NHD", is_causal=causal, sm_scale=softmax_scale)


BACKENDS: dict[AttentionBackendEnum, type[AttentionBackend]] = {
    cls.enum: cls for cls in (TorchSDPABackend, FlashAttnBackend, SageAttnBackend, MathBackend)
}


def backend_class(name: str | AttentionBackendEnum) -> type[AttentionBackend]:
    return BACKENDS[AttentionBackendEnum.parse(name)]
