"""Route: which device holds which layers, the embedding, the output head and how big an expert cache.

A route is an ordered list of stages; activations flow through them in order. The text form is what
`serve --route` and presets accept, and what `str(route)` prints:

    cuda:0=embed,0-11,output; cuda:1=12-17,cache=2GiB; cuda:2=18-42

- device: `cpu`, `cuda:N`, a PCI bus id (`0000:03:00.0` or `03:00.0`) or a device UUID (`GPU-...` for
  NVIDIA, or a bare 8-4-4-4-12 UUID). Several stages may name the same device (they then share it).
- items, comma separated: `embed`, `output`, a layer range `A-B` (inclusive) or a single layer `A`, and
  optionally `cache=SIZE`, the routed-expert cache of a streaming stage (absent = experts resident).

Validation (`Route.validate` / `parse_route`) names the problem: a gap or overlap between stages, layers
out of range, a missing or duplicated embed/output, embed not on the stage holding layer 0, an unknown
device. The TOML form is a list of `[[stages]]` tables with the same fields as `Stage`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from .sizes import format_size, parse_size

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

_CUDA = re.compile(r"^cuda:(\d+)$")
_PCI = re.compile(r"^(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
_UUID = re.compile(r"^(?:GPU-|MIG-)?[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
_RANGE = re.compile(r"^(\d+)(?:\s*-\s*(\d+))?$")


class RouteError(ValueError):
    """A route that cannot run; the message says what is wrong and where."""


def check_device(device: str) -> str:
    """Return the canonical device string or raise RouteError naming the accepted forms."""
    d = device.strip()
    if d == "cpu" or _CUDA.match(d) or _PCI.match(d) or _UUID.match(d):
        return d
    if d.lower() == "cpu":
        return "cpu"
    raise RouteError(f"unknown device {device!r}: use cpu, cuda:N, a PCI bus id like 0000:03:00.0, or a GPU UUID")


@dataclass(frozen=True)
class Stage:
    device: str
    first_layer: int
    last_layer: int  # inclusive
    embed: bool = False
    output: bool = False
    expert_cache_bytes: int = 0  # 0 = routed experts resident

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.last_layer + 1)

    @property
    def n_layers(self) -> int:
        return self.last_layer - self.first_layer + 1

    @property
    def streaming(self) -> bool:
        return self.expert_cache_bytes > 0

    def __str__(self) -> str:
        items = []
        if self.embed:
            items.append("embed")
        span = str(self.first_layer) if self.first_layer == self.last_layer else f"{self.first_layer}-{self.last_layer}"
        items.append(span)
        if self.output:
            items.append("output")
        if self.expert_cache_bytes:
            items.append(f"cache={format_size(self.expert_cache_bytes)}")
        return f"{self.device}={','.join(items)}"


@dataclass(frozen=True)
class Route:
    stages: tuple[Stage, ...]
    n_layers: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        self.validate()

    def __str__(self) -> str:
        return "; ".join(str(s) for s in self.stages)

    def __len__(self) -> int:
        return len(self.stages)

    @property
    def devices(self) -> list[str]:
        """Distinct devices in stage order."""
        return list(dict.fromkeys(s.device for s in self.stages))

    @property
    def output_stage(self) -> int:
        return next(i for i, s in enumerate(self.stages) if s.output)

    def stage_of_layer(self, layer: int) -> int:
        for i, s in enumerate(self.stages):
            if s.first_layer <= layer <= s.last_layer:
                return i
        raise RouteError(f"layer {layer} is outside 0-{self.n_layers - 1}")

    def validate(self) -> None:
        if self.n_layers <= 0:
            raise RouteError(f"the model has {self.n_layers} layers")
        if not self.stages:
            raise RouteError("a route needs at least one stage")
        expected = 0
        for i, s in enumerate(self.stages):
            where = f"stage {i} ({s.device})"
            check_device(s.device)
            if s.first_layer > s.last_layer:
                raise RouteError(f"{where}: layer range {s.first_layer}-{s.last_layer} is reversed")
            if s.last_layer >= self.n_layers:
                raise RouteError(f"{where}: layer {s.last_layer} does not exist (the model has layers "
                                 f"0-{self.n_layers - 1})")
            if s.first_layer > expected:
                missing = f"{expected}" if s.first_layer == expected + 1 else f"{expected}-{s.first_layer - 1}"
                raise RouteError(f"{where}: gap, layer(s) {missing} are on no stage (stages must cover the "
                                 f"layers in order, each starting where the previous one ended)")
            if s.first_layer < expected:
                raise RouteError(f"{where}: overlap, layer(s) {s.first_layer}-{expected - 1} are already on an "
                                 f"earlier stage")
            if s.expert_cache_bytes < 0:
                raise RouteError(f"{where}: negative expert cache")
            expected = s.last_layer + 1
        if expected != self.n_layers:
            raise RouteError(f"layers {expected}-{self.n_layers - 1} are on no stage (the last stage ends at "
                             f"{expected - 1})")
        embeds = [i for i, s in enumerate(self.stages) if s.embed]
        outputs = [i for i, s in enumerate(self.stages) if s.output]
        if not embeds:
            raise RouteError("no stage holds the embedding: add `embed` to the first stage")
        if len(embeds) > 1:
            raise RouteError(f"the embedding is on stages {embeds}; exactly one stage (the first) holds it")
        if embeds[0] != 0:
            raise RouteError(f"the embedding is on stage {embeds[0]}; it must be on the first stage, the one "
                             f"holding layer 0")
        if not outputs:
            raise RouteError("no stage holds the output head: add `output` to a stage (usually the first)")
        if len(outputs) > 1:
            raise RouteError(f"the output head is on stages {outputs}; exactly one stage holds it")

    # ---- TOML / JSON form ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"route": str(self), "stages": [asdict(s) for s in self.stages]}

    def to_toml(self) -> str:
        """`[[stages]]` tables; read back with `route_from_toml`."""
        out = []
        for s in self.stages:
            out.append("[[stages]]")
            out.append(f'device = "{s.device}"')
            out.append(f"first_layer = {s.first_layer}")
            out.append(f"last_layer = {s.last_layer}")
            out.append(f"embed = {str(s.embed).lower()}")
            out.append(f"output = {str(s.output).lower()}")
            if s.expert_cache_bytes:
                out.append(f'expert_cache = "{format_size(s.expert_cache_bytes)}"')
            out.append("")
        return "\n".join(out)


def parse_route(text: str, n_layers: int) -> Route:
    """Parse the text form (see the module docstring) and validate it against `n_layers`."""
    stages = []
    parts = [p.strip() for p in text.replace("\n", ";").split(";")]
    parts = [p for p in parts if p]
    if not parts:
        raise RouteError("empty route: write e.g. 'cuda:0=embed,0-21,output; cuda:1=22-42'")
    for k, part in enumerate(parts):
        if "=" not in part:
            raise RouteError(f"stage {k} {part!r}: expected DEVICE=ITEMS, e.g. 'cuda:1=12-17'")
        device, _, body = part.partition("=")
        device = check_device(device)
        embed = output = False
        cache = 0
        span: tuple[int, int] | None = None
        for item in (x.strip() for x in body.split(",")):
            low = item.lower()
            if low == "embed":
                embed = True
            elif low == "output":
                output = True
            elif low.startswith("cache=") or low.startswith("expert_cache="):
                try:
                    cache = parse_size(item.split("=", 1)[1])
                except ValueError as e:
                    raise RouteError(f"stage {k} ({device}): {e}") from e
            elif m := _RANGE.match(item):
                if span is not None:
                    raise RouteError(f"stage {k} ({device}): more than one layer range; a stage holds one "
                                     f"contiguous range")
                a = int(m.group(1))
                b = int(m.group(2)) if m.group(2) is not None else a
                span = (a, b)
            else:
                raise RouteError(f"stage {k} ({device}): unknown item {item!r} (use embed, output, A-B, "
                                 f"cache=SIZE)")
        if span is None:
            raise RouteError(f"stage {k} ({device}): no layer range; every stage holds at least one layer")
        stages.append(Stage(device, span[0], span[1], embed, output, cache))
    return Route(tuple(stages), n_layers)


def route_from_dict(data: dict[str, Any] | list[dict[str, Any]], n_layers: int) -> Route:
    """From the TOML/JSON form: {"stages": [{device, first_layer, last_layer, embed, output, ...}]} or
    {"route": "text form"}. `layers = "A-B"` is accepted in place of first_layer/last_layer."""
    if isinstance(data, dict) and "stages" not in data and "route" in data:
        return parse_route(str(data["route"]), n_layers)
    rows = data["stages"] if isinstance(data, dict) else data
    stages = []
    for k, row in enumerate(rows):
        try:
            if "layers" in row:
                m = _RANGE.match(str(row["layers"]).strip())
                if not m:
                    raise RouteError(f"stage {k}: layers = {row['layers']!r} is not A-B")
                first, last = int(m.group(1)), int(m.group(2) or m.group(1))
            else:
                first, last = int(row["first_layer"]), int(row["last_layer"])
            cache = row.get("expert_cache_bytes", row.get("expert_cache", 0))
            stages.append(Stage(check_device(str(row["device"])), first, last, bool(row.get("embed", False)),
                                bool(row.get("output", False)), parse_size(cache)))
        except KeyError as e:
            raise RouteError(f"stage {k}: missing field {e.args[0]!r}") from e
        except ValueError as e:
            if isinstance(e, RouteError):
                raise
            raise RouteError(f"stage {k}: {e}") from e
    return Route(tuple(stages), n_layers)


def route_from_toml(text: str, n_layers: int) -> Route:
    return route_from_dict(tomllib.loads(text), n_layers)


__all__ = ["Route", "RouteError", "Stage", "check_device", "parse_route", "route_from_dict", "route_from_toml"]
