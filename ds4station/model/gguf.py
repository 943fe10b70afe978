"""The GGUF header and tensor table of a DS4 file: read, validated, memory-mapped read-only (numpy + gguf).

`GGUFFile.open(path)` parses the header with gguf-py's reader, builds the ModelConfig from the
`deepseek4.*` keys, and checks every tensor against the layout in `layout.py` (names, ggml shapes, types,
data inside the file), failing with a message that names the offending key or tensor. The file is mapped
read-only and shared (`mmap` mode "r"): no commit charge, so an 81 GiB file opens on a machine with less
RAM, and pages are read only when a tensor's bytes are touched. `raw(name)` is a read-only numpy view of
one tensor's blocks; engine/weights.py turns those views into torch tensors for one pipeline stage.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q

from .config import ConfigError, ModelConfig
from .layout import F32_ROLES, MTP_PREFIX, TensorSpec, model_tensors, mtp_tensors, tensor_bytes

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
    _reader: _Reader = field(repr=False)
    _offsets: dict[str, int] = field(repr=False)

    # ---- opening and validation ---------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> GGUFFile:
        """A model file: every tensor of the layout, and either all of the MTP layer's (make-model --mtp) or
        none of them."""
        path, reader, specs, offsets = _read(path)
        try:
            config = ModelConfig.from_metadata(reader.fields)
        except ConfigError as e:
            raise GGUFError(f"{path}: {e}") from e
        _check_tensors(path, config, specs, mtp=any(n.startswith(MTP_PREFIX) for n in specs))
        return cls(path, config, reader.fields, specs, reader, offsets)

    @classmethod
    def open_mtp(cls, path: str | os.PathLike[str], config: ModelConfig) -> GGUFFile:
        """A GGUF of the MTP layer alone (the published DeepSeek-V4-Flash-MTP file) for the model `config`: its
        tensors are checked against that model's MTP layout (names, shapes, types); its metadata is not read."""
        path, reader, specs, offsets = _read(path)
        _check_tensors(path, config, specs, mtp=True, model=False)
        return cls(path, config, reader.fields, specs, reader, offsets)

    @property
    def has_mtp(self) -> bool:
        """The file holds the MTP layer (validated when it was opened)."""
        return MTP_PREFIX + "e_proj.weight" in self.specs

    def mtp_specs(self) -> list[TensorSpec]:
        return [self.specs[s.name] for s in mtp_tensors(self.config, "f32")]

    # ---- tensor access ------------------------------------------------------------------------
    def tensor_specs(self, layers: range | None = None, *, embed: bool = True, output: bool = True) -> list[TensorSpec]:
        """The file's tensors for a layer slice plus embedding / head, in layout order."""
        return [self.specs[s.name] for s in model_tensors(self.config, "f32", layers, embed=embed, output=output)]

    def release(self) -> None:
        """Drop this process's mapping of the file's pages (madvise MADV_DONTNEED on the read-only, shared
        map): once a stage has repacked its weights into its own buffers, the pages it read stop counting in
        its resident memory. Nothing is lost: the data stays in the page cache (or on the disk), and a view
        read later faults its pages back in."""
        mm = getattr(self._reader.data, "_mmap", None)
        if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            mm.madvise(mmap.MADV_DONTNEED)

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


FINGERPRINT_SAMPLES = 16
FINGERPRINT_SAMPLE_BYTES = 1 << 16


def fingerprint(path: str | os.PathLike[str]) -> str:
    """A cheap identity of a model file's contents: its size and a hash of 16 samples of 64 KiB spread over
    it (the header and tensor data): files that differ in their weights differ here, a copy or a rename of the
    same file does not (what disk KV checkpoints are keyed by)."""
    size = os.path.getsize(path)
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as f:
        for i in range(FINGERPRINT_SAMPLES):
            f.seek(max(0, size - FINGERPRINT_SAMPLE_BYTES) * i // (FINGERPRINT_SAMPLES - 1))
            h.update(f.read(FINGERPRINT_SAMPLE_BYTES))
    return f"{size}:{h.hexdigest()}"


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order, innermost first
    qtype: Q
    data_offset: int  # absolute, in the file


class _Reader:
    """The GGUF header (v2 / v3, little-endian): metadata and tensor table, read straight from the read-only,
    shared memory map (no commit charge; pages are read only when touched). gguf-py's GGUFReader builds a
    numpy view per array element, ~3 s for a Flash file's 129,280-token vocabulary; this reads it in ~0.1 s
    (a test checks both agree). A tensor that runs past the end of the file is named."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data = np.memmap(path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self.data)
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic at the start of the file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", self._buf, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (this reads little-endian versions 2 and 3)")
        self._off = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            if key in self.fields:
                raise ValueError(f"duplicate key {key}")
            self.fields[key] = self._value(self._u32())
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._u32()
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, self._off)
            self._off += 8 * n_dims
            qtype = Q(self._u32())
            offset = self._take("<Q")
            infos.append((name, tuple(int(d) for d in dims), qtype, offset))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._off // align) * align
        size = len(self.data)
        self.tensors: list[_TensorInfo] = []
        for name, dims, qtype, offset in infos:
            end = start + offset + tensor_bytes(dims, qtype)
            if end > size:
                raise GGUFError(f"{path}: tensor {name} ends at byte {end} but the file has {size} bytes "
                                "(truncated download?)")
            self.tensors.append(_TensorInfo(name, dims, qtype, start + offset))

    def _take(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self._buf, self._off)
        self._off += struct.calcsize(fmt)
        return v

    def _u32(self) -> int:
        return self._take("<I")

    def _string(self) -> str:
        n = self._take("<Q")
        if self._off + n > len(self._buf):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        text = str(self._buf[self._off: self._off + n], "utf-8")
        self._off += n
        return text

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self._take(_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        itype, n = self._u32(), self._take("<Q")
        if itype in _NUMPY:  # one view for the whole array
            dtype = np.dtype(_NUMPY[itype])
            if self._off + n * dtype.itemsize > len(self._buf):
                raise ValueError(f"an array of {n} values runs past the end of the file")
            values = np.frombuffer(self._buf, dtype, n, self._off).tolist()
            self._off += n * dtype.itemsize
            return values
        return [self._value(itype) for _ in range(n)]


def _read(path: str | os.PathLike[str]) -> tuple[Path, _Reader, dict[str, TensorSpec], dict[str, int]]:
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    try:
        reader = _Reader(path)
    except GGUFError:
        raise
    except Exception as e:  # struct.error, ValueError, UnicodeDecodeError, ... on a damaged header
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    specs: dict[str, TensorSpec] = {}
    offsets: dict[str, int] = {}
    for t in reader.tensors:
        layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else None
        specs[t.name] = TensorSpec(t.name, t.dims, t.qtype, layer)
        offsets[t.name] = t.data_offset
    return path, reader, specs, offsets


def _check_tensors(path: Path, cfg: ModelConfig, found: Mapping[str, TensorSpec], *, mtp: bool = False,
                   model: bool = True) -> None:
    specs = (model_tensors(cfg, "f32") if model else []) + (mtp_tensors(cfg, "f32") if mtp else [])
    expected = {s.name: s for s in specs}
    missing = [n for n in expected if n not in found]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        what = "the MTP layer's " if all(n.startswith(MTP_PREFIX) for n in missing) else ""
        raise GGUFError(f"{path}: missing {what}tensor(s) {', '.join(missing[:5])}{more}")
    unexpected = [n for n in found if n not in expected]
    if unexpected:
        raise GGUFError(f"{path}: unexpected tensor(s) for this config: {', '.join(unexpected[:5])}")
    for name, want in expected.items():
        got = found[name]
        if got.shape != want.shape:
            dims = [i for i in range(max(len(got.shape), len(want.shape)))
                    if i >= len(got.shape) or i >= len(want.shape) or got.shape[i] != want.shape[i]]
            raise GGUFError(f"{path}: tensor {name} has shape {list(got.shape)}, expected {list(want.shape)} "
                            f"(dimension {dims[0]} differs{' for this model' if not model else ''})")
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
