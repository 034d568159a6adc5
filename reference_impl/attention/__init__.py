"""Attention backends, backend selection and the attention layers."""

from reference_impl.attention.backends import BACKENDS, AttentionBackend, AttentionBackendEnum, backend_class
from reference_impl.attention.layer import LocalAttention, USPAttention
from reference_impl.attention.selector import (
    BackendConfig,
    BackendSelection,
    attention_backend_config,
    attention_component,
    configure_attention_backends,
    get_attn_backend,
    select_attn_backend,
)

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionBackendEnum",
    "BackendConfig",
    "BackendSelection",
    "LocalAttention",
    "USPAttention",
    "attention_backend_config",
    "attention_component",
    "backend_class",
    "configure_attention_backends",
    "get_attn_backend",
    "select_attn_backend",
]
