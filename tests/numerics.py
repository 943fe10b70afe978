"""The kernel tests' error measure (imported by them as `from numerics import rel_err`, as import_watch is)."""

from __future__ import annotations

import torch


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 on the host; a NaN in `got` fails the test (outputs are
    NaN-poisoned before the kernels write them, so a NaN is an element the kernel never wrote)."""
    got, want = got.double().cpu(), want.double().cpu()
    assert not got.isnan().any(), "unwritten (NaN-poisoned) or NaN output"
    return ((got - want).norm() / want.norm()).item()
