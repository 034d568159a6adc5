"""Where a model path's difference sits: the worst element by named axis and how the large ones spread.

A model check compares whole activations (a block's ``[batch, token, channel]`` rows, gathered from the
ranks; a transformer's ``[item, channel, frame, row, col]`` latents), not ``[B, S, H, D]`` attention
outputs, so the attention contracts' locator does not apply. What a failure needs to say is the same: the
worst element, and whether the large differences cover every rank (or item) or one, every channel or
some. Only measured, as JSON-safe figures; the contract words them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

AXES = {3: ("batch", "token", "channel"), 5: ("item", "channel", "frame", "row", "col")}


def locate(diff: Tensor, owners: Tensor | None = None) -> dict[str, Any] | None:
    """The worst element of ``diff`` (|out − ref|; NaN counts as infinite) by axis, and per rank (``owners``:
    the rank of each token of a 3-D path) or else per batch item, how many positions hold a difference of
    at least half the worst; None when nothing differs."""
    diff = torch.nan_to_num(diff.double(), nan=float("inf"))
    if not diff.numel() or not float(diff.max()) > 0:
        return None
    axes = AXES.get(diff.dim(), tuple(f"dim{i}" for i in range(diff.dim())))
    channel = axes.index("channel") if "channel" in axes else diff.dim() - 1
    index = torch.unravel_index(diff.argmax(), diff.shape)
    value = float(diff.max())
    hot = diff.amax(dim=channel) >= value / 2  # one flag per position: every axis but the channel
    channels = diff.movedim(channel, 0).reshape(diff.shape[channel], -1).amax(dim=1) >= value / 2
    worst = {axis: int(i) for axis, i in zip(axes, index)}
    if owners is not None and diff.dim() == 3:
        worst = {"rank": int(owners[worst["token"]]), **worst}
        groups = {f"rank {r}": hot[:, owners == r] for r in sorted(set(owners.tolist()))}
    else:
        groups = {f"{axes[0]} {i}": hot[i] for i in range(hot.shape[0])}
    return {
        "worst": {**worst, "abs": value},
        "above_half": {name: [int(g.sum()), int(g.numel())] for name, g in groups.items()},
        "channels_above_half": int(channels.sum()),
        "channels": int(channels.numel()),
    }
