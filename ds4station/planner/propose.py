"""The proposer: given devices (in stage order) and a preset, choose the route, the context and the caches.

Stages are contiguous layer ranges on the devices in the order given; the first device holds the embedding
and the output head (it is the coordinator that samples); a later device may be left out when it is not
needed. Every choice is a bottleneck dynamic programme over (device, layer boundary), exact for 43 layers:

- speed: context fixed (32K); minimise the largest per-stage decode cost (weight bytes read per token over
  the device's bandwidth), then, among the splits that reach it, maximise the smallest spare memory.
- context: the longest context any split fits (binary search over multiples of ctx_step, capped at the
  model's limit); then, conservatively, only splits that keep `spare_target` free on every device (or as
  much as the roomiest split can, if less) are considered, and the fastest of those is taken.
  Routed experts are streamed through a per-process cache when asked (--expert-cache) or when resident
  weights leave too little room (preset `stream_below_ctx`, or a --ctx that resident weights cannot reach).

`evaluate` gives the same per-stage accounting for a route written by hand. A plan that cannot fit raises
PlanError saying by how much and what would help.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ds4station.model.footprint import (
    CPU_DEQUANT_BYTES,
    FootprintSettings,
    ModelShape,
    StageFootprint,
    expert_cache_device_bytes,
    kv_bytes,
    layer_kv_bytes,
    scratch_bytes,
    stage_footprint,
    stage_mtp_bytes,
)
from ds4station.model.route import Route, Stage
from ds4station.model.sizes import MiB, format_size, gib

from .devices import CARD_BANDWIDTH, DEFAULT_HOST_RESERVE, DeviceBudget
from .presets import PlanSettings

# Device memory (~1 TB/s on Vega 20, ~4 TB/s on an H200) over the host link an expert miss crosses
# (PCIe 3.0/4.0 x16, ~13-25 GB/s): a missed byte costs this many resident bytes of decode time.
STREAM_MISS_PENALTY = 40.0


Split = list[tuple[int, int, int]]  # (device index, first layer, end layer exclusive) per used device


class PlanError(ValueError):
    """No plan fits; the message says by how much and what would help."""


@dataclass(frozen=True)
class StagePlan:
    stage: Stage
    budget: DeviceBudget
    footprint: StageFootprint
    available_bytes: int
    decode_read_bytes: int

    @property
    def fits(self) -> bool:
        return self.footprint.predicted_bytes <= self.available_bytes

    @property
    def spare_bytes(self) -> int:
        return self.available_bytes - self.footprint.predicted_bytes

    def to_dict(self) -> dict[str, object]:
        s, f = self.stage, self.footprint
        return {
            "device": s.device, "label": self.budget.label, "kind": self.budget.kind, "desktop": self.budget.desktop,
            "first_layer": s.first_layer, "last_layer": s.last_layer, "embed": s.embed, "output": s.output,
            "weights_bytes": f.weights_bytes, "kv_bytes": f.kv_bytes, "scratch_bytes": f.scratch_bytes,
            "overhead_bytes": f.overhead_bytes, "expert_cache_bytes": f.expert_cache_bytes,
            "mtp_bytes": f.mtp_bytes, "predicted_bytes": f.predicted_bytes, "available_bytes": self.available_bytes,
            "total_bytes": self.budget.total_bytes, "decode_read_bytes": self.decode_read_bytes,
            "bandwidth_gbs": self.budget.bandwidth_gbs or None, "decode_ms": self.decode_ms,
        }

    @property
    def decode_ms(self) -> float | None:
        """Weight-read time per decoded token at the nominal bandwidth (a floor, not a prediction)."""
        bw = self.budget.bandwidth_gbs
        return round(self.decode_read_bytes / (bw * 1e6), 3) if bw else None


@dataclass(frozen=True)
class Plan:
    preset: str
    model: str
    ctx: int
    route: Route
    stages: tuple[StagePlan, ...]
    max_resident_ctx: int  # 0 when resident weights do not fit at the minimum context
    notes: tuple[str, ...] = ()
    footprint: FootprintSettings = dataclasses.field(default_factory=FootprintSettings)  # sessions, chunk, ...
    excluded: tuple[tuple[DeviceBudget, str], ...] = ()  # the devices the route leaves out, and why

    @property
    def streaming(self) -> bool:
        return any(s.stage.streaming for s in self.stages)

    @property
    def layer_counts(self) -> list[int]:
        return [s.stage.n_layers for s in self.stages]

    def to_dict(self) -> dict[str, object]:
        return {
            "preset": self.preset, "model": self.model, "ctx": self.ctx, "route": str(self.route),
            "streaming": self.streaming, "max_resident_ctx": self.max_resident_ctx,
            "stages": [s.to_dict() for s in self.stages], "notes": list(self.notes),
            "excluded": [{"device": d.device, "label": d.label, "reason": why} for d, why in self.excluded],
            "sessions": self.footprint.sessions, "prefill_chunk": self.footprint.prefill_chunk,
            "rollback": self.footprint.rollback, "kv_dtype": self.footprint.kv_dtype, "mtp": self.footprint.mtp,
        }


class _Planner:
    """Per-layer prefix sums so a stage's footprint for any (device, range, ctx) is O(1)."""

    def __init__(self, model: ModelShape, devices: Sequence[DeviceBudget], settings: PlanSettings,
                 host_ram: int | None) -> None:
        if not devices:
            raise PlanError("no devices to plan for: give --gpus SPEC (e.g. 32GiB,16GiBx4) or plug in a GPU")
        self.model, self.devices, self.settings, self.host_ram = model, list(devices), settings, host_ram
        cfg = model.cfg
        self.L = cfg.n_layers
        self.avail = [d.available(settings.desktop_headroom, settings.reserve) for d in devices]
        self.w_res = _prefix(model.layer_weight_bytes(i) for i in range(self.L))
        self.w_str = _prefix(model.layer_weight_bytes(i, streaming=True) for i in range(self.L))
        self.read = _prefix(model.decode_read_bytes)
        self.expert = _prefix(model.expert_bytes)
        self.n_idx = _prefix(int(cfg.has_indexer(i)) for i in range(self.L))
        self.head = model.embed_bytes + model.output_bytes
        # the MTP layer's weights and state (window-only: the same at any context)
        self.mtp = stage_mtp_bytes(model, cfg.window, settings.footprint, embed=True)
        # Decode time ~ bytes read / bandwidth. A card of unknown bandwidth counts as the mean of the cards' known
        # ones; with none known, as CARD_BANDWIDTH beside a CPU stage (which always has one: devices.CPU_BANDWIDTH)
        # and all alike otherwise. Costs are scaled back to "bytes at the mean bandwidth".
        cards = [d.bandwidth_gbs for d in devices if d.bandwidth_gbs > 0 and d.kind != "cpu"]
        card = sum(cards) / len(cards) if cards else CARD_BANDWIDTH if any(d.bandwidth_gbs > 0 for d in devices) \
            else 1.0
        bws = [d.bandwidth_gbs or card for d in devices]
        mean = sum(bws) / len(bws)
        self.speed = [mean / bw for bw in bws]
        self.min_cache = model.min_expert_cache(range(self.L))
        self._kv_ctx = -1
        self._kv: list[int] = []

    # ---- footprint of a candidate stage ---------------------------------------------------------
    def _kv_prefix(self, ctx: int) -> list[int]:
        if ctx != self._kv_ctx:
            cfg, fs = self.model.cfg, self.settings.footprint
            self._kv = _prefix(fs.sessions * layer_kv_bytes(cfg, i, ctx, fs.kv_dtype, chunk=fs.prefill_chunk,
                                                            rollback=fs.rollback) for i in range(self.L))
            self._kv_ctx = ctx
        return self._kv

    def cache_for(self, j: int, cache: int) -> int:
        return 0 if self.devices[j].kind == "cpu" else cache

    def predicted(self, j: int, a: int, b: int, ctx: int, cache: int) -> int:
        """Bytes for device j holding layers [a, b); must equal stage_footprint (a test checks)."""
        cfg, fs = self.model.cfg, self.settings.footprint
        cache = self.cache_for(j, cache)
        w = (self.w_str if cache else self.w_res)
        kv = self._kv_prefix(ctx)
        n = w[b] - w[a] + kv[b] - kv[a] + fs.runtime_overhead
        if cache:  # slots, slot table and staging (CPU stages never stream: cache_for)
            n += expert_cache_device_bytes(self.model, range(a, b), cache)
        if self.devices[j].kind == "cpu":
            n += CPU_DEQUANT_BYTES
        n += scratch_bytes(cfg, range(a, b) if self.n_idx[b] - self.n_idx[a] else range(0), ctx, fs, output=j == 0)
        if j == 0:
            n += self.head + self.mtp  # the embedding, the head and (--draft mtp) the MTP layer beside it
        return n

    def decode_cost(self, j: int, a: int, b: int, cache: int = 0) -> float:
        """Weight bytes read per decoded token, plus, on a streaming stage, the expected expert misses
        (uniform routing over the stage's expert tables sharing one cache) weighted by how much slower the
        host link is than device memory; scaled by the device's relative slowness."""
        cost = float(self.read[b] - self.read[a] + (self.model.output_bytes if j == 0 else 0))
        cache = self.cache_for(j, cache)
        if cache:
            cfg = self.model.cfg
            table = self.expert[b] - self.expert[a]
            hit = min(cache / table, 1.0) if table else 1.0
            cost += (1.0 - hit) * table * cfg.n_experts_used / cfg.n_experts * STREAM_MISS_PENALTY
        return cost * self.speed[j]

    # ---- the bottleneck DP ------------------------------------------------------------------------
    def solve(self, value: Callable[[int, int, int], float | None], minimise: bool) -> Split | None:
        """Split layers over devices (in order; device 0 always used, others optional) optimising the
        worst stage's `value(j, a, b)` (None = not allowed). Returns [(device, a, b)] or None."""
        L, m = self.L, len(self.devices)
        worst = float("-inf") if minimise else float("inf")
        inf = float("inf") if minimise else float("-inf")
        better = (lambda x, y: x < y) if minimise else (lambda x, y: x > y)
        comb = max if minimise else min
        best: list[list[float]] = [[inf] * (L + 1) for _ in range(m + 1)]
        back: list[list[tuple[int, int] | None]] = [[None] * (L + 1) for _ in range(m + 1)]
        best[0][0] = worst
        for j in range(m):
            for i in range(L + 1):
                cur = best[j][i]
                if cur == inf:
                    continue
                if j > 0 and better(cur, best[j + 1][i]):  # leave device j out
                    best[j + 1][i], back[j + 1][i] = cur, (i, 0)
                for k in range(i + 1, L + 1):
                    v = value(j, i, k)
                    if v is None:
                        break  # bytes and costs only grow with more layers: longer ranges are worse still
                    c = comb(cur, v)
                    if better(c, best[j + 1][k]):
                        best[j + 1][k], back[j + 1][k] = c, (i, 1)
                if j == 0:
                    break  # device 0 starts at layer 0 only
        if best[m][L] == inf:
            return None
        out = []
        i = L
        for j in range(m, 0, -1):
            step = back[j][i]
            assert step is not None
            prev, used = step
            if used:
                out.append((j - 1, prev, i))
            i = prev
        return out[::-1]

    def fits(self, ctx: int, cache: int, margin: int = 0) -> Callable[[int, int, int], float | None]:
        """-> spare(j, a, b): the bytes device j has left holding layers [a, b), None when that is below
        `margin`."""
        def spare(j: int, a: int, b: int) -> float | None:
            s = self.avail[j] - self.predicted(j, a, b, ctx, cache)
            return float(s) if s >= margin else None
        return spare

    def max_ctx(self, cache: int, upper: int, margin: int = 0) -> int:
        """Longest context (a multiple of ctx_step, or `upper`) at which some split fits keeping `margin`
        spare on every device; 0 if none."""
        step, lo = self.settings.ctx_step, self.settings.min_ctx
        if self.solve(self.fits(lo, cache, margin), minimise=False) is None:
            return 0
        if self.solve(self.fits(upper, cache, margin), minimise=False) is not None:
            return upper
        a, b = lo // step, upper // step  # fits at a*step, not at upper
        while b - a > 1:
            mid = (a + b) // 2
            if self.solve(self.fits(mid * step, cache, margin), minimise=False) is not None:
                a = mid
            else:
                b = mid
        return max(a * step, lo)

    # ---- building the answer -----------------------------------------------------------------------
    def plan(self, split: Split, ctx: int, caches: list[int], max_res: int, notes: list[str]) -> Plan:
        stages = []
        for n, ((j, a, b), cache) in enumerate(zip(split, caches, strict=True)):
            stages.append(Stage(self.devices[j].device, a, b - 1, embed=n == 0, output=n == 0,
                                expert_cache_bytes=cache))
        route = Route(tuple(stages), self.L)
        plans = tuple(self.stage_plan(s, self.devices[j], ctx) for s, (j, _, _) in zip(stages, split, strict=True))
        notes = notes + self.check_host_ram(plans)
        return Plan(self.settings.name, self.model.name, ctx, route, plans, max_res, tuple(notes),
                    self.settings.footprint, self.excluded(split, ctx, caches))

    def excluded(self, split: Split, ctx: int, caches: list[int]) -> tuple[tuple[DeviceBudget, str], ...]:
        """The devices `split` leaves out, each with the reason: too little room for even one layer (and what
        takes the rest), or not needed."""
        used = {j for j, _, _ in split}
        cache = max(caches, default=0)
        out = []
        for j, d in enumerate(self.devices):
            if j in used:
                continue
            one = min(self.predicted(j, i, i + 1, ctx, cache) for i in range(self.L))
            if self.avail[j] < one:
                taken = f": {gib(d.used_bytes)} in use by other processes" if d.used_bytes else ""
                out.append((d, f"only {gib(self.avail[j])} available{taken}; one layer needs {gib(one)}"))
            else:
                out.append((d, "not needed: the route fits on the other devices"))
        return tuple(out)

    def stage_plan(self, s: Stage, d: DeviceBudget, ctx: int) -> StagePlan:
        fp = stage_footprint(self.model, s.layers, ctx, self.settings.footprint, embed=s.embed, output=s.output,
                             expert_cache_bytes=s.expert_cache_bytes, device_kind=d.kind)
        read = self.read[s.last_layer + 1] - self.read[s.first_layer] + (self.model.output_bytes if s.output else 0)
        return StagePlan(s, d, fp, d.available(self.settings.desktop_headroom, self.settings.reserve), read)

    def check_host_ram(self, plans: Sequence[StagePlan]) -> list[str]:
        """APU (GTT) and CPU stages draw on the same system RAM, as do the pinned staging buffers of streaming
        GPU stages: refused when they do not fit with the host reserve. -> notes (the page cache the streamed
        experts would want and cannot have)."""
        if self.host_ram is None:
            return []
        need = host_need(self.model, [p.stage for p in plans], [p.footprint for p in plans],
                         [p.budget.kind for p in plans])
        errors, notes = host_messages(need, self.host_ram, what="RAM")
        if errors:
            raise PlanError(errors[0] + "; add RAM or move layers to a discrete GPU")
        return notes


@dataclass(frozen=True)
class HostNeed:
    """System RAM a route draws on besides the OS: what must be there (CPU and APU stages, pinned staging),
    and what streamed experts want in the page cache (those no cache holds; without it, misses read the disk)."""

    shared_bytes: int  # CPU / APU stages' predicted bytes
    pinned_bytes: int  # staging buffers of GPU streaming stages (page-locked)
    page_cache_bytes: int

    @property
    def required_bytes(self) -> int:
        return self.shared_bytes + self.pinned_bytes


def host_need(model: ModelShape, stages: Sequence[Stage], footprints: Sequence[StageFootprint],
              kinds: Sequence[str]) -> HostNeed:
    shared = sum(f.predicted_bytes for f, k in zip(footprints, kinds, strict=True) if k in ("apu", "cpu"))
    pinned = sum(f.host_staging_bytes for f in footprints)
    page = sum(max(sum(model.expert_bytes[i] for i in s.layers) - s.expert_cache_bytes, 0)
               for s in stages if s.streaming)
    return HostNeed(shared, pinned, page)


def host_messages(need: HostNeed, ram: int, what: str = "available RAM",
                  reserve: int = DEFAULT_HOST_RESERVE) -> tuple[list[str], list[str]]:
    """-> (errors: the route cannot run with `ram` bytes, warnings: it runs, but below the reserve or with
    the streamed experts partly on the disk), each naming the amounts."""
    errors, warnings = [], []
    room = ram - reserve
    parts = []
    if need.shared_bytes:
        parts.append(f"{gib(need.shared_bytes)} for the CPU/APU stages")
    if need.pinned_bytes:
        parts.append(f"{gib(need.pinned_bytes)} of pinned staging for streamed experts")
    if need.required_bytes > ram:
        errors.append(f"the route needs {gib(need.required_bytes)} of system RAM ({', '.join(parts)}) but "
                      f"{format_size(ram)} {what} is there (short by {gib(need.required_bytes - ram)})")
    elif need.required_bytes > room:
        (errors if what == "RAM" else warnings).append(
            f"the route needs {gib(need.required_bytes)} of system RAM ({', '.join(parts)}): {format_size(ram)} "
            f"{what} leaves {gib(ram - need.required_bytes)}, below the {format_size(reserve)} host reserve "
            f"(short by {gib(need.required_bytes - room)})")
    left = room - need.required_bytes
    if need.page_cache_bytes and need.page_cache_bytes > left:
        warnings.append(f"the streamed experts no cache holds ({gib(need.page_cache_bytes)}) fit the page cache "
                        f"only in part ({gib(max(left, 0))} of {what} beyond the stages and the "
                        f"{format_size(reserve)} reserve): their misses then read the disk")
    return errors, warnings


def _prefix(values) -> list[int]:  # type: ignore[no-untyped-def]
    out = [0]
    for v in values:
        out.append(out[-1] + int(v))
    return out


# The smallest prefill chunk the proposer falls back to when the preset's does not fit (its activations are
# scratch on every stage: 1.6 GiB per stage for Flash at 2048 tokens, 0.4 GiB at 512).
MIN_PREFILL_CHUNK = 256


def propose(model: ModelShape, devices: Sequence[DeviceBudget], settings: PlanSettings, *, ctx: int | None = None,
            expert_cache: int | None = None, host_ram: int | None = None) -> Plan:
    """The route, context and per-stage expert caches for `devices` (in stage order) under `settings`.

    ctx: the context to plan for (default: the preset's; for the context preset, the longest that fits).
    expert_cache: None = the preset decides; 0 = resident only; > 0 = stream routed experts through a cache of
    this many bytes per GPU process. host_ram: checks APU and CPU stages against the system RAM they share.
    When nothing fits with the preset's prefill chunk, halved chunks down to MIN_PREFILL_CHUNK are tried (the
    plan notes it: prompts then prefill in smaller, slower steps); the first refusal is the one raised.
    """
    chunk = settings.footprint.prefill_chunk
    try:
        return _propose(model, devices, settings, ctx, expert_cache, host_ram)
    except PlanError as first:
        while chunk > MIN_PREFILL_CHUNK:
            chunk //= 2
            smaller = dataclasses.replace(settings, footprint=dataclasses.replace(settings.footprint,
                                                                                  prefill_chunk=chunk))
            try:
                plan = _propose(model, devices, smaller, ctx, expert_cache, host_ram)
            except PlanError:
                continue
            note = (f"prefill chunk {chunk} instead of the preset's {settings.footprint.prefill_chunk}: its "
                    "activations did not fit (prompts prefill in smaller, slower steps)")
            return dataclasses.replace(plan, notes=(*plan.notes, note))
        raise first from None


def _propose(model: ModelShape, devices: Sequence[DeviceBudget], settings: PlanSettings, ctx: int | None,
             expert_cache: int | None, host_ram: int | None) -> Plan:
    limit = model.cfg.context_length
    if settings.min_ctx > limit:  # a small demo model: its whole context is the minimum
        settings = dataclasses.replace(settings, min_ctx=limit)
    if ctx is not None and not settings.min_ctx <= ctx <= limit:
        raise PlanError(f"--ctx {ctx} is outside {settings.min_ctx}-{limit} (the model's limit)")
    target = ctx if ctx is not None else (min(settings.ctx, limit) if settings.ctx is not None else None)
    p = _Planner(model, devices, settings, host_ram)
    if expert_cache is not None and 0 < expert_cache < p.min_cache:
        raise PlanError(f"an expert cache of {format_size(expert_cache)} cannot hold one layer's routed experts: "
                        f"the minimum is {format_size(p.min_cache)} ({gib(p.min_cache)}); "
                        f"use --expert-cache {format_size(_round_up_mib(p.min_cache))} or more")
    notes: list[str] = []
    max_res = p.max_ctx(0, limit)

    # resident or streaming?
    if expert_cache is not None:
        cache = expert_cache
    elif settings.expert_streaming == "never":
        cache = 0
    else:
        wanted = target if target is not None else min(settings.stream_below_ctx, limit)
        # a cache larger than all the routed experts buys nothing
        cache = 0 if max_res >= wanted else min(settings.expert_cache, sum(model.expert_bytes))
    if cache and cache < p.min_cache:
        raise PlanError(f"the preset's expert cache {format_size(cache)} is below one layer's expert table "
                        f"({format_size(p.min_cache)}); set expert_cache to at least that")
    if cache and expert_cache is None:
        why = (f"resident weights reach only {max_res} tokens" if max_res else "resident weights do not fit")
        notes.append(f"streaming routed experts through a {format_size(cache)} cache per GPU process: {why}")

    if settings.objective == "context" and target is None:
        margin = settings.spare_target  # the longest context that still leaves this on every device
        best = p.max_ctx(cache, limit, margin) if margin else 0
        if best == 0:
            best = max_res if not cache else p.max_ctx(cache, limit)
            if best and margin:
                notes.append(f"no split keeps the preset's {format_size(margin)} spare on every device; this plan "
                             "leaves less on its tightest one")
        if best == 0:
            raise _refusal(p, settings.min_ctx, cache)
        ctx_final = best
    else:
        ctx_final = target if target is not None else settings.min_ctx
        if p.solve(p.fits(ctx_final, cache), minimise=False) is None:
            raise _refusal(p, ctx_final, cache)

    one = p.fits(ctx_final, cache, settings.spare_target)(0, 0, p.L) if settings.objective == "speed" else None
    if one is not None:  # one card holds it all: nothing to gain from spreading layers over idle cards
        split = [(0, 0, p.L)]
        if len(devices) > 1:
            notes.append(f"the whole model fits on {devices[0].label}: one stage, the other devices left idle")
    else:
        split = _choose_split(p, ctx_final, cache)
    if max_res and cache == 0 and settings.objective == "speed" and max_res > ctx_final:
        notes.append(f"resident weights leave room for up to {max_res} tokens of context (the context preset)")
    caches = [p.cache_for(j, cache) for j, _, _ in split]
    if cache and settings.objective == "context" and expert_cache is None:
        caches = _grow_caches(p, split, ctx_final, cache, notes)
    return p.plan(split, ctx_final, caches, max_res, notes)


def _grow_caches(p: _Planner, split: Split, ctx: int, cache: int, notes: list[str]) -> list[int]:
    """The context preset gives what each streaming device has left, above its spare target, to its expert
    cache (in whole MiB, at most the stage's whole expert table), and notes the expected hit rate (uniform
    routing: the share of the stage's experts the cache holds)."""
    out, grown = [], []
    for n, (j, a, b) in enumerate(split):
        base = p.cache_for(j, cache)
        if not base:
            out.append(0)
            continue
        spare = p.avail[j] - p.predicted(j, a, b, ctx, base) - p.settings.spare_target
        table = p.expert[b] - p.expert[a]
        size = min(base + max(spare, 0), max(table, base)) // MiB * MiB
        out.append(max(size, base))
        if size > base:
            grown.append(f"stage {n} {format_size(base)} -> {format_size(size)} (hit rate ~{min(base / table, 1):.0%} "
                         f"-> ~{min(size / table, 1):.0%})")
    if grown:
        notes.append("expert caches grown into the spare memory: " + "; ".join(grown))
    return out


def _choose_split(p: _Planner, ctx: int, cache: int) -> Split:
    """Fastest split (smallest worst-stage decode cost) among those keeping `floor` spare on every device,
    then, among the equally fast, the one with the most spare on its tightest device. The speed preset's
    floor is 0; the context preset's is its spare_target, or all the tightest split can keep if less."""
    fits = p.fits(ctx, cache)
    floor = 0.0
    if p.settings.spare_target:
        roomiest = p.solve(fits, minimise=False)
        assert roomiest is not None
        floor = min(float(p.settings.spare_target), min(fits(j, a, b) or 0.0 for j, a, b in roomiest))

    def cost(j: int, a: int, b: int) -> float | None:
        s = fits(j, a, b)
        return p.decode_cost(j, a, b, cache) if s is not None and s >= floor else None
    split = p.solve(cost, minimise=True)
    assert split is not None
    worst = max(p.decode_cost(j, a, b, cache) for j, a, b in split)

    def spare_at_worst(j: int, a: int, b: int) -> float | None:
        s = fits(j, a, b)
        return s if s is not None and s >= floor and p.decode_cost(j, a, b, cache) <= worst else None
    return p.solve(spare_at_worst, minimise=False) or split


def evaluate(model: ModelShape, route: Route, devices: Sequence[DeviceBudget], settings: PlanSettings,
             ctx: int, host_ram: int | None = None) -> Plan:
    """Per-stage predicted vs available memory for a given route; `devices[i]` is stage i's device."""
    if len(devices) != len(route.stages):
        raise PlanError(f"the route has {len(route.stages)} stages but {len(devices)} device budgets were given")
    p = _Planner(model, devices, settings, host_ram)
    plans = tuple(p.stage_plan(s, d, ctx) for s, d in zip(route.stages, devices, strict=True))
    notes = p.check_host_ram(plans)
    return Plan(settings.name, model.name, ctx, route, plans, 0, tuple(notes), footprint=settings.footprint)


def _round_up_mib(n: int) -> int:
    return -(-n // (1 << 20)) * (1 << 20)


def _refusal(p: _Planner, ctx: int, cache: int) -> PlanError:
    """Why nothing fits at `ctx`, by how much, and what would help."""
    cfg, fs, model = p.model.cfg, p.settings.footprint, p.model
    weights = (p.w_str if cache else p.w_res)[p.L] + p.head
    kv = fs.sessions * kv_bytes(cfg, range(p.L), ctx, fs.kv_dtype, chunk=fs.prefill_chunk, rollback=fs.rollback)
    per_dev = fs.runtime_overhead + scratch_bytes(cfg, range(p.L), ctx, fs)
    need = weights + kv + sum(per_dev + p.cache_for(j, cache) for j in range(len(p.devices)))
    have = sum(p.avail)
    mode = f"with a {format_size(cache)} expert cache per process" if cache else "with resident weights"
    lines = [f"{model.name} does not fit {mode} at {ctx} tokens of context on "
             f"{', '.join(d.describe() for d in p.devices)}."]
    if need > have:
        lines.append(f"It needs about {gib(need)} ({gib(weights)} weights, {gib(kv)} KV, "
                     f"{gib(need - weights - kv)} runtime and scratch) but {gib(have)} is available: "
                     f"short by {gib(need - have)}.")
    else:
        big = max(model.layer_weight_bytes(i, bool(cache)) for i in range(p.L))
        lines.append(f"The total ({gib(need)}) is within what is available ({gib(have)}), but no contiguous split "
                     f"fits: layers are {gib(big)} each, and the first device must also hold the embedding and "
                     f"output head ({gib(p.head)}).")
    helps = []
    if cache == 0 and p.min_cache:
        alt = p.max_ctx(_round_up_mib(p.min_cache), cfg.context_length)
        if alt:
            helps.append(f"stream the routed experts (--expert-cache {format_size(_round_up_mib(p.min_cache))}; "
                         f"fits up to {alt} tokens)")
    shorter = p.max_ctx(cache, cfg.context_length) if ctx > p.settings.min_ctx else 0
    if shorter:
        helps.append(f"a shorter context (fits up to {shorter} tokens)")
    short = max(need - have, 0)
    helps.append(f"another GPU with at least {gib(short + fs.runtime_overhead + p.settings.reserve)} free"
                 if short else "a larger card first in --gpus (it holds the embedding and the output head)")
    if not any(d.kind == "cpu" for d in p.devices):
        helps.append("a CPU stage for the last layers (--gpus SPEC,cpu --host-ram SIZE)")
    if any(d.desktop for d in p.devices):
        helps.append(f"less desktop headroom (now {format_size(p.settings.desktop_headroom)})")
    lines.append("What would help: " + "; ".join(helps) + ".")
    return PlanError("\n".join(lines))


__all__ = ["HostNeed", "Plan", "PlanError", "StagePlan", "evaluate", "host_messages", "host_need", "propose"]
