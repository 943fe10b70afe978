"""Where ds4station keeps what it makes for the user: the demo model, the control panel's launch files."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/ds4station (default ~/.cache/ds4station)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "ds4station"
