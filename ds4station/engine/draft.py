"""Draft sources for speculative decoding (serve --draft): tokens guessed ahead, which one forward over them
verifies (engine `Session.verify`) and the sampler accepts or rejects (`Sampler.verify`), so the output is
exactly what plain decoding gives (greedy) or distributed exactly as it (sampled).

- `LookupDrafter` (--draft lookup): prompt lookup. The sequence so far (the prompt and what was generated)
  is indexed by its n-grams (n = 1..`ngram`); the draft is what followed the most recent earlier occurrence
  of the longest suffix that occurred before. Coding agents rewrite code that is in their prompt, where these
  drafts run long; elsewhere they are short or absent and cost nothing. Indexing is incremental: O(ngram)
  dictionary updates per token, O(ngram) lookups per draft; a request indexes the last LOOKUP_CONTEXT tokens
  of its prompt, so a long prompt does not hold the other running requests while it is indexed.
- `MtpDrafter` (--draft mtp): the model's MTP layer, through the engine session (`Session.draft`, engine/mtp.py):
  its greedy guesses after the token about to be fed.
"""

from __future__ import annotations

from collections.abc import Sequence

DRAFT_SOURCES = ("off", "lookup", "mtp")
DEFAULT_DRAFT_TOKENS = 4
MAX_DRAFT_TOKENS = 16
DEFAULT_NGRAM = 3
LOOKUP_CONTEXT = 32768  # prompt tokens a request's drafter indexes (the last ones: ~10 ms of indexing)


class LookupDrafter:
    """Prompt-lookup drafts over one growing token sequence."""

    def __init__(self, ngram: int = DEFAULT_NGRAM) -> None:
        if ngram < 1:
            raise ValueError("the lookup n-gram must be at least 1 token")
        self.ngram = ngram
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> where its most recent indexed occurrence ends

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the sequence. An n-gram is indexed once a token follows it (a draft needs a
        continuation), so the current suffix is never its own match."""
        for t in tokens:
            end = len(self.tokens) - 1  # the n-grams ending here get their continuation now
            for n in range(1, self.ngram + 1):
                if end - n + 1 < 0:
                    break
                self._last[tuple(self.tokens[end - n + 1:end + 1])] = end
            self.tokens.append(int(t))

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
        for n in range(min(self.ngram, len(self.tokens)), 0, -1):
            end = self._last.get(tuple(self.tokens[-n:]))
            if end is not None:
                return self.tokens[end + 1:end + 1 + k]
        return []


class MtpDrafter:
    """MTP-layer drafts of one request: what the engine session's MTP layer guesses after the last token the
    request accepted (the one about to be fed)."""

    def __init__(self, session) -> None:  # noqa: ANN001 (an engine Session)
        self.session = session
        self.last: int | None = None

    def extend(self, tokens: Sequence[int]) -> None:
        if tokens:
            self.last = int(tokens[-1])

    def propose(self, k: int) -> list[int]:
        return self.propose_together([self], [k])[0]

    @staticmethod
    def propose_together(drafters: Sequence[MtpDrafter], ks: Sequence[int]) -> list[list[int]]:
        """Each drafter's proposal of up to ks[i] tokens, from one step of the MTP layer for all of them (their
        sessions are one engine's: `Engine.draft_batch`)."""
        live = [i for i, d in enumerate(drafters) if d.last is not None and ks[i] > 0]
        out: list[list[int]] = [[] for _ in drafters]
        if live:
            got = drafters[live[0]].session.engine.draft_batch(
                [drafters[i].session for i in live], [drafters[i].last for i in live], [ks[i] for i in live])
            for i, d in zip(live, got, strict=True):
                out[i] = d
        return out
