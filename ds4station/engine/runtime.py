"""The single-process engine the API server and `ds4station generate` drive: load a GGUF, open sessions.

`Engine.load` reads the file with gguf.py, dequantises the weights to float32 on the target device, builds
the reference `DS4Model` and the tokenizer from the file's metadata. A `Session` is one live KV state with
the token ids it holds; it extends (chunked prefill / decode) and rolls back (`truncate`) for prefix reuse.
`generate` is the plain decode loop: prompt ids in, text pieces out, with speed figures.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .config import ModelConfig
from .kv import DEFAULT_CHUNK, KVCache
from .model import DS4Model, RoundTrips
from .quants import QTensor
from .sampler import Sampler, SamplingParams, StopScanner

if TYPE_CHECKING:
    from .gpu import GpuStage
    from .tokenizer import Tokenizer


class _Progress(Mapping[str, QTensor]):
    """The file's tensors, reporting `progress(bytes handed out, total bytes)` as each one is taken."""

    def __init__(self, tensors: dict[str, QTensor], progress: Callable[[int, int], None] | None) -> None:
        self.tensors, self.progress = tensors, progress
        self.total, self.done = sum(q.nbytes for q in tensors.values()), 0

    def __getitem__(self, name: str) -> QTensor:
        q = self.tensors[name]
        self.done += q.nbytes
        if self.progress is not None:
            self.progress(self.done, self.total)
        return q

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


class Session:
    """One sequence's KV state. `tokens` are the ids already in the KV, in order."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        model = engine.model
        if isinstance(model, DS4Model):
            self.cache: KVCache = model.new_cache(engine.ctx, chunk=engine.chunk, rollback=engine.rollback,
                                                  dtype=engine.kv_dtype)
        else:  # the fast stage captures decode graphs over this cache: release them with the session
            self.cache = model.new_cache(engine.ctx, chunk=engine.chunk, rollback=engine.rollback)
            weakref.finalize(self, model.drop_graphs, self.cache)
        self.tokens: list[int] = []

    def extend(self, tokens: Sequence[int], chunk: int | None = None) -> torch.Tensor:
        """Append tokens to the KV (prefill in chunks of at most `chunk`); -> logits of the last one [vocab]."""
        if not tokens:
            raise ValueError("extend needs at least one token")
        chunk = self.cache.chunk if chunk is None else max(1, min(chunk, self.cache.chunk))
        ids = torch.as_tensor(list(tokens), dtype=torch.long, device=self.engine.model.device)
        model, logits = self.engine.model, None
        for s in range(0, ids.numel(), chunk):
            part = ids[s: s + chunk]
            if isinstance(model, DS4Model):
                logits = model.forward(part, self.cache, last_only=True)[0]
            elif part.numel() == 1:  # the fast stage: one decode step (a CUDA-graph replay on a GPU)
                logits = model.decode(int(part[0]), self.cache)
            else:
                logits = model.prefill(part, self.cache)
            self.tokens += part.tolist()
        assert logits is not None
        return logits

    def truncate(self, n: int) -> bool:
        """Keep only the first n tokens; False (state unchanged) when the KV cannot roll back that far."""
        if not self.cache.truncate(n):
            return False
        del self.tokens[n:]
        return True

    def kv_bytes(self) -> int:
        return self.cache.nbytes()


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    finish_reason: str = ""

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0


class Engine:
    def __init__(self, model: DS4Model | GpuStage, tokenizer: Tokenizer, ctx: int, *, chunk: int = DEFAULT_CHUNK,
                 rollback: int = 0, kv_dtype: torch.dtype = torch.float32) -> None:
        self.model, self.tokenizer, self.cfg = model, tokenizer, model.cfg
        self.ctx, self.chunk, self.rollback, self.kv_dtype = ctx, chunk, rollback, kv_dtype

    @classmethod
    def load(cls, path: str | os.PathLike[str], ctx: int = 4096, device: str | torch.device = "cpu", *,
             chunk: int = DEFAULT_CHUNK, rollback: int = 0, round_trips: RoundTrips = RoundTrips(),
             progress: Callable[[int, int], None] | None = None, fast: bool | None = None) -> Engine:
        """Load a GGUF; `progress(loaded_bytes, total_bytes)` is called as tensors are read (for /status).

        `fast` (default: on a GPU) runs the kernel stage (engine/gpu.py: weights stay quantised, decode is a
        CUDA graph); otherwise the fp32 reference model with dequantised weights."""
        from .gguf import GGUFFile
        from .tokenizer import Tokenizer

        gf = GGUFFile.open(path)
        cfg: ModelConfig = gf.config
        if ctx > cfg.context_length:
            raise ValueError(f"--ctx {ctx} exceeds the model's context length {cfg.context_length}")
        tensors = _Progress(gf.load(), progress)
        tokenizer = Tokenizer.from_metadata(gf.metadata)
        if torch.device(device).type == "cuda" if fast is None else fast:
            from .gpu import GpuStage

            stage = GpuStage(cfg, tensors, device=device, round_trips=round_trips)  # repacks each tensor once
            return cls(stage, tokenizer, ctx, chunk=chunk, rollback=rollback)
        weights = {name: tensors[name].dequantize().to(device) for name in tensors}
        return cls(DS4Model(cfg, weights, round_trips=round_trips), tokenizer, ctx, chunk=chunk, rollback=rollback)

    def new_session(self) -> Session:
        return Session(self)

    def generate(self, prompt: Sequence[int], params: SamplingParams, session: Session | None = None,
                 stats: GenerationStats | None = None) -> Iterator[str]:
        """Prefill `prompt` into a fresh session (or `session`), then decode; yields text pieces. Stops at
        EOS, a stop string (not yielded) or max_tokens; `stats` is filled in as it goes."""
        stats = GenerationStats() if stats is None else stats
        session = self.new_session() if session is None else session
        room = self.ctx - len(session.tokens) - len(prompt)
        if room <= 0:
            raise ValueError(f"the prompt ({len(prompt)} tokens) does not fit in --ctx {self.ctx}")
        sampler, scanner = Sampler(params), StopScanner(params.stop)
        decoder = self.tokenizer.stream_decoder()
        t0 = time.perf_counter()
        logits = session.extend(prompt)
        stats.prompt_tokens, stats.prompt_seconds = len(prompt), time.perf_counter() - t0
        t0 = time.perf_counter()
        stats.finish_reason = "length"
        for i in range(min(params.max_tokens, room)):
            token = sampler(logits)
            stats.generated_tokens += 1
            if token == self.cfg.eos_id:
                stats.finish_reason = "stop"
                break
            text = scanner.feed(decoder.push(token))
            if text:
                yield text
            if scanner.stopped:
                stats.finish_reason = "stop"
                break
            if i + 1 < min(params.max_tokens, room):
                logits = session.extend([token])
        stats.decode_seconds = time.perf_counter() - t0
        if not scanner.stopped:
            tail = scanner.feed(decoder.flush()) + scanner.flush()
            if tail:
                yield tail
