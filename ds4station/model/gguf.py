"""The GGUF header and tensor table of a DS4 file: read, validated, memory-mapped read-only (numpy + gguf).

`GGUFFile.open(path)` parses the header with gguf-py's reader, builds the ModelConfig from the
`deepseek4.*` keys, and checks every tensor against the layout in `layout.py` (names, ggml shapes, types,
data inside the file), failing with a message that names the offending key or tensor. The file is mapped
read-only and shared (`mmap` mode "r"): no commit charge, so an 81 GiB file opens on a machine with less
RAM, and pages are read only when a tensor's bytes are touched. `raw(name)` is a read-only numpy view of
one tensor's blocks; engine/weights.py turns those views into torch tensors for one pipeline stage.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from .config import ConfigError, ModelConfig
from .layout import F32_ROLES, TensorSpec, model_tensors, tensor_bytes

# Types a DS4 weight may be stored in (ds4 accepts these; the dequantiser handles all of them).
WEIGHT_TYPES = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ2_XXS, Q.MXFP4}


class GGUFError(ValueError):
    """The file is not a usable DS4 GGUF; the message names the problem."""


@dataclass
class GGUFFile:
    path: Path
    config: ModelConfig
    metadata: dict[str, Any]
    specs: dict[str, TensorSpec]  # as stored in the file (actual types)
    _reader: GGUFReader = field(repr=False)
    _offsets: dict[str, int] = field(repr=False)

    # ---- opening and validation ---------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> GGUFFile:
        path = Path(path)
        if not path.is_file():
            raise GGUFError(f"{path}: no such file")
        try:
            reader = _Reader(path)
        except GGUFError:
            raise
        except Exception as e:  # gguf-py raises ValueError/IndexError/... on a damaged header
            raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
        metadata = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
        try:
            config = ModelConfig.from_metadata(metadata)
        except ConfigError as e:
            raise GGUFError(f"{path}: {e}") from e
        specs: dict[str, TensorSpec] = {}
        offsets: dict[str, int] = {}
        for t in reader.tensors:
            shape = tuple(int(d) for d in t.shape)
            layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else None
            specs[t.name] = TensorSpec(t.name, shape, Q(t.tensor_type), layer)
            offsets[t.name] = int(t.data_offset)
        _check_tensors(path, config, specs)
        return cls(path, config, metadata, specs, reader, offsets)

    # ---- tensor access ------------------------------------------------------------------------
    def tensor_specs(self, layers: range | None = None, *, embed: bool = True, output: bool = True) -> list[TensorSpec]:
        """The file's tensors for a layer slice plus embedding / head, in layout order."""
        return [self.specs[s.name] for s in model_tensors(self.config, "f32", layers, embed=embed, output=output)]

    def raw(self, name: str) -> np.ndarray:
        """A zero-copy, read-only view of one tensor's raw blocks in the memory map (uint8)."""
        spec = self.specs.get(name)
        if spec is None:
            raise KeyError(f"{self.path}: no tensor named {name}")
        off = self._offsets[name]
        return np.asarray(self._reader.data[off: off + spec.n_bytes])

    def bytes_by_layer(self) -> dict[str, dict[str, int]]:
        """{"global" | "blk.N": {tensor role: bytes}}, for reports and the planner."""
        out: dict[str, dict[str, int]] = {}
        for s in self.specs.values():
            key = "global" if s.layer is None else f"blk.{s.layer}"
            out.setdefault(key, {})[s.role] = s.n_bytes
        return out

    @property
    def total_bytes(self) -> int:
        return sum(s.n_bytes for s in self.specs.values())


class _Reader(GGUFReader):
    """gguf-py's reader, but a tensor that runs past the end of the file is named before numpy fails on it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        super().__init__(path, "r")  # read-only and shared: no commit charge, the file is never changed

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        size = len(self.data)
        for f in fields:
            _, name, _, dims, raw_type, offset = f.parts
            qtype = Q(int(raw_type[0]))
            end = start_offs + int(offset[0]) + tensor_bytes(tuple(int(d) for d in dims), qtype)
            if end > size:
                raise GGUFError(f"{self.path}: tensor {bytes(name).decode()} ends at byte {end} but the file has "
                                f"{size} bytes (truncated download?)")
        super()._build_tensors(start_offs, fields)


def _check_tensors(path: Path, cfg: ModelConfig, found: Mapping[str, TensorSpec]) -> None:
    expected = {s.name: s for s in model_tensors(cfg, "f32")}
    missing = [n for n in expected if n not in found]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise GGUFError(f"{path}: missing tensor(s) {', '.join(missing[:5])}{more}")
    unexpected = [n for n in found if n not in expected]
    if unexpected:
        raise GGUFError(f"{path}: unexpected tensor(s) for this config: {', '.join(unexpected[:5])}")
    for name, want in expected.items():
        got = found[name]
        if got.shape != want.shape:
            dims = [i for i in range(max(len(got.shape), len(want.shape)))
                    if i >= len(got.shape) or i >= len(want.shape) or got.shape[i] != want.shape[i]]
            raise GGUFError(f"{path}: tensor {name} has shape {list(got.shape)}, expected {list(want.shape)} "
                            f"(dimension {dims[0]} differs)")
        role = want.role
        if role == "ffn_gate_tid2eid":
            allowed = {Q.I32}
        elif role in F32_ROLES:
            allowed = {Q.F32}
        else:
            allowed = WEIGHT_TYPES
        if got.qtype not in allowed:
            raise GGUFError(f"{path}: tensor {name} has type {got.qtype.name}, expected one of "
                            f"{', '.join(sorted(t.name for t in allowed))}")


__all__ = ["GGUFError", "GGUFFile", "WEIGHT_TYPES"]
