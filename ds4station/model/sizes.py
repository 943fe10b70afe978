"""Sizes as people write them: bytes (`16GiB`, `1.5 GiB`, `512M`, `2e9`) and token counts (`32K`, `1M`).

Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal units (KB, MB, GB, TB) powers of 1000. A bare
`G`/`M`/`K` means the binary unit, as in `--gpus 16G`, because memory sizes are binary in practice. Token
counts take K (1024) and M (1,048,576): `--ctx 1M` is the model's whole 1,048,576-token context. Every flag
that takes either goes through these parsers.
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*$")

GiB = 1 << 30
MiB = 1 << 20


def parse_size(text: str | int | float) -> int:
    """`16GiB` -> 17179869184. Raises ValueError naming the accepted forms."""
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, (int, float)):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return int(text)
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (write e.g. 16GiB, 1.5GiB, 512MiB or a byte count)")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: int) -> str:
    """Exact when it can be (`2GiB`, `1536MiB`), else two decimals of the largest unit that fits."""
    if n < 0:
        return "-" + format_size(-n)
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n}B"


def gib(n: int) -> str:
    """Human form for tables: always GiB with two decimals."""
    return f"{n / GiB:.2f} GiB"


_TOKENS = re.compile(r"^\s*([0-9]+)\s*([kKmM]?)\s*$")


def parse_tokens(text: str | int) -> int:
    """`32768`, `32K` (= 32768), `1M` (= 1048576) -> a token count. Raises ValueError naming the forms."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a token count must be >= 0, got {text}")
        return text
    m = _TOKENS.match(str(text))
    if not m:
        raise ValueError(f"not a token count: {text!r} (write e.g. 32768, 32K or 1M)")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1 << 20}[m.group(2).lower()]


def token_count(text: str) -> int:
    """argparse `type=` for flags that take a token count (`--ctx 32K`)."""
    import argparse

    try:
        return parse_tokens(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
