"""Routed experts streamed from the memory-mapped GGUF through a bounded pool of slots on the stage's device.

The kernel stage (gpu.py) of a route stage with `cache=` keeps every other weight resident and quantised; its
routed experts stay as raw blocks in the read-only memory map, and an `ExpertCache` owns a fixed pool of expert
*slots* on the device, in the form the MoE kernels read (the packed gate / up / down of one expert per slot:
the q2 file, 6.75 MiB per expert). The pool is allocated once at start, so the cache never grows:

- after a routed layer's router, `ensure(layer, ids)` looks every selected expert up (hit) or copies it in
  (miss) and *pins* the layer's selection until the next layer asks (so a slot the running layer needs is
  never evicted); `lookup(layer, ids)` turns the selection into slot numbers on the device (a slot table
  per layer), which the fused MoE decode and grouped prefill kernels read the pool through. The lookup
  needs no synchronisation, so a streaming stage's decode runs as captured graphs, one per segment between
  two routers, with the host's `ensure` between replays (engine/gpu.py _SegmentedStep);
- a layer's misses are one batch: each expert's raw blocks are copied from the memory map into a pinned
  staging buffer (host memory the GPU can read by DMA), sent to the device on a side stream and repacked into
  their slots there, two staging buffers in turn so the host fills one while the device drains the other;
- eviction is least-recently-selected first, among unpinned slots;
- hash-routed layers choose experts by token id alone (`ffn_gate_tid2eid`), so a step's tokens give their
  choices ahead: `prefetch(tokens)` loads them at the start of the step, before their layers ask;
- a cache smaller than one layer's full expert table is refused (`ExpertCacheTooSmall`): a long prefill
  chunk can select all n_experts experts of a layer, and all of them must be pinned at once.

Raw blocks repacked slice by slice give exactly the rows of the whole tensor's repack, so streamed == resident
bit for bit. Statistics: every lookup is a hit or a miss (a prefetch read counts as a lookup and a miss when it
happens, and the later demand lookup is a hit), so hits + misses == lookups and bytes_read == misses x slot
bytes always hold; `prefetched` says how many misses were prefetches; `stream_s` is the wall time spent
reading misses (so bytes_read / stream_s is the rate streamed).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ds4station.kernels import ops
from ds4station.kernels.quants import QTensor
from ds4station.model.config import ModelConfig
from ds4station.model.footprint import STAGING_EXPERTS  # per staging buffer (two): one layer's decode misses
from ds4station.model.sizes import GiB, format_size, gib

PARTS = ("gate", "up", "down")
ROLE_OF_PART = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}


class ExpertCacheTooSmall(ValueError):
    """The expert cache cannot hold one layer's full expert table; the message states the minimum."""


def expert_name(layer: int, part: str) -> str:
    return f"blk.{layer}.{ROLE_OF_PART[part]}.weight"


def is_routed_expert(name: str) -> bool:
    return name.startswith("blk.") and name.split(".")[2] in ROLE_OF_PART.values()


def expert_bytes(tensors: Mapping[str, QTensor], layer: int) -> int:
    """Raw bytes of one routed expert of `layer` (gate + up + down) as stored in the file."""
    total = 0
    for part in PARTS:
        q = tensors[expert_name(layer, part)]
        total += q.nbytes // q.shape[0]
    return total


def min_cache_bytes(tensors: Mapping[str, QTensor], layers: range) -> int:
    """The smallest cache `ExpertCache` accepts for these layers: one layer's full expert table."""
    return max((tensors[expert_name(i, "gate")].shape[0] * expert_bytes(tensors, i) for i in layers), default=0)


def too_small_message(capacity: int, n_experts: int, per_expert: int, where: str = "") -> str:
    need = n_experts * per_expert
    exact = f"{gib(need)}, {need} bytes" if need >= GiB else f"{need} bytes"
    return (f"{where}expert cache {format_size(capacity)} is smaller than one layer's full expert table: "
            f"{n_experts} experts x {format_size(per_expert)} = {format_size(need)} ({exact}) is the minimum; "
            f"give --expert-cache {format_size(need)} or more, or leave it out to keep the experts resident")


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    prefetched: int = 0  # misses read ahead of demand (hash-routed layers)
    evictions: int = 0
    stream_s: float = 0.0  # wall time spent reading misses

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fields(p: Any) -> list[torch.Tensor]:
    return [getattr(p, f.name) for f in dataclasses.fields(p)]


class ExpertCache:
    """A fixed pool of expert slots for the routed experts of `layers`, filled from `tensors` (raw views of the
    memory map) on demand, in the packed form of ops.repack."""

    def __init__(self, cfg: ModelConfig, tensors: Mapping[str, QTensor], layers: range, capacity_bytes: int,
                 device: torch.device | str = "cpu", *, prefetch: bool = True, where: str = "") -> None:
        self.layers, self.device = layers, torch.device(device)
        self.capacity_bytes = int(capacity_bytes)
        self.src: dict[tuple[int, str], QTensor] = {(i, p): tensors[expert_name(i, p)] for i in layers for p in PARTS}
        form = {p: {(q.qtype, q.shape[1:]) for (_, part), q in self.src.items() if part == p} for p in PARTS}
        if any(len(f) > 1 for f in form.values()):
            raise ValueError(f"{where}streamed experts need one quant type and shape per part across the stage's "
                             f"layers; got {form}")
        self.part_bytes = {p: q.nbytes // q.shape[0] for (i, p), q in self.src.items() if i == layers[0]}
        self.slot_bytes = sum(self.part_bytes.values())
        self.n_experts = cfg.n_experts
        self.min_bytes = self.n_experts * self.slot_bytes
        if self.capacity_bytes < self.min_bytes:
            raise ExpertCacheTooSmall(too_small_message(self.capacity_bytes, self.n_experts, self.slot_bytes, where))
        self.n_slots = self.capacity_bytes // self.slot_bytes if self.slot_bytes else 0
        # The whole pool up front (its memory is fixed from the start: no fragmentation on a GPU), field by
        # field in the kernels' form: one expert repacked gives each field's shape.
        self.pool: dict[str, Any] = {}
        for p in PARTS:
            q = self.src[(layers[0], p)]
            one = ops.repack(q.data[: self.part_bytes[p]].view(1, q.shape[1], -1), q.qtype.name, q.shape[-1])
            self.pool[p] = type(one)(*(torch.zeros((self.n_slots, *t.shape[1:]), dtype=t.dtype, device=self.device)
                                       for t in _fields(one)))
        # the slot table: layer index in the stage -> expert -> slot (valid only for resident experts)
        self.table = torch.zeros(len(layers), self.n_experts, dtype=torch.long, device=self.device)
        self.free = list(range(self.n_slots - 1, -1, -1))
        self.slot_of: OrderedDict[tuple[int, int], int] = OrderedDict()  # LRU order: oldest first
        self.pinned: set[tuple[int, int]] = set()
        self.stats = CacheStats()
        self._lock = threading.Lock()  # the stats: updated by the compute thread, read by /status
        self.tid2eid = {i: tensors[f"blk.{i}.ffn_gate_tid2eid.weight"].dequantize().long()
                        for i in layers if cfg.is_hash_layer(i)}
        self.prefetch_enabled = prefetch
        # dry: selections map onto whatever the slots hold, nothing is read or counted (the warm-up's steps,
        # which compile kernels and whose results are thrown away)
        self.dry = False
        self.staging: list[torch.Tensor] = []
        if self.device.type == "cuda":
            n = STAGING_EXPERTS * self.slot_bytes
            self.staging = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self.dev_staging = [torch.empty(n, dtype=torch.uint8, device=self.device) for _ in range(2)]
            self.copied = [torch.cuda.Event() for _ in range(2)]
            self.stream = torch.cuda.Stream(self.device)

    @property
    def nbytes(self) -> int:
        """Device bytes of the pool, the slot table and the device staging: what the plan counts for the cache
        (model/footprint.py expert_cache_device_bytes)."""
        pool = sum(t.numel() * t.element_size() for p in self.pool.values() for t in _fields(p))
        return pool + self.table.numel() * 8 + sum(t.numel() for t in getattr(self, "dev_staging", []))

    # ---- the kernel stage's side ---------------------------------------------------------------------
    def parts(self) -> tuple[Any, Any, Any]:
        """The pool's packed gate, up and down [n_slots, ...]: what the MoE kernels read through `slots`."""
        return self.pool["gate"], self.pool["up"], self.pool["down"]

    def slots(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """`ensure` then `lookup`: the selected experts ids [T, S] of `layer` as slots of the pool."""
        self.ensure(layer, ids)
        return self.lookup(layer, ids)

    def ensure(self, layer: int, ids: torch.Tensor) -> None:
        """Make the selected experts ids (any shape, on the device) of `layer` resident: each one found (a
        hit) or loaded (a miss); the layer's selection pinned until the next call. The one host
        synchronisation of a streamed layer."""
        if self.dry:
            return
        keys = [(layer, e) for e in sorted(set(ids.flatten().tolist()))]
        self.pinned = set(keys)
        misses = []
        for key in keys:
            if key in self.slot_of:
                self.slot_of.move_to_end(key)
            else:
                misses.append(key)
        self._read(misses, lookups=len(keys))

    def lookup(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """ids [T, S] of resident experts of `layer` -> their slots [T, S], through the slot table on the
        device (no synchronisation: what a captured graph does). Dry: any valid slot."""
        if self.dry:
            return ids.long() % self.n_slots
        return self.table[layer - self.layers.start][ids]

    def prefetch(self, tokens: torch.Tensor | list[int]) -> None:
        """Load the experts the hash-routed layers will choose for `tokens` (their choice is a table lookup of
        the token ids), ahead of those layers. Never evicts a pinned expert."""
        if self.dry or not (self.prefetch_enabled and self.tid2eid):
            return
        tokens = torch.as_tensor(tokens).view(-1).cpu()
        keys = []
        for layer, table in self.tid2eid.items():
            chosen = sorted(set(table[tokens].flatten().tolist()))
            keys += [(layer, e) for e in chosen if (layer, e) not in self.slot_of]
        keys = keys[: max(0, self.n_slots - len(self.pinned))]
        self._read(keys, lookups=len(keys), prefetch=True)

    # ---- internals ---------------------------------------------------------------------------------
    def _take_slot(self) -> tuple[int, bool]:
        """-> (a free slot, or the least recently selected unpinned one; whether that evicted an expert)."""
        if self.free:
            return self.free.pop(), False
        for key in self.slot_of:  # oldest first
            if key not in self.pinned:
                return self.slot_of.pop(key), True
        # cannot happen when the pool holds a full layer (checked at start)
        raise RuntimeError(f"expert cache: all {self.n_slots} slots are pinned by the running layer")

    def _read(self, keys: list[tuple[int, int]], *, lookups: int, prefetch: bool = False) -> None:
        """Copy these experts' raw blocks from the memory map into slots, repacked; update the slot table; then
        count the lookups (all at once, so a report read from another thread always adds up)."""
        t0 = time.perf_counter()
        evicted = 0
        if keys:
            slots = []
            for key in keys:
                slot, ev = self._take_slot()
                evicted += ev
                slots.append(slot)
                self.slot_of[key] = slot
            if self.device.type == "cuda":
                self._read_staged(keys, slots)
            else:
                raw = torch.empty(len(keys), self.slot_bytes, dtype=torch.uint8)
                self._gather(keys, raw)
                self._scatter(keys, slots, raw)
        with self._lock:
            s = self.stats
            s.lookups += lookups
            s.misses += len(keys)
            s.hits += lookups - len(keys)
            s.prefetched += len(keys) if prefetch else 0
            s.evictions += evicted
            s.bytes_read += len(keys) * self.slot_bytes
            s.stream_s += time.perf_counter() - t0 if keys else 0.0

    def _gather(self, keys: list[tuple[int, int]], out: torch.Tensor) -> None:
        """Host copy of each expert's gate | up | down raw blocks into the rows of `out` [n, slot_bytes]."""
        for j, (layer, e) in enumerate(keys):
            off = 0
            for p in PARTS:
                n = self.part_bytes[p]
                out[j, off: off + n].copy_(self.src[(layer, p)].data[e * n: (e + 1) * n])
                off += n

    def _scatter(self, keys: list[tuple[int, int]], slots: list[int], raw: torch.Tensor) -> None:
        """Repack raw [n, slot_bytes] (on the pool's device) into the pool's slots; point the table at them."""
        idx = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
        off = 0
        for p in PARTS:
            q, n = self.src[(keys[0][0], p)], self.part_bytes[p]
            packed = ops.repack(raw[:, off: off + n].reshape(len(keys), q.shape[1], -1), q.qtype.name, q.shape[-1])
            for dst, src in zip(_fields(self.pool[p]), _fields(packed), strict=True):
                dst.index_copy_(0, idx, src)
            off += n
        li = torch.tensor([layer - self.layers.start for layer, _ in keys], dtype=torch.long)
        ex = torch.tensor([e for _, e in keys], dtype=torch.long)
        self.table.index_put_((li.to(self.device, non_blocking=True), ex.to(self.device, non_blocking=True)), idx)

    def _read_staged(self, keys: list[tuple[int, int]], slots: list[int]) -> None:
        """The GPU read: batches of STAGING_EXPERTS through the two pinned buffers in turn, each sent and
        repacked on the side stream while the host fills the other."""
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)  # the slots being refilled are not read by anything queued before
        for b, s in enumerate(range(0, len(keys), STAGING_EXPERTS)):
            k, sl = keys[s: s + STAGING_EXPERTS], slots[s: s + STAGING_EXPERTS]
            i = b % 2
            self.copied[i].synchronize()  # the buffer's previous batch has reached the device
            host = self.staging[i][: len(k) * self.slot_bytes].view(len(k), self.slot_bytes)
            self._gather(k, host)
            with torch.cuda.stream(self.stream):
                dev = self.dev_staging[i][: host.numel()].view_as(host)
                dev.copy_(host, non_blocking=True)
                self.copied[i].record(self.stream)
                self._scatter(k, sl, dev)
        main.wait_stream(self.stream)

    # ---- reporting ---------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        with self._lock:
            s = dataclasses.replace(self.stats)
        rate = s.bytes_read / s.stream_s / 1e9 if s.stream_s > 0 else 0.0
        return {**s.as_dict(), "stream_s": round(s.stream_s, 4), "gb_per_s": round(rate, 3),
                "capacity_bytes": self.capacity_bytes, "slot_bytes": self.slot_bytes, "slots": self.n_slots,
                "used_slots": len(self.slot_of), "min_bytes": self.min_bytes, "prefetch": self.prefetch_enabled,
                "device_bytes": self.nbytes, "staging_bytes": sum(t.numel() for t in self.staging)}


__all__ = ["CacheStats", "ExpertCache", "ExpertCacheTooSmall", "expert_bytes", "is_routed_expert", "min_cache_bytes",
           "too_small_message"]
