"""Where mxspd keeps what it may rebuild: benchmark checkpoints and artifacts, and what it learned about
this machine (common/weights_map.py)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$MXSPD_CACHE, else ~/.cache/mxspd."""
    return Path(os.environ.get("MXSPD_CACHE", Path.home() / ".cache" / "mxspd"))
