"""Routed experts of one stage: resident, or streamed from the memory-mapped GGUF through a bounded cache.

Resident experts are dequantised once at load like every other weight. Streamed experts stay as raw
blocks in the memory map; an `ExpertCache` owns a fixed pool of expert *slots* on the stage's device, each
holding one expert's raw gate|up|down blocks (the q2 file: 6.75 MiB per expert). The pool is allocated once
at start, so the cache never grows past its size:

- a routed layer calls `select(layer, ids, tokens)` before its expert loop (see `install`): every selected
  expert is looked up (hit) or copied in from the file (miss), and the layer's selection is *pinned* until
  the next layer is selected, so a slot the running layer needs is never evicted;
- eviction is least-recently-selected first, among unpinned slots;
- after a selection the next layer's likely choices are prefetched on a background thread: exact for
  hash-routed layers (their experts are a table lookup of the token ids), the same layer's choices of the
  previous step otherwise (consecutive tokens reuse experts); a prefetch only takes a free or evictable slot;
- the model reads `gate[e]` / `up[e]` / `down[e]` through `ExpertView`s that dequantise the slot's blocks
  on use (a GPU kernel reads the slot's raw blocks directly; dequantising a slice of whole blocks gives
  bit-for-bit the rows of the whole tensor's dequantisation, so streamed == resident exactly).

A cache smaller than one layer's full expert table is refused (`ExpertCacheTooSmall`): a long prefill
chunk can select all n_experts experts of a layer, and all of them must be pinned at once.

Statistics: every demand lookup is a hit or a miss; a prefetch read counts as a lookup and a miss when it
happens (the later demand lookup of that expert is then a hit), so hits + misses == lookups and
bytes_read == misses x expert bytes always hold; `prefetched` says how many of the misses were prefetches.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ds4station.kernels.quants import QTensor, dequantize
from ds4station.model.config import ModelConfig
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
    prefetched: int = 0  # misses issued ahead of demand by the prefetcher
    evictions: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class ExpertView:
    """`[E, rows, cols]`-like stand-in for one layer's gate/up/down expert tensor: `view[e]` is a float32
    tensor dequantised from the cache slot (what model.MoE indexes)."""

    dtype = torch.float32

    def __init__(self, cache: ExpertCache, layer: int, part: str) -> None:
        self.cache, self.layer, self.part = cache, layer, part
        self.shape = cache.shapes[(layer, part)]
        self.device = cache.device

    def is_floating_point(self) -> bool:
        return True

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, e: int) -> torch.Tensor:
        return self.cache.get(self.layer, int(e), self.part)

    def __repr__(self) -> str:
        return f"ExpertView(blk.{self.layer}.{self.part}, shape={list(self.shape)}, streamed)"


class ExpertCache:
    """A fixed pool of expert slots for the routed experts of `layers`, filled from `tensors` on demand."""

    def __init__(self, cfg: ModelConfig, tensors: Mapping[str, QTensor], layers: range, capacity_bytes: int,
                 device: torch.device | str = "cpu", *, prefetch: bool = True, where: str = "") -> None:
        self.cfg, self.layers, self.device = cfg, layers, torch.device(device)
        self.capacity_bytes = int(capacity_bytes)
        self.src: dict[tuple[int, str], QTensor] = {}
        self.shapes: dict[tuple[int, str], tuple[int, ...]] = {}
        self.part_bytes: dict[tuple[int, str], int] = {}
        for i in layers:
            for part in PARTS:
                q = tensors[expert_name(i, part)]
                self.src[(i, part)] = q
                self.shapes[(i, part)] = q.shape
                self.part_bytes[(i, part)] = q.nbytes // q.shape[0]
        self.slot_bytes = max((expert_bytes(tensors, i) for i in layers), default=0)
        n_experts = max((self.shapes[(i, "gate")][0] for i in layers), default=0)
        self.min_bytes = n_experts * self.slot_bytes
        if self.capacity_bytes < self.min_bytes:
            raise ExpertCacheTooSmall(too_small_message(self.capacity_bytes, n_experts, self.slot_bytes, where))
        self.n_slots = self.capacity_bytes // self.slot_bytes if self.slot_bytes else 0
        # the whole pool up front: the cache's memory is fixed from the start (no fragmentation on a GPU)
        self.pool = torch.empty(self.n_slots, self.slot_bytes, dtype=torch.uint8, device=self.device)
        self.free = list(range(self.n_slots - 1, -1, -1))
        self.slot_of: OrderedDict[tuple[int, int], int] = OrderedDict()  # LRU order: oldest first
        self.pinned: set[tuple[int, int]] = set()
        self.stats = CacheStats()
        # hash-routed layers choose experts by token id alone, so their choices are known ahead of time
        self.tid2eid = {i: tensors[f"blk.{i}.ffn_gate_tid2eid.weight"].dequantize().long()
                        for i in layers if cfg.is_hash_layer(i)}
        self.last_choice: dict[int, list[int]] = {}
        self.prefetch_enabled = prefetch
        self._lock = threading.Lock()
        self._prefetcher = _Prefetcher() if prefetch else None

    # ---- the model's side --------------------------------------------------------------------------
    def view(self, layer: int, part: str) -> ExpertView:
        return ExpertView(self, layer, part)

    def select(self, layer: int, ids: torch.Tensor, tokens: torch.Tensor | None = None) -> None:
        """The routed experts of `layer` for the tokens being computed: load them, pin them (releasing the
        previous layer's pins) and start prefetching the next layer's likely choices."""
        if self._prefetcher is not None:
            self._prefetcher.wait()  # the cache is mutated by one party at a time, in a fixed order
        wanted = sorted(set(ids.flatten().tolist()))
        with self._lock:
            self.pinned = {(layer, e) for e in wanted}
            for e in wanted:
                self._lookup((layer, e))
        self.last_choice[layer] = wanted
        nxt = layer + 1
        if self._prefetcher is not None and nxt in self.layers:
            guess = self._guess(nxt, tokens)
            if guess:
                self._prefetcher.submit(lambda: self._prefetch(nxt, guess))

    def get(self, layer: int, e: int, part: str) -> torch.Tensor:
        """Expert e's `part` of `layer` as float32 [rows, cols]."""
        key = (layer, e)
        with self._lock:
            slot = self.slot_of.get(key)
        if slot is None:  # used without a select() first (no hook installed): a demand lookup now
            if self._prefetcher is not None:
                self._prefetcher.wait()
            with self._lock:
                slot = self._lookup(key)
        off = 0
        for p in PARTS[: PARTS.index(part)]:
            off += self.part_bytes[(layer, p)]
        n = self.part_bytes[(layer, part)]
        q = self.src[(layer, part)]
        return dequantize(self.pool[slot, off: off + n], q.qtype, q.shape[1:])

    # ---- internals ---------------------------------------------------------------------------------
    def _lookup(self, key: tuple[int, int]) -> int:
        """A demand lookup (lock held): a hit refreshes the LRU position, a miss reads the expert."""
        self.stats.lookups += 1
        slot = self.slot_of.get(key)
        if slot is not None:
            self.stats.hits += 1
            self.slot_of.move_to_end(key)
            return slot
        self.stats.misses += 1
        slot = self._take_slot()
        if slot is None:  # cannot happen when the pool holds a full layer (checked at start)
            raise RuntimeError(f"expert cache: all {self.n_slots} slots are pinned by the running layer")
        self._read(key, slot)
        return slot

    def _take_slot(self) -> int | None:
        if self.free:
            return self.free.pop()
        for key in self.slot_of:  # oldest first
            if key not in self.pinned:
                self.stats.evictions += 1
                return self.slot_of.pop(key)
        return None

    def _read(self, key: tuple[int, int], slot: int) -> None:
        """Copy expert key's raw blocks from the memory map into `slot`."""
        layer, e = key
        off = 0
        for part in PARTS:
            n = self.part_bytes[(layer, part)]
            self.pool[slot, off: off + n].copy_(self.src[(layer, part)].data[e * n: (e + 1) * n])
            off += n
        self.slot_of[key] = slot
        self.stats.bytes_read += off  # == slot_bytes: every DS4 layer's experts have the same size

    def _guess(self, layer: int, tokens: torch.Tensor | None) -> list[int]:
        if layer in self.tid2eid and tokens is not None:
            return sorted(set(self.tid2eid[layer][tokens.cpu()].flatten().tolist()))
        return self.last_choice.get(layer, [])

    def _prefetch(self, layer: int, experts: list[int]) -> None:
        with self._lock:
            for e in experts:
                key = (layer, e)
                if key in self.slot_of:
                    continue
                slot = self._take_slot()
                if slot is None:  # everything else is pinned: never evict the running layer's experts
                    return
                self.stats.lookups += 1
                self.stats.misses += 1
                self.stats.prefetched += 1
                self._read(key, slot)

    # ---- reporting and teardown --------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        if self._prefetcher is not None:
            self._prefetcher.wait()
        with self._lock:
            return {**self.stats.as_dict(), "capacity_bytes": self.capacity_bytes, "slot_bytes": self.slot_bytes,
                    "slots": self.n_slots, "used_slots": len(self.slot_of), "min_bytes": self.min_bytes,
                    "prefetch": self.prefetch_enabled}

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None


class _Prefetcher:
    """One daemon thread running prefetch jobs one at a time; `wait()` blocks until the queue is drained.
    A daemon thread (not an executor) so a process never waits on it at exit."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._job: Any = None
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="expert-prefetch", daemon=True)
        self._thread.start()

    def submit(self, job: Any) -> None:
        with self._cv:
            self._job, self._busy = job, True
            self._cv.notify_all()

    def wait(self) -> None:
        with self._cv:
            while self._busy:
                self._cv.wait()
            if self._error is not None:
                err, self._error = self._error, None
                raise RuntimeError(f"expert prefetch failed: {err}") from err

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._job is None and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job, self._job = self._job, None
            try:
                job()
            except BaseException as e:  # surfaced to the compute thread at its next wait()
                self._error = e
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


def install(model: Any, cache: ExpertCache) -> None:
    """Make every MoE of `model` (a DS4Model slice) tell the cache its selection before the expert loop.

    model.MoE calls `self.route(xn, tokens)` and then indexes the experts; wrapping the instance's `route`
    is the hook (no change to model.py). The cleaner permanent form is a call in MoE.__call__ right after
    routing: `select = getattr(self.gate, "select_experts", None); if select: select(ids, tokens)`.
    """
    for block in model.blocks:
        moe = block.moe
        if not isinstance(moe.gate, ExpertView):
            continue
        original = moe.route

        def route(xn: torch.Tensor, tokens: torch.Tensor, _route: Any = original,
                  _layer: int = block.layer) -> tuple[torch.Tensor, torch.Tensor]:
            ids, wts = _route(xn, tokens)
            cache.select(_layer, ids, tokens)
            return ids, wts

        moe.route = route


__all__ = ["CacheStats", "ExpertCache", "ExpertCacheTooSmall", "ExpertView", "expert_bytes", "install",
           "is_routed_expert", "min_cache_bytes", "too_small_message"]
