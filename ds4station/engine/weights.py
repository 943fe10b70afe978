"""Tensors of a DS4 GGUF as torch sees them, and the writer.

`load_tensors(gguf, layers=...)` gives zero-copy `QTensor` views of exactly one pipeline stage's tensors in
the read-only memory map of model/gguf.py, so a stage never touches the pages of layers it does not own.
The views must not be written to (the pages are mapped read-only): every consumer copies what it keeps
(dequantises, repacks or moves it to a device). `write_gguf` writes a DS4 file tensor by tensor.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType, GGUFWriter

from ds4station.kernels.quants import QTensor, quantize
from ds4station.model.config import ARCH, ModelConfig
from ds4station.model.gguf import GGUFError, GGUFFile
from ds4station.model.layout import TensorSpec, model_tensors, tensor_bytes

# Keys stored as 64-bit in ds4's files; every other integer key is u32.
_U64_KEYS = {"context_length", "rope.scaling.original_context_length"}
_TOKEN_TYPE_KEY = "tokenizer.ggml.token_type"


def tensor_view(gguf: GGUFFile, name: str) -> QTensor:
    """A zero-copy, read-only view of one tensor's raw blocks in the memory map."""
    spec = gguf.specs.get(name)
    if spec is None:
        raise KeyError(f"{gguf.path}: no tensor named {name}")
    with warnings.catch_warnings():  # torch warns that the array is read-only: that is the point
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(gguf.raw(name))
    return QTensor(data, spec.qtype, spec.torch_shape)


def load_tensors(gguf: GGUFFile, layers: range | None = None, *, embed: bool = True,
                 output: bool = True) -> dict[str, QTensor]:
    """Views of exactly the tensors one pipeline stage needs; nothing else is touched."""
    return {s.name: tensor_view(gguf, s.name) for s in gguf.tensor_specs(layers, embed=embed, output=output)}


def write_gguf(path: str | os.PathLike[str], cfg: ModelConfig, tensors: Mapping[str, torch.Tensor | QTensor] | None,
               recipe: str = "q2", tokenizer_meta: Mapping[str, Any] | None = None,
               extra_meta: Mapping[str, Any] | None = None, specs: list[TensorSpec] | None = None) -> Path:
    """Write a DS4 GGUF. Float tensors (torch order) are quantised to the recipe's type for their role;
    QTensor values are written as they are: in their own type when `tensors` is a dict, in the recipe's
    type otherwise (a lazy Mapping makes each tensor when it is asked for, once, in layout order, so the
    whole model never sits in memory). Every tensor of the layout must be present. `tensors=None` writes
    the header and tensor table only and extends the file to its full size without data (a sparse file:
    it costs no disk, and every path that reads only the header works on it). The file appears under its
    name only once complete. `specs`: the tensors to write (default: the model's layout in the recipe's types;
    with the MTP layer, `model_tensors(..., mtp=True)`; the MTP layer alone, `mtp_tensors`)."""
    path = Path(path)
    specs = model_tensors(cfg, recipe) if specs is None else specs
    if tensors is not None:
        names = {s.name for s in specs}
        missing = [n for n in names if n not in tensors]
        extra = [n for n in tensors if n not in names]
        if missing or extra:
            raise GGUFError(f"write_gguf: missing {sorted(missing)[:5]} unexpected {sorted(extra)[:5]}")
    if isinstance(tensors, dict):
        specs = [TensorSpec(s.name, s.shape, v.qtype, s.layer) if isinstance(v := tensors[s.name], QTensor) else s
                 for s in specs]
    tmp = path.with_name(path.name + ".partial")
    writer = GGUFWriter(tmp, ARCH)
    for key, value in cfg.to_metadata().items():
        _add_kv(writer, f"{ARCH}.{key}", value, u64=key in _U64_KEYS)
    writer.add_uint32(f"{ARCH}.expert_group_count", 0)
    writer.add_uint32(f"{ARCH}.expert_group_used_count", 0)
    for key, value in {**(tokenizer_meta or {}), **(extra_meta or {})}.items():
        _add_kv(writer, key, value)
    for spec in specs:
        nbytes = tensor_bytes(spec.shape, spec.qtype)
        if spec.qtype in _NUMPY_TYPES:
            writer.add_tensor_info(spec.name, spec.torch_shape, np.dtype(_NUMPY_TYPES[spec.qtype]), nbytes)
        else:
            byte_shape = (*spec.torch_shape[:-1], tensor_bytes(spec.shape[:1], spec.qtype))
            writer.add_tensor_info(spec.name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=spec.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    if tensors is None:
        fout = writer.fout[0]
        fout.flush()
        align = writer.data_alignment
        end = GGUFWriter.ggml_pad(fout.tell(), align) + sum(GGUFWriter.ggml_pad(tensor_bytes(s.shape, s.qtype), align)
                                                           for s in specs)
        os.truncate(fout.name, end)
    else:
        for spec in specs:
            writer.write_tensor_data(_tensor_array(spec, tensors[spec.name]))
    writer.close()
    os.replace(tmp, path)
    return path


_NUMPY_TYPES = {Q.F32: np.float32, Q.F16: np.float16, Q.I32: np.int32}


def _tensor_array(spec: TensorSpec, t: torch.Tensor | QTensor) -> np.ndarray:
    """One tensor's bytes as the writer stores them, in the type of `spec`."""
    if isinstance(t, QTensor):
        if t.qtype != spec.qtype:
            raise GGUFError(f"write_gguf: {spec.name} is {t.qtype.name}, the recipe says {spec.qtype.name}")
        raw = t.data
    else:
        if tuple(t.shape) != spec.torch_shape:
            raise GGUFError(f"write_gguf: {spec.name} has shape {tuple(t.shape)}, expected {spec.torch_shape}")
        raw = t.to(torch.int32) if spec.qtype == Q.I32 else quantize(t, spec.qtype)
    arr = raw.detach().cpu().contiguous().numpy()
    if spec.qtype in _NUMPY_TYPES:
        return arr.view(_NUMPY_TYPES[spec.qtype]).reshape(spec.torch_shape)
    return arr.view(np.uint8).reshape(*spec.torch_shape[:-1], tensor_bytes(spec.shape[:1], spec.qtype))


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





__all__ = ["load_tensors", "tensor_view", "write_gguf"]
