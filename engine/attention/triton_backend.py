"""Paged attention on CUDA with Triton: the step's KV write and its attention, one launch each
(engine.attention.triton_kernels). Its plan is one view of every query row; a step recorded
into a CUDA graph brings its own (`AttentionMetadata.static`)."""

from __future__ import annotations

import functools
import importlib.util

import torch

from engine.attention.base import AttentionBackend
from engine.attention.metadata import AttentionMetadata, causal_rows
from engine.attention.triton_kernels import QueryRows, supported_shape
from engine.attention.triton_kernels import paged_attention as triton_attention
from engine.attention.triton_kernels import write_kv as triton_write_kv
from engine.platform.host_copy import device_tensor


class TritonBackend(AttentionBackend):
    name = "triton"

    @staticmethod
    def supports(device: torch.device, head_dim: int, block_size: int) -> bool:
        return device.type == "cuda" and triton_supports(head_dim, block_size)

    def plan(self, metadata: AttentionMetadata) -> None:
        if not metadata.static:
            metadata.triton_rows = query_rows(metadata, metadata.slot_mapping.device)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        triton_write_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
        window: int | None = None, softcap: float | None = None,
    ) -> torch.Tensor:
        if metadata.triton_rows is None:
            raise RuntimeError("attention metadata used before the Triton backend planned it")
        triton_write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        return triton_attention(q, k_cache, v_cache, metadata.block_tables,
                                metadata.triton_rows, scale, window, softcap)


def triton_supports(head_dim: int, block_size: int) -> bool:
    """triton installed, and a head and block the kernel takes (`supported_shape`)."""
    return triton_installed() and supported_shape(head_dim, block_size)


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def query_rows(metadata: AttentionMetadata, device: torch.device) -> QueryRows:
    """Every query row of the step as the Triton kernel reads it (see `causal_rows`)."""
    _, seq_lens, owners = causal_rows(metadata, range(metadata.num_requests))
    return QueryRows(device_tensor(owners, torch.int32, device),
                     device_tensor(seq_lens, torch.int32, device))
