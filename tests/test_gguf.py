"""GGUF round trip of the demo model, per-stage loading, and clear errors on damaged files."""

from __future__ import annotations

import dataclasses
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from ds4station.engine.demo import make_model, random_weight
from ds4station.engine.weights import load_tensors, tensor_view, write_gguf
from ds4station.kernels.quants import QTensor
from ds4station.model.config import FLASH, TINY
from ds4station.model.gguf import GGUFError, GGUFFile
from ds4station.model.layout import model_tensors


@pytest.fixture(scope="module")
def tiny_q2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("m") / "tiny.gguf", seed=7)


def test_flash_layout_matches_the_real_q2_file() -> None:
    specs = model_tensors(FLASH, "q2")
    assert len(specs) == 1328  # DS4-MODEL.md: 1,328 tensors, 80.76 GiB, 284.33 B parameters
    assert round(sum(s.n_bytes for s in specs) / 2**30, 2) == 80.76
    assert round(sum(s.n_elements for s in specs) / 1e9, 2) == 284.33
    by_name = {s.name: s for s in specs}
    assert by_name["blk.5.ffn_gate_exps.weight"].qtype == Q.IQ2_XXS
    assert by_name["blk.5.ffn_down_exps.weight"].shape == (2048, 4096, 256)
    assert by_name["blk.5.ffn_down_exps.weight"].qtype == Q.Q2_K
    assert by_name["blk.0.ffn_gate_tid2eid.weight"].shape == (6, 129280)
    assert "blk.3.exp_probs_b.bias" in by_name and "blk.2.exp_probs_b.bias" not in by_name
    assert by_name["blk.2.attn_compressor_ape.weight"].shape == (1024, 4)
    assert by_name["blk.3.attn_compressor_ape.weight"].shape == (512, 128)
    assert "blk.3.indexer.proj.weight" not in by_name and "blk.1.attn_compressor_kv.weight" not in by_name
    # one q2 expert (gate+up+down) is 6.75 MiB
    per_expert = sum(by_name[f"blk.5.ffn_{p}_exps.weight"].n_bytes for p in ("gate", "up", "down")) / 256
    assert per_expert / 2**20 == pytest.approx(6.75)


def test_tiny_preset_keeps_the_flash_pattern() -> None:
    assert TINY.n_layers >= 6
    assert TINY.compress_ratios[:2] == (0, 0)
    assert all(TINY.ratio(i) == 4 for i in range(2, TINY.n_layers, 2))
    assert all(TINY.ratio(i) > 4 for i in range(3, TINY.n_layers, 2))
    assert TINY.n_hash_layers == 3 and TINY.hc_mult == 4
    assert 1 < TINY.n_experts_used < TINY.n_experts


def test_round_trip_config_tensors_and_tokenizer(tiny_q2: Path) -> None:
    f = GGUFFile.open(tiny_q2)
    assert f.config == TINY
    assert f.metadata["tokenizer.ggml.model"] == "gpt2"
    assert f.metadata["tokenizer.ggml.pre"] == "joyai-llm"
    assert len(f.metadata["tokenizer.ggml.tokens"]) == TINY.vocab_size
    # the same bytes as generated for the same seed
    gen = torch.Generator().manual_seed(7)
    for spec in model_tensors(TINY, "q2"):
        want = random_weight(spec, TINY, gen)
        got = tensor_view(f, spec.name)
        assert got.qtype == spec.qtype, spec.name
        assert tuple(got.shape) == spec.torch_shape
        if isinstance(want, QTensor):
            assert torch.equal(got.data, want.data), spec.name
        elif spec.qtype == Q.I32:
            assert torch.equal(got.dequantize(), want), spec.name
        else:
            assert torch.equal(got.dequantize(), want.to(torch.float16 if spec.qtype == Q.F16 else torch.float32)
                               .float()), spec.name
    types = {s.role: s.qtype for s in f.specs.values()}
    assert types["ffn_up_exps"] == Q.IQ2_XXS and types["ffn_down_exps"] == Q.Q2_K
    assert types["attn_q_b"] == Q.Q8_0 and types["ffn_gate_shexp"] == Q.Q8_0 and types["output"] == Q.Q8_0
    assert types["attn_compressor_kv"] == Q.F16 and types["attn_sinks"] == Q.F32


def test_same_seed_same_file(tmp_path: Path, tiny_q2: Path) -> None:
    again = make_model(tmp_path / "again.gguf", seed=7)
    assert again.read_bytes() == tiny_q2.read_bytes()
    other = make_model(tmp_path / "other.gguf", seed=8)
    assert other.read_bytes() != tiny_q2.read_bytes()


def test_stage_loads_only_its_layers(tiny_q2: Path) -> None:
    f = GGUFFile.open(tiny_q2)
    stage = load_tensors(f, range(2, 4), embed=False, output=False)
    assert {n.split(".")[1] for n in stage} == {"2", "3"}
    head = load_tensors(f, range(4, 6), embed=False, output=True)
    assert "output.weight" in head and "token_embd.weight" not in head
    first = load_tensors(f, range(0, 1), embed=True, output=False)
    assert "token_embd.weight" in first and "output.weight" not in first
    by_layer = f.bytes_by_layer()
    assert sum(sum(v.values()) for v in by_layer.values()) == f.total_bytes == tiny_q2.stat().st_size - _header_size(f)
    assert by_layer["blk.2"]["ffn_gate_exps"] == f.specs["blk.2.ffn_gate_exps.weight"].n_bytes


def _header_size(f: GGUFFile) -> int:
    # data section = file size minus everything before the first tensor, minus padding between tensors
    first = min(f._offsets.values())
    pad = sum(-s.n_bytes % 32 for s in f.specs.values())
    return first + pad


def test_f16_recipe_round_trips_floats(tmp_path: Path) -> None:
    path = make_model(tmp_path / "f16.gguf", seed=1, quant="f16")
    f = GGUFFile.open(path)
    assert {s.qtype for s in f.specs.values()} == {Q.F16, Q.F32, Q.I32}


def test_write_refuses_incomplete_or_misshapen(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {s.name: random_weight(s, TINY, gen) for s in model_tensors(TINY, "f32")}
    del tensors["blk.4.attn_kv.weight"]
    with pytest.raises(GGUFError, match="blk.4.attn_kv.weight"):
        write_gguf(tmp_path / "x.gguf", TINY, tensors, recipe="f32")
    assert not (tmp_path / "x.gguf").exists()


# ---- damaged files ----------------------------------------------------------------------------
def _patch_u32(path: Path, key: str, value: int) -> None:
    """Overwrite the u32 value of a metadata key in place (as a corrupted or hand-edited file would be)."""
    data = bytearray(path.read_bytes())
    k = key.encode()
    at = data.index(struct.pack("<Q", len(k)) + k) + 8 + len(k)
    assert struct.unpack_from("<I", data, at)[0] == 4  # GGUF type UINT32
    struct.pack_into("<I", data, at + 4, value)
    path.write_bytes(bytes(data))


def _copy(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes())
    return dst


def test_truncated_file_names_the_tensor(tmp_path: Path, tiny_q2: Path) -> None:
    p = _copy(tiny_q2, tmp_path / "t.gguf")
    p.write_bytes(p.read_bytes()[:-1000])
    with pytest.raises(GGUFError, match=r"tensor output\.weight .*truncated"):
        GGUFFile.open(p)


def test_bad_magic_or_garbage_header(tmp_path: Path, tiny_q2: Path) -> None:
    p = _copy(tiny_q2, tmp_path / "m.gguf")
    p.write_bytes(b"XXXX" + p.read_bytes()[4:])
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        GGUFFile.open(p)
    p.write_bytes(tiny_q2.read_bytes()[:300])
    with pytest.raises(GGUFError):
        GGUFFile.open(p)


def test_missing_tensor_is_named(tmp_path: Path, tiny_q2: Path) -> None:
    # With 2 hash layers, layer 2 must carry a selection bias the file does not have.
    p = _copy(tiny_q2, tmp_path / "h.gguf")
    _patch_u32(p, "deepseek4.hash_layer_count", 2)
    with pytest.raises(GGUFError, match=r"missing tensor\(s\) blk\.2\.exp_probs_b\.bias"):
        GGUFFile.open(p)


def test_shape_mismatch_is_named(tmp_path: Path, tiny_q2: Path) -> None:
    p = _copy(tiny_q2, tmp_path / "s.gguf")
    _patch_u32(p, "deepseek4.expert_feed_forward_length", 512)
    with pytest.raises(GGUFError, match=r"tensor blk\.0\.ffn_gate_exps\.weight has shape .* \(dimension 1 differs\)"):
        GGUFFile.open(p)


def test_missing_and_inconsistent_keys(tmp_path: Path, tiny_q2: Path) -> None:
    p = _copy(tiny_q2, tmp_path / "k.gguf")
    data = p.read_bytes().replace(b"deepseek4.attention.sliding_window", b"deepseek4.attention.sliding_windoX")
    p.write_bytes(data)
    with pytest.raises(GGUFError, match="missing required key.*deepseek4.attention.sliding_window"):
        GGUFFile.open(p)
    p = _copy(tiny_q2, tmp_path / "k2.gguf")
    _patch_u32(p, "deepseek4.attention.head_count", 3)
    with pytest.raises(GGUFError, match="not divisible by output_group_count"):
        GGUFFile.open(p)


def test_config_metadata_round_trip() -> None:
    meta = {f"deepseek4.{k}": v for k, v in FLASH.to_metadata().items()} | {"general.architecture": "deepseek4"}
    from ds4station.model.config import ModelConfig

    assert ModelConfig.from_metadata(meta) == FLASH
    assert dataclasses.replace(FLASH, window=64) != FLASH


def test_cli_make_model_and_inspect(tmp_path: Path) -> None:
    out = tmp_path / "cli.gguf"
    r = subprocess.run([sys.executable, "-m", "ds4station.cli", "make-model", "--preset", "tiny", "--out", str(out),
                        "--seed", "3"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "178 tensors" in r.stdout
    r = subprocess.run([sys.executable, "-m", "ds4station.cli", "inspect", str(out)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "blk.5" in r.stdout
    out.write_bytes(out.read_bytes()[:-10])
    r = subprocess.run([sys.executable, "-m", "ds4station.cli", "inspect", str(out)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "truncated" in r.stdout


@pytest.mark.parametrize("preset", ["tiny", "flash"])
def test_header_reader_agrees_with_gguf_py(tmp_path: Path, preset: str) -> None:
    """model/gguf.py reads the header itself (gguf-py's reader builds a view per vocabulary entry): the same
    metadata, tensor names, shapes, types and data offsets as gguf.GGUFReader, on the demo model and on a
    sparse file of the full Flash layout."""
    from gguf import GGUFReader

    from ds4station.engine.tokenizer import build_demo_vocab, tokenizer_metadata
    from ds4station.model.config import PRESETS

    cfg = PRESETS[preset]
    path = write_gguf(tmp_path / f"{preset}.gguf", cfg, None, tokenizer_meta=tokenizer_metadata(
        build_demo_vocab(cfg.vocab_size)), extra_meta={"general.name": "héllo ✓", "test.flag": True}) \
        if preset == "flash" else make_model(tmp_path / f"{preset}.gguf")
    ours = GGUFFile.open(path)
    ref = GGUFReader(path, "r")
    want = {name: f.contents() for name, f in ref.fields.items() if not name.startswith("GGUF.")}
    assert ours.metadata == want
    assert [(n, s.shape, s.qtype) for n, s in ours.specs.items()] == \
        [(t.name, tuple(int(d) for d in t.shape), t.tensor_type) for t in ref.tensors]
    assert [ours._offsets[t.name] for t in ref.tensors] == [int(t.data_offset) for t in ref.tensors]
