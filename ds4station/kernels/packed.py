"""The base of the repacked quantised weights (PackedQ8_0, PackedIQ2XXS, PackedQ2K, PackedQ4K): frozen dataclasses
of tensors whose first field, `qs`, holds a row's quants in its last dim, with any leading dims (experts) before
the row dim."""

from __future__ import annotations

import dataclasses

import torch


class PackedRows:
    """Row count `n`, row length `k` (weights per row) and `nbytes` of a repacked weight; a subclass names its
    `qtype` and how many weights one element of `qs`'s last dim holds (`WEIGHTS_PER_QS`)."""

    qtype = ""
    WEIGHTS_PER_QS = 1

    @property
    def n(self) -> int:
        return self.qs.shape[-2]

    @property
    def k(self) -> int:
        return self.qs.shape[-1] * self.WEIGHTS_PER_QS

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (getattr(self, f.name) for f in dataclasses.fields(self)))


def raw_rows(raw: torch.Tensor, k: int, name: str, block_values: int, block_bytes: int) -> torch.Tensor:
    """Raw GGUF bytes of a quant type `name` (uint8 [..., N, row bytes] or flat) as rows of `k` values:
    [*lead, K / block_values, block_bytes] blocks; refuses other dtypes, a k that is not a multiple of the block
    and bytes that do not hold whole rows."""
    if raw.dtype != torch.uint8:
        raise TypeError(f"raw {name} data must be uint8 bytes, got {raw.dtype}")
    if k % block_values:
        raise ValueError(f"{name} row length must be a multiple of {block_values}, got {k}")
    nb = k // block_values
    row_bytes = nb * block_bytes
    if raw.shape[-1] != row_bytes:
        if raw.dim() != 1 or raw.numel() % row_bytes:
            raise ValueError(f"{name} data of shape {tuple(raw.shape)} does not hold rows of {k} values "
                             f"({row_bytes} bytes)")
        raw = raw.view(-1, row_bytes)
    return raw.reshape(*raw.shape[:-1], nb, block_bytes)
