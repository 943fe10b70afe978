"""The base of the repacked quantised weights (PackedQ8_0, PackedIQ2XXS, PackedQ2K, PackedQ4K): frozen dataclasses
of tensors whose first field, `qs`, holds a row's quants in its last dim, with any leading dims (experts) before
the row dim."""

from __future__ import annotations

import dataclasses


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
