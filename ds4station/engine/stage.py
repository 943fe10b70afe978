"""One stage of a route: its layer slice on its backend, the KV slots of its layers, its experts; and the
worker loop that runs a stage in its own process (`ds4station worker`).

Shared by the engine (engine.py, rank 0, which runs stage 0 in its own process) and the workers:
- `choose_backend`, the one place that decides how a stage computes: the kernel stage (gpu.py) on every
  device, routed experts resident or streamed (engine/experts.py); the fp32 reference slice (model.py) when
  asked for. Both
  backends have one interface: `prefill(tokens, cache, X, logits=)` / `decode(token, cache, X, logits=)`
  take the HC state from the previous stage (or embed the tokens) and give the next stage's state (or the
  head's logits), with `embed` and `head` as their building blocks;
- `StageRunner`: builds the backend from the memory-mapped GGUF (only that stage's tensors are touched),
  allocates `sessions` KV slots sized for the stage's layers at load (a session is a slot, reused with its
  decode graphs), and warms up (`warm`: kernels compiled, decode graphs captured) before the stage is ready;
- the wire protocol: every message is an int64 header [op, session, n, bits, flags, arg, payload bytes, 0]
  followed, when payload bytes > 0, by one uint8 payload (a batched decode step, OP_BATCH, carries n session
  ids before its tokens and states; a disk checkpoint's save or load, OP_SAVE / OP_LOAD, the entry
  directory's path, and each stage ORs FLAG_FAILED into the header it forwards when its own file failed).
  Messages flow down the chain rank 0 -> 1 -> ... ->
  n-1, each worker applying and forwarding them, so a worker only ever listens to its predecessor; the last
  stage answers rank 0 directly (the logits when it holds the output head, else the last position's HC
  state, which rank 0 turns into logits; or a status acknowledgement);
- the rendezvous through the coordinator's TCPStore: `config` (JSON: model, route, ctx, ...), per rank
  `ready/R` or `error/R` (the message a failed worker leaves), `hb/R` (a heartbeat counter) and `stats/R`
  (JSON stage statistics for /status);
- device pinning: `pin_env` turns a route device (cpu, cuda:N, PCI bus id, UUID) into the environment that
  makes a child process see exactly that GPU, never an enumeration index another library might order
  differently.

A worker is fail-stop: any error is published under `error/R` and the process exits; the coordinator sees
the exit (or the missing heartbeats of a remote worker) and fails the requests in flight naming the stage.
A worker also exits by itself when its coordinator goes away (parent pid changes or the store stops
answering), so an interrupted server never leaves workers behind.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ds4station.engine.weights import load_tensors, tensor_view
from ds4station.kernels.quants import QTensor
from ds4station.model.footprint import MTP_RING_EXTRA
from ds4station.model.gguf import GGUFFile
from ds4station.model.route import Route, RouteError, Stage, parse_route

from .experts import ExpertCache, ExpertCacheTooSmall
from .gpu import ALL_ROWS, MIN_BUCKET, GpuMTP, GpuStage
from .kv import KVCache, KVPool, dtype_name
from .kvdisk import StateFileError, read_state_file, stage_file, write_state_file
from .model import DS4Model, MTPLayer, RoundTrips
from .mtp import MtpDrafts

# ---- wire protocol -----------------------------------------------------------------------------------
(OP_EXTEND, OP_NEW, OP_FREE, OP_TRUNCATE, OP_STATUS, OP_SHUTDOWN, OP_CHECKPOINT, OP_REWIND, OP_BATCH, OP_SAVE,
 OP_LOAD, OP_DROP, OP_DRAFT) = range(1, 14)
FLAG_RESULT = 1  # the last piece of an extend: the last stage sends the result back to rank 0
FLAG_FAILED = 2  # OP_SAVE / OP_LOAD: a stage could not save or load its file (its log says why)
FLAG_ALL = 4  # an extend whose result is every position's (a draft's verification), not only the last one's
# An extend of a route whose rank 0 applies the head and holds the MTP layer: the last stage sends back every
# piece's last states (`tail_rows` of them), which rank 0 records for the layer (engine/mtp.py).
FLAG_TAIL = 8
HEADER_LEN = 8
ACTIVATION_BITS = (16, 32)
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The process group's own timeout must outlast any idle period (a worker waits in recv between requests);
# liveness is judged by heartbeats and process exits instead.
PG_TIMEOUT = datetime.timedelta(days=3650)

EXIT_OK, EXIT_ERROR, EXIT_CONFIG, EXIT_ORPHANED = 0, 1, 2, 3


def tail_rows(n: int, every: bool, cfg: Any) -> int:
    """States a FLAG_TAIL piece of n tokens sends back: all of a verification's, else the MTP ring's worth."""
    return n if every else min(n, cfg.window + MTP_RING_EXTRA)


def header(op: int, sid: int = 0, n: int = 0, bits: int = 0, flags: int = 0, arg: int = 0,
           payload: int = 0) -> torch.Tensor:
    return torch.tensor([op, sid, n, bits, flags, arg, payload, 0], dtype=torch.int64)


def pack(tokens: torch.Tensor, X: torch.Tensor, bits: int) -> torch.Tensor:
    """tokens [T] int64 + HC state [T, C, dim] -> one uint8 payload.

    32 bits: the state as float32 (bit-exact). 16 bits: float16 with one power-of-two scale per (token,
    stream) row, chosen so the row's largest magnitude lands in [2^14, 2^15]: fp16's 11-bit significand
    (8x finer than bf16's) without its overflow at 65504; scaling by a power of two adds no rounding."""
    t = tokens.to(torch.int64).contiguous().view(torch.uint8)
    X = X.float()
    if bits == 32:
        return torch.cat((t.to(X.device), X.contiguous().view(torch.uint8).flatten()))
    if bits != 16:
        raise ValueError(f"activation bits {bits}: use 16 or 32")
    amax = X.abs().amax(-1, keepdim=True).clamp(min=2.0**-100)  # [T, C, 1]
    scale = torch.exp2(torch.ceil(torch.log2(amax / 2.0**15)))
    q = (X / scale).to(torch.float16)
    return torch.cat((t.to(X.device), scale.contiguous().view(torch.uint8).flatten(),
                      q.contiguous().view(torch.uint8).flatten()))


def unpack(buf: torch.Tensor, n: int, bits: int, hc: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack` -> (tokens [n] int64, HC state [n, hc, dim] float32)."""
    tokens = buf[: 8 * n].view(torch.int64)
    body = buf[8 * n:]
    if bits == 32:
        return tokens, body.view(torch.float32).view(n, hc, dim)
    scale = body[: 4 * n * hc].view(torch.float32).view(n, hc, 1)
    q = body[4 * n * hc:].view(torch.float16).view(n, hc, dim)
    return tokens, q.float() * scale


def payload_bytes(n: int, bits: int, hc: int, dim: int) -> int:
    """Bytes `pack` produces for n tokens."""
    return 8 * n + (n * hc * dim * 4 if bits == 32 else n * hc * 4 + n * hc * dim * 2)


# ---- devices -----------------------------------------------------------------------------------------
def _is_hip() -> bool:
    return getattr(torch.version, "hip", None) is not None


def resolve_device(spec: str) -> torch.device:
    """A route device as a torch device of this process: cpu, cuda:N, or the GPU with that PCI bus id/UUID."""
    if spec == "cpu" or spec.startswith("cuda:"):
        return torch.device(spec)
    if not torch.cuda.is_available():
        raise RouteError(f"device {spec}: no GPU is visible to this process")
    want = spec.lower().removeprefix("gpu-")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        uuid = str(getattr(p, "uuid", "")).lower()
        bus = (f"{getattr(p, 'pci_domain_id', 0):04x}:{getattr(p, 'pci_bus_id', -1):02x}:"
               f"{getattr(p, 'pci_device_id', -1):02x}.0")
        if uuid and want in (uuid, uuid.removeprefix("gpu-")) or want in (bus, bus[5:]):
            return torch.device(f"cuda:{i}")
    raise RouteError(f"device {spec}: no visible GPU has this PCI bus id or UUID")


def pin_env(spec: str, parent_env: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
    """Environment updates that make a child process see exactly the route device `spec`, and the torch
    device the child then uses. UUIDs go straight into CUDA_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES; a PCI
    bus id is turned into the GPU's UUID through the hardware scan; cuda:N is the parent's N-th visible GPU."""
    env = os.environ if parent_env is None else parent_env
    if spec == "cpu":
        return {"CUDA_VISIBLE_DEVICES": ""} if not _is_hip() else {"ROCR_VISIBLE_DEVICES": ""}, "cpu"
    var = "ROCR_VISIBLE_DEVICES" if _is_hip() else "CUDA_VISIBLE_DEVICES"
    if spec.startswith("cuda:"):
        n = int(spec.split(":")[1])
        visible = [v for v in env.get(var, "").split(",") if v.strip()]
        if visible:
            if n >= len(visible):
                raise RouteError(f"device {spec}: only {len(visible)} GPU(s) are visible ({var}={env[var]})")
            return {var: visible[n].strip()}, "cuda:0"
        return {var: str(n)}, "cuda:0"
    if ":" in spec:  # PCI bus id
        from ds4station.hardware import detect

        bus = spec.lower() if spec.count(":") == 2 else "0000:" + spec.lower()
        for gpu in detect():
            if str(gpu.pci_bus_id).lower() == bus and isinstance(gpu.uuid, str):
                var = "ROCR_VISIBLE_DEVICES" if gpu.vendor == "amd" else "CUDA_VISIBLE_DEVICES"
                return {var: gpu.uuid}, "cuda:0"
        raise RouteError(f"device {spec}: no GPU with this PCI bus id was found (see `ds4station detect`)")
    return {var: spec}, "cuda:0"


# ---- the stage ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageSettings:
    """What every stage of one pipeline shares (published to workers as JSON)."""

    model: str
    route: str
    ctx: int
    chunk: int
    rollback: int
    sessions: int = 1  # KV slots every stage allocates at load (the live sessions the engine can hold)
    kv_dtype: str = "float32"
    backend: str = "gloo"
    prefetch: bool = True
    fp8_kv: bool = True  # model.RoundTrips: the quantisation round trips of the real model (on by default)
    indexer_fp4: bool = True
    compute: str = "auto"  # the stage backend: auto (see choose_backend), kernels or reference
    warm: bool = True  # compile the kernels and capture the decode graphs before reporting ready
    world: int = 1
    verify_rows: int = 0  # speculative decoding's verification (a token and its drafts): its graphs captured too
    mtp: str = ""  # the MTP layer (--draft mtp): "" none, MTP_IN_MODEL from the model file, else its own GGUF

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str | bytes) -> StageSettings:
        return cls(**json.loads(text))


COMPUTE = ("auto", "kernels", "reference")
MTP_IN_MODEL = "model"  # StageSettings.mtp: the model file holds the MTP layer
EMBED = "token_embd.weight"
# Decode graphs captured before ready cover positions up to this many tokens (more buckets are captured
# when a session first reaches them).
WARM_POSITIONS = 65536
# Batched decode graphs (every batch size up to the sessions, per position bucket) captured before ready up to
# here; a batch at a later bucket captures its graph when it first runs (0.3-0.6 s at full shape on an H200).
BATCH_WARM_POSITIONS = 16384


def warm_lengths(chunk: int) -> list[int]:
    """Prefill lengths that meet every variant the kernels compile for a step of 1..chunk tokens: the
    matvec path of up to 8 rows takes the row count as a compile-time constant, tiles grow by powers of two
    of the length, and Triton specialises integer arguments divisible by 16 (so b and b - 1 per power b)."""
    out, b = set(range(1, 16)), 16
    while b <= chunk:
        out |= {b, b - 1}
        b *= 2
    return sorted(n for n in out | {chunk} if n <= chunk)


def warm_positions(ctx: int) -> list[int]:
    """Positions (powers of two from 64) where the context-dependent tiles change (the indexer's key count,
    the compressed rows read), up to WARM_POSITIONS."""
    out, p = [], 64
    while p < min(ctx, WARM_POSITIONS):
        out.append(p)
        p *= 2
    return out


def stage_label(rank: int, stage: Stage) -> str:
    return f"stage {rank} ({stage.device}, layers {stage.first_layer}-{stage.last_layer})"


def choose_backend(device: torch.device, stage: Stage, compute: str = "auto") -> str:
    """The one place that decides how a stage computes: "kernels" (engine/gpu.py: weights quantised as in the
    file, Triton kernels on a GPU and their torch references on the CPU, graph decode, routed experts resident
    or streamed through the stage's cache) unless `compute` asks for "reference" (the fp32 DS4Model slice:
    every weight dequantised at load, what the tests compare the kernel stage with)."""
    if compute not in COMPUTE:
        raise ValueError(f"compute {compute!r}: use one of {', '.join(COMPUTE)}")
    if compute == "reference" and stage.streaming:
        raise ValueError(f"{stage.device}: streamed experts run on the kernel stage; drop the stage's cache= "
                         "or let the engine choose the backend")
    return "reference" if compute == "reference" else "kernels"


class _Progress(Mapping[str, QTensor]):
    """A stage's tensors, reporting `progress(bytes handed out, total bytes)` as each one is first taken."""

    def __init__(self, tensors: dict[str, QTensor], progress: Callable[[int, int], None]) -> None:
        self.tensors, self.progress = tensors, progress
        self.total, self.done, self.taken = sum(q.nbytes for q in tensors.values()), 0, set()

    def __getitem__(self, name: str) -> QTensor:
        q = self.tensors[name]
        if name not in self.taken:
            self.taken.add(name)
            self.done += q.nbytes
            self.progress(self.done, self.total)
        return q

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


class StageRunner:
    """The compute of one stage: its layer slice on the backend `choose_backend` picks, its experts, and
    `settings.sessions` KV slots for its layers, allocated at load (so what a stage holds is known when it
    says ready). A session is a slot; a freed slot is reset and reused, with its decode graphs."""

    def __init__(self, gguf: GGUFFile, stage: Stage, settings: StageSettings, device: torch.device, *,
                 rank: int = 0, progress: Callable[[int, int], None] | None = None) -> None:
        self.cfg, self.stage, self.settings, self.device, self.rank = gguf.config, stage, settings, device, rank
        views = load_tensors(gguf, stage.layers, embed=stage.embed, output=stage.output)
        mtp_file = None
        # The stage whose steps end in the head (the last one, holding it) returns logits. The MTP layer sits
        # beside the head: on that stage (with a copy of the token embedding it reads), or on rank 0 when rank 0
        # applies the head to the states the last stage sends back (and records them, Engine._extend).
        self.head_here = stage.output and rank == settings.world - 1
        if settings.mtp and stage.output:
            mtp_file = gguf if settings.mtp == MTP_IN_MODEL else GGUFFile.open_mtp(settings.mtp, gguf.config)
            views |= {s.name: tensor_view(mtp_file, s.name) for s in mtp_file.mtp_specs()}
            views.setdefault(EMBED, tensor_view(gguf, EMBED))
        tensors: Mapping[str, QTensor] = views if progress is None else _Progress(views, progress)
        self.experts: ExpertCache | None = None
        self.model: DS4Model | GpuStage
        round_trips = RoundTrips(settings.fp8_kv, settings.indexer_fp4)
        self.compute = choose_backend(device, stage, settings.compute)
        kv_dtype = KV_DTYPES[settings.kv_dtype]
        if self.compute == "kernels":  # quantised weights straight from the mapped file, repacked on the device
            if kv_dtype not in (torch.float32, torch.float16):
                raise ValueError(f"{stage_label(rank, stage)}: the kernel stage keeps KV in float32 or float16, "
                                 f"not {settings.kv_dtype}")
            if stage.streaming:
                self.experts = ExpertCache(self.cfg, tensors, stage.layers, stage.expert_cache_bytes, device,
                                           prefetch=settings.prefetch, where=f"{stage_label(rank, stage)}: ")
            self.model = GpuStage(self.cfg, tensors, stage.layers, embed=stage.embed, output=stage.output,
                                  device=device, round_trips=round_trips, experts=self.experts,
                                  mtp=mtp_file is not None)
        else:
            self.model = DS4Model(self.cfg, {name: tensors[name].dequantize().to(device) for name in tensors},
                                  stage.layers, embed=stage.embed, output=stage.output, round_trips=round_trips,
                                  mtp=mtp_file is not None)
        gguf.release()  # the weights are in the stage's own buffers now: the file's pages stop counting here
        if mtp_file is not None:
            mtp_file.release()
        # The forms this stage's steps take: the first stage embeds; the head runs inside the step when this
        # stage holds it and is the last one (else rank 0 applies it to what comes back, see `head`). With the
        # MTP layer the backend's steps return the HC states, `step` records them for it and applies the head.
        self.embeds = stage.embed
        self.mtp = MtpDrafts(self.model, self.cfg, settings.ctx, settings.chunk, device, settings.sessions) \
            if mtp_file else None
        self.logits = self.head_here and self.mtp is None  # the head inside the backend's step
        # the sessions' KV in one pool: any of them decode together in one batched step
        self.slots = self.model.new_caches(settings.sessions, settings.ctx, chunk=settings.chunk,
                                           rollback=settings.rollback, dtype=kv_dtype)
        self.kv: dict[int, KVCache] = {}  # session id -> its slot
        self.held = self.held_weight_bytes()
        self.mtp_held = self.held_weight_bytes(mtp=True) - self.held if self.mtp is not None else 0
        self.warm_s = 0.0
        if settings.warm:
            self.warm()

    # ---- readiness ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def warm(self) -> None:
        """Make the first request as fast as the tenth: on the kernel stage of a GPU, run a prefill of every
        length class the kernels specialise on (warm_lengths) and short prefills at the positions where the
        context-dependent tiles change (warm_positions), so that Triton has compiled them all; then capture
        the step graphs of the slots' pool (decode, and short prefills of each row class, one graph for every
        session) for the first position buckets, and run a batched decode step of every size up to the slots
        (its kernels specialise on the rows). The scratch slots are reset after each step. Nothing to do for
        the reference."""
        if self.compute != "kernels" or self.device.type != "cuda":
            return
        t0 = time.monotonic()
        cfg, cache, ctx = self.cfg, self.slots[0], self.settings.ctx
        gen = torch.Generator().manual_seed(self.rank)
        steps = [(0, n) for n in warm_lengths(min(self.settings.chunk, ctx))]
        steps += [(p, n) for p in warm_positions(ctx) for n in (17, 64) if p + n <= ctx]
        if self.experts is not None:  # the steps compile kernels only: no expert is read for them
            self.experts.dry = True
        for position, n in steps:
            tokens = torch.randint(2, cfg.vocab_size, (n,), generator=gen)
            X = None if self.embeds else torch.randn(n, cfg.hc_mult, cfg.dim, generator=gen) * 0.1
            cache.length = position  # an empty slot: what lies before `position` is never read back
            self.model.prefill(tokens, cache, X, logits=self.logits, graph=False)  # the chunked path's kernels
            cache.reset()
        assert isinstance(self.model, GpuStage)
        if not self.model.graphs:  # graphs off (DS4STATION_CUDA_GRAPHS=0): the eager decode step's kernels
            for position in [0, *(p for p in warm_positions(ctx) if p >= MIN_BUCKET)]:
                cache.length = position
                X = None if self.embeds else torch.randn(1, cfg.hc_mult, cfg.dim, generator=gen) * 0.1
                self.model.decode(2, cache, X, logits=self.logits)
                cache.reset()
        for b in range(2, len(self.slots) + 1):  # batched decode steps of every size: their kernels compiled
            X = None if self.embeds else torch.randn(b, cfg.hc_mult, cfg.dim, generator=gen) * 0.1
            self.model.decode_batch([2] * b, self.slots[:b], X, logits=self.logits, graph=False)
            for slot in self.slots[:b]:
                slot.reset()
        if self.experts is not None:
            self.experts.dry = False
        if self.mtp is not None:  # the MTP layer's kernels: an eager catch-up of most of a window, a chain
            mcache = self.model.new_mtp_caches(1, ctx, self.mtp.chunk)[0]
            H = torch.randn(cfg.window, cfg.hc_mult, cfg.dim, generator=gen) * 0.1
            tokens = torch.randint(2, cfg.vocab_size, (cfg.window,), generator=gen)
            self.model.mtp_draft([H], [tokens], [mcache], 2, graph=False)
        # A static step's graph serves every session of the pool: captured once, on the first slot (a streaming
        # stage's segmented decode graphs are each session's own)
        owners = self.slots if self.experts is not None else self.slots[:1]
        graphs = sum(self.model.capture(slot, embedded=self.embeds, logits=self.logits, positions=WARM_POSITIONS)
                     for slot in owners)
        graphs += self.model.capture_batches(self.slots, embedded=self.embeds, logits=self.logits,
                                             positions=BATCH_WARM_POSITIONS)
        verify = self.model.short_rows(self.settings.verify_rows, self.slots[0])
        if verify and self.logits:  # the head over every row (other stages' steps are the short prefill's)
            graphs += self.model.capture(self.slots[0], embedded=self.embeds, logits=ALL_ROWS,
                                         positions=WARM_POSITIONS, rows=(verify,))
        if self.mtp is not None and self.settings.verify_rows > 1:  # the MTP layer's drafts for one request
            graphs += self.model.capture_mtp(self.mtp.allocated[0].cache, self.settings.verify_rows - 1)
        torch.cuda.synchronize(self.device)
        self.warm_s = time.monotonic() - t0
        print(f"ds4station: {stage_label(self.rank, self.stage)} warm in {self.warm_s:.1f} s ({len(steps)} prefill "
              f"steps compiled, {graphs} step graphs captured)", file=sys.stderr, flush=True)

    # ---- sessions ----------------------------------------------------------------------------------
    def new_session(self, sid: int) -> None:
        used = {id(c) for c in self.kv.values()}
        free = [c for c in self.slots if id(c) not in used]
        if not free:
            raise RuntimeError(f"{stage_label(self.rank, self.stage)}: all {len(self.slots)} KV slot(s) are in "
                               "use; close a session first (or load with more sessions)")
        free[0].reset()
        self.kv[sid] = free[0]
        if self.mtp is not None:
            self.mtp.new_session(sid)

    def free(self, sid: int) -> None:
        self.kv.pop(sid, None)
        if self.mtp is not None:
            self.mtp.free(sid)

    def truncate(self, sid: int, n: int) -> bool:
        ok = self.kv[sid].truncate(n)
        if ok and self.mtp is not None:
            self.mtp.truncate(sid, n)
        return ok

    def checkpoint(self, sid: int) -> None:
        self.kv[sid].checkpoint()

    def rewind(self, sid: int, n: int) -> int:
        kept = self.kv[sid].rewind(n)
        if kept >= 0 and self.mtp is not None:
            self.mtp.truncate(sid, kept)
        return kept

    def draft(self, sids: Sequence[int], tokens: Sequence[int], ks: Sequence[int]) -> list[list[int]]:
        """Per session sids[i]: up to ks[i] drafted tokens after tokens[i] (about to be fed to it) from the MTP
        layer, the sessions together (MtpDrafts.draft)."""
        if self.mtp is None:
            raise RuntimeError(f"{stage_label(self.rank, self.stage)} holds no MTP layer")
        return self.mtp.draft(sids, [self.kv[sid].length for sid in sids], tokens, ks)

    @torch.inference_mode()
    def save_state(self, sid: int, entry: str) -> bool:
        """Write this stage's part of session `sid` (its layers' `KVCache.state()`) to the entry directory;
        False, with a log line, when it could not."""
        cache = self.kv[sid]
        try:
            write_state_file(stage_file(entry, self.rank), self._state_info(entry, cache.length), cache.state())
            return True
        except (OSError, ValueError) as e:
            print(f"ds4station: {stage_label(self.rank, self.stage)}: KV state not saved to {entry}: {e}",
                  file=sys.stderr, flush=True)
            return False

    @torch.inference_mode()
    def load_state(self, sid: int, entry: str, n: int) -> bool:
        """Load this stage's part of an entry of n positions into session `sid` (a fresh slot); False, with a
        log line, when the file is missing, corrupt or was saved for other layers (the slot is left empty)."""
        cache = self.kv[sid]
        try:
            tensors = read_state_file(stage_file(entry, self.rank), self._state_info(entry, n), self.device)
            cache.load_state(n, tensors)
            return True
        except (StateFileError, ValueError) as e:
            cache.reset()
            print(f"ds4station: {stage_label(self.rank, self.stage)}: KV state ignored: {e}", file=sys.stderr,
                  flush=True)
            return False

    def drop_state(self, entry: str) -> None:
        """Remove this stage's file of an entry (and the entry's directory once it is empty)."""
        path = stage_file(entry, self.rank)
        for p in (path, path.with_name(f"{path.name}.tmp{os.getpid()}")):
            p.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            path.parent.rmdir()

    def _state_info(self, entry: str, n: int) -> dict[str, Any]:
        """What a stage file records and a load checks: whose entry, how long, which layers, in what form."""
        s = self.stage
        return {"key": os.path.basename(os.path.normpath(entry)), "positions": n,
                "layers": [s.first_layer, s.last_layer + 1], "kv_dtype": dtype_name(self.slots[0].dtype),
                "compute": self.compute, "device_kind": self.device.type}

    # ---- compute -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, sid: int, tokens: torch.Tensor, X: torch.Tensor | None, all_logits: bool = False) -> torch.Tensor:
        """Tokens [T] (and, on a stage that does not embed, their HC state X) through this stage -> the HC
        state for the next stage, or on the last stage holding the head the last position's logits (with
        `all_logits`, every position's [T, vocab]). One token decodes (static shapes, a graph replay on a
        GPU); more prefill."""
        cache = self.kv[sid]
        p0 = cache.length
        if tokens.numel() == 1 and not all_logits:  # the token id as the caller holds it: no device round trip
            out = self.model.decode(int(tokens[0]), cache, X, logits=self.logits).clone()  # the graph's buffer
        else:
            out = self.model.prefill(tokens, cache, X, logits=self.logits, all_logits=all_logits)
        if self.mtp is None or not self.head_here:
            return out
        self.mtp.record(sid, p0, tokens, out)
        return self.model.head(out) if all_logits else self.model.head(out[-1:])[0]

    @torch.inference_mode()
    def step_batch(self, sids: list[int], tokens: torch.Tensor, X: torch.Tensor | None) -> torch.Tensor:
        """One decode step of several sessions (token b of session sids[b]) -> their states [B, C, dim], or
        on the last stage holding the head their logits [B, vocab]. The kernel stage batches them (weights
        read once for all); the reference decodes them one after another."""
        caches = [self.kv[sid] for sid in sids]
        p0 = [c.length for c in caches]
        if isinstance(self.model, GpuStage):
            # ids on the stage's device go in as they are (a step queued before the host reads them)
            ids = tokens if tokens.device.type == self.model.device.type else tokens.tolist()
            out = self.model.decode_batch(ids, caches, X, logits=self.logits).clone()  # the graph's buffer
        else:
            outs = [self.model.decode(t, c, None if X is None else X[b:b + 1], logits=self.logits)
                    for b, (t, c) in enumerate(zip(tokens.tolist(), caches, strict=True))]
            out = torch.stack(outs) if self.logits else torch.cat(outs)
        if self.mtp is None or not self.head_here:
            return out
        self.record_batch(sids, p0, tokens, out)
        return self.model.head(out)

    @torch.inference_mode()
    def verify_batch(self, sids: list[int], tokens: list[list[int]]) -> list[torch.Tensor]:
        """Several sessions' tokens (a request's token and its drafts each) -> each one's logits [n_i, vocab]
        (row j what `step` of tokens[i][:j + 1] with every position's logits gives), on the stage holding the
        head: the kernel stage runs them as one step (GpuStage.verify_batch) when they fit one, else each
        session's rows run as its own step."""
        caches = [self.kv[sid] for sid in sids]
        p0 = [c.length for c in caches]
        if isinstance(self.model, GpuStage) and self.model.multi_rows(tokens, caches):
            outs = self.model.verify_batch(tokens, caches, logits=self.logits)
        else:
            outs = [self.model.prefill(torch.as_tensor(t), c, None, logits=self.logits, all_logits=True)
                    for t, c in zip(tokens, caches, strict=True)]
        if self.mtp is None:
            return outs
        for sid, start, t, X in zip(sids, p0, tokens, outs, strict=True):
            self.mtp.record(sid, start, torch.as_tensor(t), X)
        return [self.model.head(X) for X in outs]

    def record_batch(self, sids: list[int], p0: list[int], tokens: torch.Tensor, X: torch.Tensor) -> None:
        """A batched step's last states X [B, C, dim] for the MTP layer (session sids[b] at position p0[b])."""
        assert self.mtp is not None
        for b, sid in enumerate(sids):
            self.mtp.record(sid, p0[b], tokens[b:b + 1], X[b:b + 1])

    @torch.inference_mode()
    def head(self, X: torch.Tensor) -> torch.Tensor:
        """Rank 0's head over the HC state the last stage sent back -> logits [T, vocab]."""
        return self.model.head(X.to(self.device, torch.float32))

    # ---- reporting ---------------------------------------------------------------------------------
    def held_weight_bytes(self, mtp: bool = False) -> int:
        """Bytes of the tensors the stage's model holds (its weights in their kept forms, tables), KV slots
        and the expert cache's pool excluded: what the plan's `weights` counts (the MTP layer's only with `mtp`:
        the footprint counts those apart)."""
        return held_bytes(self.model, skip=(KVCache, KVPool, ExpertCache) + (() if mtp else (GpuMTP, MTPLayer)))

    def kv_bytes(self) -> int:
        """Bytes of every KV slot this stage allocated (what the plan must count)."""
        return sum(c.nbytes() for c in self.slots)

    def stats(self) -> dict[str, Any]:
        sessions = dict(self.kv)  # a snapshot: /status may ask from another thread
        s = self.stage
        return {
            "rank": self.rank, "device": s.device, "torch_device": str(self.device), "pid": os.getpid(),
            "layers": [s.first_layer, s.last_layer + 1], "range": f"{s.first_layer}-{s.last_layer}",
            "embed": s.embed, "output": s.output, "compute": self.compute,
            "sessions": {str(k): {"tokens": c.length, "kv_bytes": c.nbytes()} for k, c in sessions.items()},
            "kv_bytes": sum(c.nbytes() for c in sessions.values()), "kv_allocated_bytes": self.kv_bytes(),
            "kv_slots": len(self.slots), "warm_s": round(self.warm_s, 3), "weights_held_bytes": self.held,
            "expert_cache": None if self.experts is None else self.experts.report(),
            # the MTP layer (--draft mtp): its weights as held and every session's state
            "mtp_bytes": 0 if self.mtp is None else self.mtp_held + self.mtp.nbytes(),
        }

    def close(self) -> None:
        if isinstance(self.model, GpuStage):
            for cache in self.slots:
                self.model.drop_graphs(cache)
        self.kv.clear()
        self.slots.clear()


def held_bytes(root: Any, skip: tuple[type, ...] = ()) -> int:
    """Bytes of the distinct tensors reachable from `root` through attributes, dataclass fields, lists, tuples
    and dicts (objects of the `skip` types not entered; a tensor and its views count once, by storage)."""
    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            stack.extend(vars(obj).values())
    return sum(storages.values())


# ---- transport ---------------------------------------------------------------------------------------
def make_process_group(backend: str, store: Any, rank: int, world: int, device: torch.device) -> Any:
    """A process group of our own (not torch.distributed's global default), so several pipelines can live
    in one process (tests) and nothing global is left behind."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore("pg", store)
    if backend == "nccl":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = PG_TIMEOUT
        return dist.ProcessGroupNCCL(prefixed, rank, world, opts)
    return dist.ProcessGroupGloo(prefixed, rank, world, PG_TIMEOUT)


def shutdown_process_group(pg: Any, timeout: float = 5.0) -> None:
    """End an orderly run of a process group made by make_process_group: its pending work is done, then its
    communicators are released here rather than by the destructor at exit (NCCL warns of a group never
    shut down). Best effort and bounded: a shutdown still blocked after `timeout` seconds is left behind in
    a daemon thread, and the process goes on leaving."""
    def run() -> None:
        try:
            pg.shutdown()
        except Exception:
            pass

    worker = threading.Thread(target=run, daemon=True, name="pg-shutdown")
    worker.start()
    worker.join(timeout)


class Link:
    """Point-to-point sends/receives over one process group; gloo moves CPU tensors, NCCL device tensors."""

    def __init__(self, pg: Any, backend: str, device: torch.device) -> None:
        self.pg, self.backend = pg, backend
        self.wire = device if backend == "nccl" else torch.device("cpu")

    def isend(self, t: torch.Tensor, dst: int) -> tuple[Any, torch.Tensor]:
        """-> (work, the tensor being sent: keep it alive until the work completes)."""
        t = t.to(self.wire).contiguous()
        return self.pg.send([t], dst, 0), t

    def irecv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> tuple[Any, torch.Tensor]:
        t = torch.empty(shape, dtype=dtype, device=self.wire)
        return self.pg.recv([t], src, 0), t

    def send(self, t: torch.Tensor, dst: int) -> None:
        work, _ = self.isend(t, dst)
        _complete(work, dst)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        work, t = self.irecv(shape, dtype, src)
        _complete(work, src)
        return t


class PeerLost(ConnectionError):
    """The connection to a neighbouring stage broke (it exited or its host went away)."""


def _complete(work: Any, peer: int) -> None:
    try:
        work.wait()
    except RuntimeError as e:  # gloo: "Connection closed by peer ..."
        raise PeerLost(f"lost the connection to rank {peer} ({str(e).splitlines()[0][:160]})") from e


# ---- the worker process ------------------------------------------------------------------------------
def connect_store(address: str, timeout_s: float) -> Any:
    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--coordinator {address!r}: expected HOST:PORT")
    host = host.strip("[]")
    # Wait for the port with a plain socket first: c10d logs a C++ stack trace for every failed attempt.
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=max(0.1, min(2.0, deadline - time.monotonic()))).close()
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConnectionError(f"nothing answers at {host}:{port} ({e}); is the coordinator running?") from e
            time.sleep(0.2)
    return dist.TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=timeout_s))


def _watchdog(address: str, rank: int, parent_pid: int | None, timeout_s: float) -> None:
    """Heartbeats for the coordinator; exits the process when the coordinator is gone."""
    try:
        store = connect_store(address, timeout_s)
    except Exception:
        os._exit(EXIT_ORPHANED)
    key = f"hb/{rank}"
    while True:
        if parent_pid is not None and os.getppid() != parent_pid:
            os._exit(EXIT_ORPHANED)
        try:
            store.add(key, 1)
        except Exception:  # the store lives in the coordinator: it is gone
            os._exit(EXIT_ORPHANED)
        time.sleep(0.5)


def _publish(store: Any, key: str, value: str) -> None:
    try:
        store.set(key, value)
    except Exception:  # the coordinator is gone; the watchdog ends the process
        pass


def run_worker(coordinator: str, rank: int, *, model: str | None = None, device: str | None = None,
               expert_cache: int | None = None, threads: int | None = None, parent_pid: int | None = None,
               connect_timeout: float = 60.0) -> int:
    """Join the coordinator's store as `rank`, load the stage, serve it until told to stop. -> exit code."""
    def say(msg: str) -> None:
        print(f"ds4station worker {rank}: {msg}", file=sys.stderr, flush=True)

    try:
        store = connect_store(coordinator, connect_timeout)
        settings = StageSettings.from_json(store.get("config"))
    except Exception as e:
        say(f"cannot reach the coordinator at {coordinator}: {type(e).__name__}: {e}")
        return EXIT_ERROR
    try:
        if threads:
            torch.set_num_threads(threads)
        gguf = GGUFFile.open(model or settings.model)
        route = parse_route(settings.route, gguf.config.n_layers)
        if not 0 < rank < len(route):
            raise RouteError(f"rank {rank} is not a worker stage of the route ({len(route)} stages: ranks 1-"
                             f"{len(route) - 1})")
        stage = route.stages[rank]
        if expert_cache is not None:
            stage = Stage(stage.device, stage.first_layer, stage.last_layer, stage.embed, stage.output, expert_cache)
        dev = torch.device(device) if device else resolve_device(stage.device)
        runner = StageRunner(gguf, stage, settings, dev, rank=rank)
    except (ExpertCacheTooSmall, RouteError) as e:
        say(str(e))
        _publish(store, f"error/{rank}", str(e))
        return EXIT_CONFIG
    except Exception as e:
        msg = f"loading {stage_label(rank, stage) if 'stage' in locals() else 'the stage'} failed: " \
              f"{type(e).__name__}: {e}"
        say(msg)
        _publish(store, f"error/{rank}", msg)
        return EXIT_ERROR

    threading.Thread(target=_watchdog, args=(coordinator, rank, parent_pid, connect_timeout), daemon=True,
                     name="heartbeat").start()
    store.set(f"stats/{rank}", json.dumps(runner.stats()))
    store.set(f"ready/{rank}", str(os.getpid()))
    say(f"{stage_label(rank, stage)} loaded on {dev}, joining the pipeline")
    try:
        pg = make_process_group(settings.backend, store, rank, len(route), dev)
        code = _serve(runner, Link(pg, settings.backend, dev), store, rank, len(route), route)
        shutdown_process_group(pg)  # only after an orderly stop: a broken group is left to the exit
        return code
    except PeerLost as e:  # a neighbour went first; its own exit is the news, not this worker's traceback
        say(f"stopping: {e}")
        _publish(store, f"error/{rank}", str(e))
        return EXIT_ERROR
    except Exception as e:
        msg = f"{stage_label(rank, stage)} failed: {type(e).__name__}: {e}"
        say(msg)
        traceback.print_exc()
        _publish(store, f"error/{rank}", msg)
        return EXIT_ERROR
    finally:
        runner.close()


def _serve(runner: StageRunner, link: Link, store: Any, rank: int, world: int, route: Route) -> int:
    """The worker loop: receive from rank-1, apply, forward to rank+1 (or answer rank 0 from the last stage)."""
    cfg = runner.cfg
    last = rank == world - 1
    nxt = rank + 1
    published = 0.0

    def publish() -> None:
        nonlocal published
        _publish(store, f"stats/{rank}", json.dumps(runner.stats()))
        published = time.monotonic()

    while True:
        hdr = link.recv((HEADER_LEN,), torch.int64, rank - 1)
        op, sid, n, bits, flags, arg, nbytes = (int(v) for v in hdr[:7].tolist())
        payload = link.recv((nbytes,), torch.uint8, rank - 1) if nbytes else None
        if op == OP_EXTEND:
            assert payload is not None
            tokens, X = unpack(payload, n, bits, cfg.hc_mult, cfg.dim)
            every = bool(flags & FLAG_ALL)
            out = runner.step(sid, tokens, X, all_logits=every)
            if not last:
                link.send(hdr, nxt)
                link.send(pack(tokens, out, bits), nxt)
            elif runner.head_here:  # the head is here: only the logits travel back
                if flags & FLAG_RESULT:
                    link.send(out.float(), 0)
            elif flags & FLAG_TAIL:  # the head and the MTP layer are on rank 0: the states it records
                k = tail_rows(tokens.numel(), every, cfg)
                link.send(pack(tokens[-k:], out[-k:], bits), 0)
            elif flags & FLAG_RESULT:
                if every:  # the head is on rank 0: every position's state
                    link.send(pack(tokens, out, bits), 0)
                else:  # the last position's state
                    link.send(pack(tokens[-1:], out[-1:], bits), 0)
            if time.monotonic() - published > 1.0:
                publish()
            continue
        if op == OP_BATCH:  # n sessions, one token each: their ids, then tokens and states as OP_EXTEND's
            assert payload is not None
            sids = payload[: 8 * n].view(torch.int64)
            tokens, X = unpack(payload[8 * n:], n, bits, cfg.hc_mult, cfg.dim)
            out = runner.step_batch([int(v) for v in sids.tolist()], tokens, X)
            if not last:
                body = torch.cat((sids.view(torch.uint8), pack(tokens, out, bits).to(sids.device)))
                link.send(header(op, 0, n, bits, flags, payload=body.numel()), nxt)
                link.send(body, nxt)
            elif runner.head_here:
                link.send(out.float(), 0)
            else:
                link.send(pack(tokens, out, bits), 0)
            if time.monotonic() - published > 1.0:
                publish()
            continue
        if op in (OP_SAVE, OP_LOAD, OP_DROP):  # arg: the positions to load; the payload: the entry directory
            assert payload is not None
            entry = payload.cpu().numpy().tobytes().decode()
            if op == OP_DROP:
                runner.drop_state(entry)
                if not last:
                    link.send(hdr, nxt)
                    link.send(payload, nxt)
                continue
            ok = runner.save_state(sid, entry) if op == OP_SAVE else runner.load_state(sid, entry, arg)
            hdr = header(op, sid, n, bits, flags | (0 if ok else FLAG_FAILED), arg, payload=nbytes)
            if last:
                link.send(hdr, 0)
            else:
                link.send(hdr, nxt)
                link.send(payload, nxt)
            continue
        if op == OP_DRAFT:  # n: the drafts wanted, arg: the token about to be fed; the MTP stage answers rank 0
            if last:
                drafts = runner.draft([sid], [arg], [n])[0]
                link.send(torch.tensor(drafts + [-1] * (n - len(drafts)), dtype=torch.int64), 0)
            else:
                link.send(hdr, nxt)
            continue
        if op == OP_NEW:
            runner.new_session(sid)
        elif op == OP_FREE:
            runner.free(sid)
        elif op == OP_TRUNCATE:
            if not runner.truncate(sid, arg):
                raise RuntimeError(f"session {sid}: cannot roll back to {arg} tokens (the coordinator could)")
        elif op == OP_CHECKPOINT:
            runner.checkpoint(sid)
        elif op == OP_REWIND:  # arg: where the coordinator's cache went back to (every stage's is the same)
            if runner.rewind(sid, arg) != arg:
                raise RuntimeError(f"session {sid}: cannot rewind to {arg} tokens (the coordinator could)")
        if op in (OP_NEW, OP_FREE, OP_TRUNCATE, OP_STATUS, OP_CHECKPOINT, OP_REWIND):
            publish()
        if not last:
            link.send(hdr, nxt)
        elif op == OP_STATUS:
            link.send(hdr, 0)  # the acknowledgement: every stage has published its stats
        if op == OP_SHUTDOWN:
            return EXIT_OK


__all__ = ["ACTIVATION_BITS", "EMBED", "KV_DTYPES", "MTP_IN_MODEL",
           "Link", "PeerLost", "StageRunner", "StageSettings", "make_process_group",
           "shutdown_process_group",
           "pack", "payload_bytes", "pin_env", "resolve_device", "run_worker", "stage_label", "unpack"]
