"""`ds4station bench draft`: speculative decoding measured on one engine, against issue 21's targets.

On one session after a random prompt:
1. plain greedy decode, one token per step: the baseline step time, and the tokens it produces (the oracle);
2. for each k, a verification of a token and k drafts (`Session.verify`, k + 1 positions in one forward)
   timed alone and set against the decode step (targets: 1.15x / 1.25x / 1.35x at k + 1 = 2 / 3 / 4);
3. the verifier's own greedy output: draft-and-verify decode with plain decoding's tokens as drafts, taking the
   verification's token wherever it disagrees (on a GPU its k + 1-row matmuls round otherwise than the one-row
   decode step, and a random model's near-ties then resolve otherwise), then decode with that output as the
   oracle's drafts (always right): tokens/s against plain (target: 2x at k = 3);
4. with the MTP layer (`--mtp FILE`, or the model file's own), decode with its drafts: the draft's time, the
   share of drafted tokens accepted, tokens per verification and tokens/s against plain, beside the
   break-even acceptance: the per-draft acceptance at which drafting k tokens this way is as fast as plain
   decoding (with per-token acceptance a the step gives 1 + a + a^2 + ... + a^k tokens on average).
The table reports how many of the verifier's tokens equal plain decoding's (all of them on a CPU, where both
paths compute alike); the oracle's and the MTP's runs must give the verifier's tokens (a run stops where one does
not, and the table says where). Times are wall-clock medians with the device synchronised, as a user's step
sees them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .engine import Engine, Session
from .kvdisk import common_prefix


def break_even_acceptance(cost: float, k: int) -> float | None:
    """The per-draft acceptance a at which 1 + a + ... + a^k (tokens per step) equals `cost` (the step's time
    over a plain decode step's): 0 when the step costs no more than a decode step, None when even always-right
    drafts (k + 1 tokens) do not pay."""
    if cost <= 1.0:
        return 0.0
    if cost >= k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if sum(a ** i for i in range(k + 1)) < cost:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


@dataclass
class DraftRow:
    k: int
    verify_ms: float
    oracle_tps: float
    oracle_same: int  # tokens of the oracle run equal to the verifier's before the first difference
    greedy_plain: int = 0  # tokens of the verifier's greedy output equal to plain decoding's before the first
    mtp_draft_ms: float | None = None
    mtp_accepted: float | None = None  # accepted / drafted
    mtp_per_verify: float | None = None  # tokens per verification
    mtp_tps: float | None = None
    mtp_same: int | None = None


@dataclass
class DraftBench:
    model: str
    device: str
    mtp: str
    prompt: int
    tokens: int
    decode_ms: float
    rows: list[DraftRow] = field(default_factory=list)

    @property
    def plain_tps(self) -> float:
        return 1000.0 / self.decode_ms

    def table(self) -> str:
        lines = [f"ds4station bench draft: {self.model} on {self.device}; MTP layer: {self.mtp or 'none'}; "
                 f"prompt {self.prompt}, {self.tokens} tokens per run",
                 f"plain decode: {self.decode_ms:.2f} ms per token = {self.plain_tps:.1f} tok/s", "",
                 "| k | verify k+1 ms | x decode | target | verifier = plain | oracle tok/s | x plain | MTP draft ms "
                 "| MTP accepted | tok/verify | MTP tok/s | x plain | break-even acceptance |",
                 "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        targets = {1: "1.15", 2: "1.25", 3: "1.35"}
        for r in self.rows:
            x = r.verify_ms / self.decode_ms
            cost = (r.verify_ms + (r.mtp_draft_ms or 0.0)) / self.decode_ms
            be = break_even_acceptance(cost, r.k)
            mtp = ["-"] * 5
            if r.mtp_tps is not None:
                mtp = [f"{r.mtp_draft_ms:.2f}", f"{100 * r.mtp_accepted:.1f}%", f"{r.mtp_per_verify:.2f}",
                       f"{r.mtp_tps:.1f}", f"{r.mtp_tps / self.plain_tps:.2f}"]
            lines.append(f"| {r.k} | {r.verify_ms:.2f} | {x:.2f} | {targets.get(r.k, '-')} | "
                         f"{r.greedy_plain}/{self.tokens} | {r.oracle_tps:.1f} | {r.oracle_tps / self.plain_tps:.2f} | "
                         + " | ".join(mtp) + f" | {'never' if be is None else f'{100 * be:.1f}%'} |")
        for r in self.rows:
            for what, same in (("oracle", r.oracle_same), ("MTP", r.mtp_same)):
                if same is not None and same < self.tokens:
                    lines.append(f"k = {r.k}, {what} drafts: token {same} differed from the verifier's greedy "
                                 "output (the verification of a token depends on the rows beside it); the run's "
                                 "rates are over the tokens before it")
        return "\n".join(lines)


def _argmax(logits: torch.Tensor) -> int:
    return int(logits.argmax())  # reads the device: the step is done


@dataclass
class _Run:
    seconds: float
    produced: int  # tokens out, all equal to plain decoding's (the run stops where one is not)
    steps: int  # verifications
    drafted: int
    accepted: int
    draft_ms: float  # median time of one call for drafts


def _drafted_run(s: Session, base: int, first: int, k: int, n: int, drafts: Callable[[int, int], list[int]],
                 ref: list[int] | None = None, out: list[int] | None = None) -> _Run:
    """Draft-and-verify decode of up to n tokens after `base` positions (`first`, then drafts(pos, token) after
    each); with `ref`, stopping where the output leaves it; `out` collects the tokens. The session is cut back
    to `base` after."""
    pos = steps = drafted = accepted = 0
    draft_s: list[float] = []
    tok = first
    produced = [] if out is None else out
    t0 = time.perf_counter()
    while pos < n:
        t = time.perf_counter()
        d = drafts(pos, tok)[:max(0, min(k, n - pos - 1))]
        draft_s.append(time.perf_counter() - t)
        rows = s.verify([tok, *d])
        a = 0
        while a < len(d) and _argmax(rows[a]) == d[a]:
            a += 1
        nxt = _argmax(rows[a])
        if a < len(d) and not s.truncate(base + pos + 1 + a):
            raise RuntimeError("the session could not drop the rejected drafts")
        steps, drafted, accepted = steps + 1, drafted + len(d), accepted + a
        got = [tok, *d[:a]]
        differs = None if ref is None else next((i for i, t in enumerate(got) if t != ref[pos + i]), None)
        if differs is not None:  # left the reference: the run ends there
            pos += differs
            produced += got[:differs]
            break
        pos += len(got)
        produced += got
        tok = nxt
    seconds = time.perf_counter() - t0
    if not s.truncate(base) and s.rewind(base) != base:
        raise RuntimeError("the session could not go back to the prompt")
    return _Run(seconds, pos, steps, drafted, accepted, 1000 * statistics.median(draft_s))


def run(model: str, *, mtp: str | None = None, ks: Sequence[int] = (1, 2, 3), prompt: int = 512, tokens: int = 64,
        device: str = "auto", ctx: int | None = None, seed: int = 7,
        log: Callable[[str], None] = print) -> DraftBench:
    """Load `model` on one stage (with the MTP layer when `mtp` names it: a path, or "model" for the file's own)
    and measure; see the module docstring."""
    from .stage import MTP_IN_MODEL

    if not ks or min(ks) < 1 or prompt < 2 or tokens < 2:
        raise ValueError("bench draft needs k >= 1, a prompt of at least 2 tokens and at least 2 tokens per run")
    ctx = ctx or prompt + tokens + max(ks) + 64
    t0 = time.monotonic()
    engine = Engine.load(model, ctx, device=device, sessions=1, verify_rows=max(ks) + 1,
                         mtp=mtp if mtp else None)
    log(f"loaded in {time.monotonic() - t0:.1f} s")
    try:
        cuda = engine.device.type == "cuda"

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize(engine.device)

        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(2, engine.cfg.vocab_size, (prompt,), generator=gen).tolist()
        s = engine.new_session()
        tok = _argmax(s.extend(ids))
        s.checkpoint()
        # plain greedy decode: the baseline and the oracle's tokens
        plain, step_s = [], []
        for _ in range(tokens + max(ks) + 1):
            sync()
            t = time.perf_counter()
            nxt = _argmax(s.extend([tok]))
            step_s.append(time.perf_counter() - t)
            plain.append(tok)
            tok = nxt
        warm = min(4, len(step_s) // 4)
        decode_ms = 1000 * statistics.median(step_s[warm:])
        if s.rewind(prompt) != prompt:
            raise RuntimeError("the session could not go back to the prompt")
        res = DraftBench(str(model), str(engine.device), "" if not mtp else "the model file" if mtp == MTP_IN_MODEL
                         else str(mtp), prompt, tokens, decode_ms)
        for k in ks:
            verify_s = []
            for _ in range(max(8, tokens // 4)):
                sync()
                t = time.perf_counter()
                _argmax(s.verify(plain[:k + 1])[-1])
                verify_s.append(time.perf_counter() - t)
                if not s.truncate(prompt):
                    raise RuntimeError("the session could not drop a verification")
            row = DraftRow(k, 1000 * statistics.median(verify_s[2:]), 0.0, 0)
            # the verifier's greedy output (plain decoding's tokens as drafts while they hold), then the oracle
            spec: list[int] = []
            _drafted_run(s, prompt, plain[0], k, tokens + k + 1, lambda pos, _t, k=k: plain[pos + 1:pos + 1 + k],
                         out=spec)
            row.greedy_plain = min(common_prefix(spec, plain), tokens)
            o = _drafted_run(s, prompt, spec[0], k, tokens,
                             lambda pos, _t, k=k, spec=spec: spec[pos + 1:pos + 1 + k], ref=spec)
            row.oracle_tps, row.oracle_same = o.produced / o.seconds, o.produced
            if engine.has_mtp:
                m = _drafted_run(s, prompt, spec[0], k, tokens, lambda _pos, t, k=k: s.draft(t, k), ref=spec)
                row.mtp_draft_ms, row.mtp_same = m.draft_ms, m.produced
                row.mtp_accepted = m.accepted / m.drafted if m.drafted else 0.0
                row.mtp_per_verify = m.produced / m.steps
                row.mtp_tps = m.produced / m.seconds
            res.rows.append(row)
            log(res.table().splitlines()[-1])
        return res
    finally:
        engine.close()
