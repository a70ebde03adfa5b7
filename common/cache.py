"""Where mxspd keeps what it may rebuild: converted GGUF checkpoints, benchmark checkpoints and
artifacts, and what it learned about this machine (common/weights_map.py)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$MXSPD_CACHE, else $XDG_CACHE_HOME/mxspd, else ~/.cache/mxspd."""
    if "MXSPD_CACHE" in os.environ:
        return Path(os.environ["MXSPD_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mxspd"
