"""`ds4station bench` (model): decode and prefill speed of one GPU stage at the real shape, measured as
../shared/BENCHMARKS.md asks: warm-up, CUDA-event timing, medians, a copy bandwidth measured in the same
run, bytes of weights per decoded token, peak memory, and a hash of the greedy tokens.

The full DeepSeek-V4-Flash shape is built with random valid quantised weights directly in GPU memory
(`--random-shape flash-q2`), so no 81 GiB download is needed; a real GGUF works the same way.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ds4station.model.config import FLASH, TINY, ModelConfig
from ds4station.model.layout import TensorSpec, model_tensors

SHAPES: dict[str, tuple[ModelConfig, str]] = {"flash-q2": (FLASH, "q2"), "tiny-q2": (TINY, "q2")}


def decode_bytes_per_token(cfg: ModelConfig, specs: Sequence[TensorSpec]) -> int:
    """Weight bytes one decoded token reads: every dense tensor, the used share of the routed experts, one
    embedding row and one hash-table row are negligible and left out."""
    total = 0.0
    for s in specs:
        if s.role in ("token_embd", "ffn_gate_tid2eid"):
            continue
        total += s.n_bytes * (cfg.n_experts_used / cfg.n_experts if s.is_routed_expert else 1.0)
    return int(total)


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, GB/s counting bytes read + written (median of several timed copies)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    times = _time_cuda(lambda: dst.copy_(src), repeat=10)
    return 2 * nbytes / statistics.median(times) / 1e9


def _time_cuda(fn: Callable[[], object], repeat: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


@dataclass
class BenchResult:
    shape: str
    device: str
    build_s: float
    copy_gbs: float
    bytes_per_token: int
    decode: dict[int, float] = field(default_factory=dict)  # prompt tokens -> decode tok/s (median)
    prefill: dict[int, float] = field(default_factory=dict)  # prompt tokens -> prefill tok/s
    peak_bytes: int = 0
    predicted_bytes: int = 0
    weights_bytes: int = 0
    output_hash: str = ""

    def table(self) -> str:
        lines = [f"ds4station bench: {self.shape} on {self.device} (built in {self.build_s:.1f} s)",
                 f"copy bandwidth {self.copy_gbs:,.0f} GB/s; weights read per decoded token "
                 f"{self.bytes_per_token / 1e9:.2f} GB",
                 "", f"{'what':24} {'tok/s':>10} {'GB/s':>9} {'% copy':>7}"]
        for n, tps in self.decode.items():
            gbs = tps * self.bytes_per_token / 1e9
            lines.append(f"{f'decode after {n} tokens':24} {tps:10.1f} {gbs:9.0f} {100 * gbs / self.copy_gbs:6.1f}%")
        for n, tps in self.prefill.items():
            lines.append(f"{f'prefill {n} tokens':24} {tps:10.1f}")
        lines += ["", f"peak memory (allocator) {self.peak_bytes / 2**30:.2f} GiB, planner predicted "
                      f"{self.predicted_bytes / 2**30:.2f} GiB without the runtime overhead "
                      f"(weights {self.weights_bytes / 2**30:.2f} GiB)",
                  f"greedy output hash {self.output_hash} (the decode after an empty prompt)" if self.output_hash
                  else "greedy output hash: not taken (it is the decode after an empty prompt: add 0 to --prompts)"]
        return "\n".join(lines)


def run(shape: str = "flash-q2", model: str | None = None, device: str = "cuda",
        prompts: Sequence[int] = (0, 8192, 32768), prefills: Sequence[int] = (2048, 8192, 32768),
        decode_tokens: int = 64, runs: int = 3, chunk: int = 2048,
        seed: int = 0, log: Callable[[str], None] = print) -> BenchResult:
    from .gpu import GpuStage, RandomWeights

    dev = torch.device(device)
    if dev.type != "cuda":
        raise RuntimeError("ds4station bench measures a GPU; no CUDA/ROCm device is available here")
    torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    if model:
        from ds4station.engine.weights import load_tensors
        from ds4station.model.gguf import GGUFFile

        f = GGUFFile.open(model)
        cfg, specs, name = f.config, list(f.specs.values()), str(model)
        weights = load_tensors(f)
    else:
        cfg, recipe = SHAPES[shape]
        specs, name = model_tensors(cfg, recipe), shape
        weights = RandomWeights(cfg, recipe, device=dev, seed=seed)
    stage = GpuStage(cfg, weights, device=dev)
    del weights
    torch.cuda.synchronize(dev)
    res = BenchResult(name, torch.cuda.get_device_name(dev), time.perf_counter() - t0, copy_bandwidth(dev),
                      decode_bytes_per_token(cfg, specs), weights_bytes=sum(s.n_bytes for s in specs))
    log(f"built {name} in {res.build_s:.1f} s; copy {res.copy_gbs:,.0f} GB/s")
    gen = torch.Generator().manual_seed(seed)
    longest = max([*prompts, *prefills])
    ctx = longest + runs * decode_tokens + 16

    for n in sorted(set(prefills)):
        tokens = torch.randint(2, cfg.vocab_size, (n,), generator=gen)
        # warm-up: the whole prompt once, in a cache of its own, so that every kernel variant the timed run meets
        # is compiled before the clock starts (the context-dependent tiles change at powers of two of the
        # position, so a first chunk alone leaves the later chunks' compiles in the timed run; serve compiles
        # them all before it is ready: stage.warm)
        warm = stage.new_cache(ctx, chunk=chunk)
        stage.prefill(tokens, warm, logits=True)
        stage.drop_graphs(warm)
        del warm
        cache = stage.new_cache(ctx, chunk=chunk)
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        stage.prefill(tokens, cache, logits=True)
        torch.cuda.synchronize(dev)
        res.prefill[n] = n / (time.perf_counter() - t)
        log(f"prefill {n}: {res.prefill[n]:.1f} tok/s")
        if n in prompts:
            res.decode[n] = _decode_rate(stage, cache, decode_tokens, runs)
            log(f"decode after {n}: {res.decode[n]:.1f} tok/s")
        stage.drop_graphs(cache)
        del cache
    for n in sorted(set(prompts) - set(prefills)):
        cache = stage.new_cache(ctx, chunk=chunk)
        if n:
            stage.prefill(torch.randint(2, cfg.vocab_size, (n,), generator=gen), cache, logits=True)
        toks: list[int] = []
        res.decode[n] = _decode_rate(stage, cache, decode_tokens, runs, toks)
        if n == 0:
            res.output_hash = hashlib.sha256(str(toks).encode()).hexdigest()[:16]
        log(f"decode after {n}: {res.decode[n]:.1f} tok/s")
        stage.drop_graphs(cache)
    res.decode = dict(sorted(res.decode.items()))
    res.peak_bytes = torch.cuda.max_memory_allocated(dev)
    res.predicted_bytes = planner_prediction(cfg, specs, ctx, chunk, name)
    return res


def planner_prediction(cfg: ModelConfig, specs: Sequence[TensorSpec], ctx: int, chunk: int, name: str) -> int:
    """What the planner predicts for this one-stage configuration, less the per-process runtime overhead
    (the CUDA context), which torch's allocator peak does not count."""
    from ds4station.model.footprint import FootprintSettings, shape_from_specs, stage_footprint

    fp = stage_footprint(shape_from_specs(name, cfg, specs), range(cfg.n_layers), ctx,
                         FootprintSettings(prefill_chunk=chunk), embed=True, output=True)
    return fp.predicted_bytes - fp.overhead_bytes


def _decode_rate(stage, cache, n_tokens: int, runs: int, out: list[int] | None = None) -> float:
    """Greedy decode: the median over `runs` runs of n_tokens each, after one warm-up step (graph capture)."""
    token = stage.cfg.bos_id
    token = int(stage.decode(token, cache, logits=True).argmax())
    rates = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n_tokens):
            token = int(stage.decode(token, cache, logits=True).argmax())  # the host needs the token, as a server does
            if out is not None:
                out.append(token)
        rates.append(n_tokens / (time.perf_counter() - t))
    return statistics.median(rates)
