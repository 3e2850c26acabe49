"""Parameters as one flat float32 vector, and back: what every whole-model round sends."""

from __future__ import annotations

import torch


def flatten(params) -> torch.Tensor:
    """The parameters' values (or any same-shaped tensors), concatenated: a new CPU float32 tensor."""
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in params])


@torch.no_grad()
def assign(params, flat: torch.Tensor) -> None:
    """Copy ``flat`` (as :func:`flatten` lays it out) into the parameters, each in its own dtype
    and device."""
    for p, v in zip(params, torch.split(flat, [p.numel() for p in params])):
        p.copy_(v.view_as(p))
