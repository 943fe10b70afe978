"""Native kernels of a CPU stage: quantised matvecs and row dequantisation in C (cpu_kernels.c), compiled at first
use with the system's C compiler and loaded through ctypes.

A CPU stage keeps its weights in their file types (issue 18); its torch references dequantise each matrix to
fp32 with a chain of tensor ops per use (~1.2 s per Flash layer per decoded token on two cores; these kernels
24-35x less, docs/PERFORMANCE.md). These kernels
read each quantised weight once per call for all activation rows (`matvec`, decode: up to MAX_ROWS rows), or
write fp32 rows for a BLAS matmul (`dequantize`, prefill), over as many OpenMP threads as torch uses
(torch.get_num_threads(): the stage's `threads`). On x86 with AVX2 the routed experts' types (INT8_TYPES) also
have an integer-dot matvec (`matvec(..., int8=True)`; int8 activations per 32 values, AVX-512 VNNI / AVX-VNNI
where present), which ops.moe runs for decode steps as the GPU runs its integer-dot kernels (ops.moe_int_dot).

The library is built into cache_dir()/cpu-kernels/ (`cc -O3 -march=native -fopenmp`, keyed by the source, the
compiler and the CPU's flags) the first time a CPU stage needs it; `CC` names the compiler; one without OpenMP
builds it single-threaded (warned). Where none can build it (warned once), or with `DS4STATION_CPU_KERNELS=0`,
`available()` is False and the CPU stage runs the torch references as before.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

import torch

from ds4station.cache import cache_dir
from ds4station.kernels.iq2_xxs import PackedIQ2XXS, _grid_np, _signed_grid
from ds4station.kernels.q2_k import PackedQ2K
from ds4station.kernels.q4_k import PackedQ4K
from ds4station.kernels.q8_0 import PackedQ8_0

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
MAX_ROWS = 8  # DS4_MAX_ROWS in the source: activation rows per matvec call
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")

_i64 = ctypes.c_int64
_p = ctypes.c_void_p
# argument types after the weight pointers: matvec (x, ldx, y, ldy, N, K, M, rpg, threads), dequant (out, N, K,
# threads)
_MATVEC = [_p, _i64, _p, _i64, _i64, _i64, _i64, _i64, ctypes.c_int]
_DEQUANT = [_p, _i64, _i64, ctypes.c_int]
_WEIGHT_PTRS = {"q8_0": 2, "iq2_xxs": 4, "q2_k": 3, "q4_k": 4}  # the IQ2_XXS tables count as weights here
# types with an integer-dot matvec (`ds4_<type>_matvec_i8`, where the build has them: x86 with AVX2): the routed
# experts' types, whose decode the MoE runs through it by default as the GPU's does (ops.moe's int_dot)
INT8_TYPES = ("iq2_xxs", "q2_k", "q4_k")
_lock = threading.Lock()
# the packed fields' dtypes the C functions read
_DTYPES = {"q8_0": (torch.int8, torch.float16), "iq2_xxs": (torch.int32, torch.float16),
           "q2_k": (torch.uint8, torch.uint8, torch.float16),
           "q4_k": (torch.uint8, torch.uint8, torch.uint8, torch.float16)}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    return cc if cc else shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def build(out_dir: Path | None = None) -> Path:
    """Compile the kernels (unless built already) and return the library's path; raises on failure. A compiler
    without OpenMP (clang without libomp) builds them single-threaded, with a warning."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang; or set CC)")
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + cc.encode() + " ".join(FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir() / "cpu-kernels"
    lib = out_dir / f"ds4cpu-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)  # built beside, then renamed: never a half-written one
    os.close(fd)
    try:
        errors = []
        for flags in (FLAGS, tuple(f for f in FLAGS if f != "-fopenmp")):
            r = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=300)
            if r.returncode == 0:
                if "-fopenmp" not in flags:
                    log.warning("%s could not build the CPU kernels with OpenMP (%s); they run on one thread", cc,
                                errors[0][-300:])
                os.replace(tmp, lib)
                return lib
            errors.append((r.stderr or r.stdout).strip())
        raise RuntimeError(f"{cc} failed: {errors[-1][-2000:]}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    if os.environ.get("DS4STATION_CPU_KERNELS", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except Exception as e:  # no compiler, a failed build, a library that does not load: the torch references
        log.warning("CPU kernels unavailable (%s); CPU stages run the torch references (slower)", e)
        return None
    for qt, n in _WEIGHT_PTRS.items():
        getattr(lib, f"ds4_{qt}_matvec").argtypes = [_p] * n + _MATVEC
        getattr(lib, f"ds4_{qt}_dequant").argtypes = [_p] * n + _DEQUANT
        getattr(lib, f"ds4_{qt}_matvec").restype = getattr(lib, f"ds4_{qt}_dequant").restype = None
    lib.ds4_int8.restype = ctypes.c_int
    if lib.ds4_int8():
        for qt in INT8_TYPES:
            getattr(lib, f"ds4_{qt}_matvec_i8").argtypes = [_p] * _WEIGHT_PTRS[qt] + _MATVEC
            getattr(lib, f"ds4_{qt}_matvec_i8").restype = None
    return lib


def available() -> bool:
    """Whether the native kernels are built and loaded (building them on the first call)."""
    with _lock:
        return _lib() is not None


@lru_cache(maxsize=1)
def _iq2_xxs_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """The grid's magnitudes (fp32 [256, 8]) and each 7-bit sign field's 8 signs as +-1 (fp32 [128, 8]): the
    signed grid's first 128 rows (entry 0, whose magnitudes are all non-zero, under every sign field)."""
    return torch.from_numpy(_grid_np()).contiguous(), _signed_grid(torch.device("cpu"))[:128].sign().contiguous()


@lru_cache(maxsize=1)
def _iq2_xxs_int_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """The integer matvec's tables, one 64-bit word per entry: the grid's 8 magnitudes as bytes [256], and each
    7-bit sign field's 8 signs as +-1 bytes [128]."""
    grid, signs = _iq2_xxs_tables()
    return (grid.to(torch.uint8).contiguous().view(torch.int64).reshape(256),
            signs.to(torch.int8).contiguous().view(torch.int64).reshape(128))


def int8_matvec(qtype: str) -> bool:
    """Whether `matvec(..., int8=True)` can run a `qtype` weight (this build has the integer dot for its type)."""
    lib = _lib()
    return qtype in INT8_TYPES and lib is not None and bool(lib.ds4_int8())


def _weights(w: PackedQ8_0 | PackedIQ2XXS | PackedQ2K | PackedQ4K,
             int8: bool = False) -> tuple[list[torch.Tensor], list[int]]:
    """The tensors whose pointers the C functions take (`int8`: the integer matvec's), contiguous (kept alive by
    the caller), and those pointers."""
    if isinstance(w, PackedQ8_0):
        ts = [w.qs, w.d]
    elif isinstance(w, PackedIQ2XXS):
        ts = [w.qs, w.d, *(_iq2_xxs_int_tables() if int8 else _iq2_xxs_tables())]
    elif isinstance(w, PackedQ2K):
        ts = [w.qs, w.sc, w.dm]
    elif isinstance(w, PackedQ4K):
        ts = [w.qs, w.sc, w.mn, w.dm]
    else:
        raise TypeError(f"no CPU kernel for {type(w).__name__}")
    if ts[0].dim() != 2 or ts[0].device.type != "cpu":
        raise ValueError(f"CPU kernels take one 2-D weight on the CPU, got {w.qtype} qs {tuple(ts[0].shape)} on "
                         f"{ts[0].device}")
    want = _DTYPES[w.qtype]
    if tuple(t.dtype for t in ts[:len(want)]) != want:
        raise TypeError(f"{w.qtype} fields are {[t.dtype for t in ts[:len(want)]]}, the CPU kernels read {list(want)}")
    ts = [t.contiguous() for t in ts]
    return ts, [t.data_ptr() for t in ts]


def matvec(x: torch.Tensor, w: PackedQ8_0 | PackedIQ2XXS | PackedQ2K | PackedQ4K, groups: int = 1,
           int8: bool = False) -> torch.Tensor:
    """y [M, N] fp32 = x [M, groups * K] @ W^T (groups > 1: weight rows split evenly, group g reading x's columns
    g*K .. (g+1)*K), any M (calls of MAX_ROWS rows), in fp32 math (the dequantised matrix's values). Needs
    `available()`. `int8` (where `int8_matvec` allows it): the integer dot, x quantised to int8 per 32 values as
    the GPU's integer-dot kernels do (the values of moe.matvec_ref with act_quant)."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("CPU kernels are not available")
    n, k = w.n, w.k
    if x.dim() != 2 or x.shape[1] != groups * k or n % groups:
        raise ValueError(f"x {tuple(x.shape)} does not match weight [{n}, {k}] in {groups} groups")
    if int8 and not int8_matvec(w.qtype):
        raise ValueError(f"no integer-dot CPU matvec for {w.qtype} in this build")
    x = x.float().contiguous()
    ts, ptrs = _weights(w, int8)
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    fn = getattr(lib, f"ds4_{w.qtype}_matvec{'_i8' if int8 else ''}")
    for m0 in range(0, x.shape[0], MAX_ROWS):
        m = min(MAX_ROWS, x.shape[0] - m0)
        fn(*ptrs, x[m0].data_ptr(), x.stride(0), y[m0].data_ptr(), y.stride(0), n, k, m, n // groups,
           torch.get_num_threads())
    del ts
    return y


def dequantize(w: PackedQ8_0 | PackedIQ2XXS | PackedQ2K | PackedQ4K, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [N, K] values of a 2-D repacked weight (the same values as its torch dequantize_*), written into `out`
    (a contiguous fp32 buffer of at least N * K values, reused: a fresh 32 MiB tensor costs ~10x the decode in
    page faults) when given, as a view of it. Needs `available()`."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("CPU kernels are not available")
    ts, ptrs = _weights(w)
    if out is None:
        out = torch.empty(w.n * w.k, dtype=torch.float32)
    elif out.dtype != torch.float32 or not out.is_contiguous() or out.numel() < w.n * w.k:
        raise ValueError(f"out must be a contiguous fp32 buffer of >= {w.n * w.k} values")
    getattr(lib, f"ds4_{w.qtype}_dequant")(*ptrs, out.data_ptr(), w.n, w.k, torch.get_num_threads())
    del ts
    return out.view(-1)[:w.n * w.k].view(w.n, w.k)
