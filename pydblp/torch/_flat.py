"""Parameters as one flat CPU vector, and back: what every whole-model round sends."""

from __future__ import annotations

import torch


def flat_dtype(params) -> torch.dtype:
    """float64 when any of ``params`` is float64 (a float32 copy would round it), else float32."""
    return torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32


def flatten(params, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The parameters' values (or any same-shaped tensors), concatenated: a new CPU tensor of ``dtype``."""
    return torch.cat([p.detach().reshape(-1).to("cpu", dtype) for p in params])


@torch.no_grad()
def assign(params, flat: torch.Tensor) -> None:
    """Copy ``flat`` (as :func:`flatten` lays it out) into the parameters, each in its own dtype
    and device."""
    for p, v in zip(params, torch.split(flat, [p.numel() for p in params])):
        p.copy_(v.view_as(p))
