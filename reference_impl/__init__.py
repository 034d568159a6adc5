"""Reference implementation of sequence-parallel diffusion attention and the models around it.

This package never imports ``harness``: the harness reaches it through a target adapter.
"""

from reference_impl.attention import (
    AttentionBackendEnum,
    LocalAttention,
    USPAttention,
    attention_backend_config,
    attention_component,
    configure_attention_backends,
    get_attn_backend,
)
from reference_impl.forward_context import get_forward_context, set_forward_context
from reference_impl.platform import current_platform

__all__ = [
    "AttentionBackendEnum",
    "LocalAttention",
    "USPAttention",
    "attention_backend_config",
    "attention_component",
    "configure_attention_backends",
    "current_platform",
    "get_attn_backend",
    "get_forward_context",
    "set_forward_context",
]
