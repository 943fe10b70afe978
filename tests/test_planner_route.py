"""Route: the text and TOML forms and the validation messages."""

from __future__ import annotations

import pytest

from ds4station.model.route import Route, RouteError, Stage, parse_route, route_from_dict, route_from_toml

GiB = 1 << 30


def test_parse_and_format_round_trip() -> None:
    text = "cuda:0=embed,0-11,output; cuda:1=12-17; cuda:2=18-23"
    r = parse_route(text, 24)
    assert str(r) == text
    assert r.stages[0] == Stage("cuda:0", 0, 11, embed=True, output=True)
    assert [s.n_layers for s in r.stages] == [12, 6, 6]
    assert r.stage_of_layer(12) == 1 and r.output_stage == 0
    assert parse_route(str(r), 24) == r


def test_device_forms_cache_and_shared_devices() -> None:
    text = ("0000:03:00.0=embed,0-3,output,cache=2GiB; 06:00.0=4-5; GPU-2b3c4d5e-6f70-8192-a3b4-c5d6e7f80912=6; "
            "cpu=7-8; cpu=9")
    r = parse_route(text, 10)
    assert r.stages[0].expert_cache_bytes == 2 * GiB and r.stages[0].streaming
    assert r.devices == ["0000:03:00.0", "06:00.0", "GPU-2b3c4d5e-6f70-8192-a3b4-c5d6e7f80912", "cpu"]
    assert str(r) == text
    # the output head may sit on a later stage (the state comes back around the ring)
    assert parse_route("cuda:0=embed,0-4; cuda:0=5-9,output", 10).output_stage == 1


@pytest.mark.parametrize("text, message", [
    ("cuda:0=embed,0-11,output; cuda:1=13-23", r"gap, layer\(s\) 12 are on no stage"),
    ("cuda:0=embed,0-11,output; cuda:1=10-23", r"overlap, layer\(s\) 10-11"),
    ("cuda:0=embed,0-11,output; cuda:1=12-20", "layers 21-23 are on no stage"),
    ("cuda:0=0-11,output; cuda:1=12-23", "no stage holds the embedding"),
    ("cuda:0=0-11,output; cuda:1=embed,12-23", "must be on the first stage"),
    ("cuda:0=embed,0-11; cuda:1=12-23", "no stage holds the output head"),
    ("cuda:0=embed,0-11,output; cuda:1=12-23,output", "exactly one stage holds it"),
    ("gpu0=embed,0-23,output", "unknown device 'gpu0'"),
    ("cuda:0=embed,0-30,output", "layer 30 does not exist"),
    ("cuda:0=embed,5-0,output", "reversed"),
    ("cuda:0=embed,output", "no layer range"),
    ("cuda:0=embed,0-11,12-23,output", "more than one layer range"),
    ("cuda:0=embed,0-23,output,fast", "unknown item 'fast'"),
    ("cuda:0 embed 0-23", "expected DEVICE=ITEMS"),
    ("cuda:0=embed,0-23,output,cache=lots", "not a size"),
    ("", "empty route"),
])
def test_validation_messages(text: str, message: str) -> None:
    with pytest.raises(RouteError, match=message):
        parse_route(text, 24)


def test_toml_round_trip() -> None:
    r = parse_route("cuda:0=embed,0-11,output,cache=1728MiB; 0000:06:00.0=12-23", 24)
    toml = r.to_toml()
    assert 'expert_cache = "1728MiB"' in toml
    assert route_from_toml(toml, 24) == r
    assert route_from_dict({"route": str(r)}, 24) == r
    rows = [{"device": "cuda:0", "layers": "0-11", "embed": True, "output": True}, {"device": "cpu", "layers": "12-23"}]
    assert str(route_from_dict(rows, 24)) == "cuda:0=embed,0-11,output; cpu=12-23"
    with pytest.raises(RouteError, match="stage 1: missing field 'device'"):
        route_from_dict([rows[0], {"layers": "12-23"}], 24)


def test_route_object_validates_on_construction() -> None:
    with pytest.raises(RouteError, match="at least one stage"):
        Route((), 43)
    d = parse_route("cuda:0=embed,0-42,output", 43).to_dict()
    assert d["route"] == "cuda:0=embed,0-42,output" and d["stages"][0]["last_layer"] == 42
