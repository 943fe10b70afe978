"""GGUF I/O for the DS4 layout: read (validated, memory-mapped, per-stage) and write.

`GGUFFile.open(path)` parses the header with gguf-py's reader, builds the ModelConfig from the
`deepseek4.*` keys, and checks every tensor against the layout in `layout.py` (names, ggml shapes, types,
data inside the file), failing with a message that names the offending key or tensor. Tensor data stays
in the memory map: `load(layers=...)` returns zero-copy views for one pipeline stage only, so a stage never
touches the pages of layers it does not own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from .config import ARCH, ConfigError, ModelConfig
from .layout import F32_ROLES, TensorSpec, model_tensors, quant_type, tensor_bytes
from .quants import QTensor, quantize

# Types a DS4 weight may be stored in (ds4 accepts these; the dequantiser handles all of them).
WEIGHT_TYPES = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ2_XXS, Q.MXFP4}
# Keys stored as 64-bit in ds4's files; every other integer key is u32.
_U64_KEYS = {"context_length", "rope.scaling.original_context_length"}
_TOKEN_TYPE_KEY = "tokenizer.ggml.token_type"


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

    def tensor(self, name: str) -> QTensor:
        """A zero-copy view of one tensor's raw blocks in the memory map."""
        spec = self.specs.get(name)
        if spec is None:
            raise KeyError(f"{self.path}: no tensor named {name}")
        off = self._offsets[name]
        raw = self._reader.data[off: off + spec.n_bytes]
        return QTensor(torch.from_numpy(np.asarray(raw)), spec.qtype, spec.torch_shape)

    def load(self, layers: range | None = None, *, embed: bool = True, output: bool = True) -> dict[str, QTensor]:
        """Views of exactly the tensors one pipeline stage needs; nothing else is touched."""
        return {s.name: self.tensor(s.name) for s in self.tensor_specs(layers, embed=embed, output=output)}

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
        super().__init__(path, "c")  # copy-on-write: torch gets a writable view, the file is never changed

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


# ---- writing ----------------------------------------------------------------------------------
def write_gguf(path: str | os.PathLike[str], cfg: ModelConfig, tensors: Mapping[str, torch.Tensor | QTensor],
               recipe: str = "q2", tokenizer_meta: Mapping[str, Any] | None = None,
               extra_meta: Mapping[str, Any] | None = None) -> Path:
    """Write a DS4 GGUF. Float tensors (torch order) are quantised to the recipe's type for their role;
    QTensor values are written as they are, in their own type. Every tensor of the layout must be present.
    The file appears under its name only once complete."""
    path = Path(path)
    specs = model_tensors(cfg, recipe)
    names = {s.name for s in specs}
    missing = [n for n in names if n not in tensors]
    extra = [n for n in tensors if n not in names]
    if missing or extra:
        raise GGUFError(f"write_gguf: missing {sorted(missing)[:5]} unexpected {sorted(extra)[:5]}")
    tmp = path.with_name(path.name + ".partial")
    writer = GGUFWriter(tmp, ARCH)
    for key, value in cfg.to_metadata().items():
        _add_kv(writer, f"{ARCH}.{key}", value, u64=key in _U64_KEYS)
    writer.add_uint32(f"{ARCH}.expert_group_count", 0)
    writer.add_uint32(f"{ARCH}.expert_group_used_count", 0)
    for key, value in {**(tokenizer_meta or {}), **(extra_meta or {})}.items():
        _add_kv(writer, key, value)
    for spec in specs:
        t = tensors[spec.name]
        if isinstance(t, QTensor):
            spec = TensorSpec(spec.name, spec.shape, t.qtype, spec.layer)
            raw = t.data
        else:
            if tuple(t.shape) != spec.torch_shape:
                raise GGUFError(f"write_gguf: {spec.name} has shape {tuple(t.shape)}, expected {spec.torch_shape}")
            raw = t.to(torch.int32) if spec.qtype == Q.I32 else quantize(t, spec.qtype)
        arr = raw.detach().cpu().contiguous().numpy()
        if spec.qtype in (Q.F32, Q.F16, Q.I32):
            arr = arr.view({Q.F32: np.float32, Q.F16: np.float16, Q.I32: np.int32}[spec.qtype])
            arr = arr.reshape(spec.torch_shape)
            writer.add_tensor(spec.name, arr)
        else:
            byte_shape = (*spec.torch_shape[:-1], tensor_bytes(spec.shape[:1], spec.qtype))
            writer.add_tensor(spec.name, arr.view(np.uint8).reshape(byte_shape), raw_dtype=spec.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
    return path


def _add_kv(writer: GGUFWriter, key: str, value: Any, u64: bool = False) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, int):
        (writer.add_uint64 if u64 else writer.add_uint32)(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, (list, tuple)):
        if value and isinstance(value[0], str):
            writer.add_array(key, list(value))
        elif value and isinstance(value[0], float):
            writer.add_key_value(key, list(value), GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
        else:
            sub = GGUFValueType.INT32 if key == _TOKEN_TYPE_KEY else GGUFValueType.UINT32
            writer.add_key_value(key, [int(v) for v in value], GGUFValueType.ARRAY, sub_type=sub)
    else:
        raise GGUFError(f"cannot write metadata {key}={value!r} ({type(value).__name__})")


__all__ = ["GGUFError", "GGUFFile", "WEIGHT_TYPES", "quant_type", "write_gguf"]
