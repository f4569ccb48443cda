"""Moving a step's small tensors between host and device with one synchronisation a step.

Host to device: a copy from pageable memory makes CUDA wait for the stream first, so every
`torch.tensor(values, device="cuda")` would stall the host until the GPU caught up. Values go
through pinned memory and non-blocking copies instead (torch's pinned-memory cache keeps each
buffer until its copy has finished). Device to host: the step's results come back in one copy,
which is the step's one wait for the GPU. On the CPU all of this is a plain copy.
"""

from __future__ import annotations

import array
from collections.abc import Iterable, Sequence

import torch


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor's values on `device`, without waiting for the device (on the CPU, the
    tensor itself)."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def device_tensor(values: Sequence, dtype: torch.dtype | None,
                  device: torch.device) -> torch.Tensor:
    return upload(torch.tensor(values, dtype=dtype), device)


def int_tensor(values: Iterable[int], device: torch.device) -> torch.Tensor:
    """int64 tensor from Python ints, several times faster than torch.tensor on a list."""
    buffer = array.array("q", values)
    if not buffer:
        return torch.empty(0, dtype=torch.int64, device=device)
    return upload(torch.frombuffer(buffer, dtype=torch.int64), device)


def download(*tensors: torch.Tensor) -> list[list[float]]:
    """Each tensor's values as a flat Python list, in one device-to-host copy (float64
    carries int64 ids below 2**53 exactly)."""
    if not tensors:
        return []
    flat = torch.cat([tensor.reshape(-1).to(torch.float64) for tensor in tensors]).tolist()
    lists, start = [], 0
    for tensor in tensors:
        lists.append(flat[start:start + tensor.numel()])
        start += tensor.numel()
    return lists
