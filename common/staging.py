"""Where an export may write, and the hidden staging folders it writes in first.

An artifact is built in hidden sibling folders of `--out` and renamed into place at the end. Each
staging folder carries a marker naming the process that owns it, so a later export can tell a
folder left by a killed run (ours, owner dead) from a user's folder or a run still in progress,
and remove only the former. The output folder itself is replaced only if it is empty or one of our
artifacts; anything else of the user's is refused, never deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

from common.manifest import MANIFEST_NAME

MARKER = ".mxspd-staging"
STAGING_KINDS = ("export", "partial", "old")


class OutputExistsError(ValueError):
    """`--out` names something that is not ours to replace."""


def make_staging(out_dir: Path, kind: str) -> Path:
    """A new hidden folder `.NAME.KIND-XXXX` beside out_dir, marked as this process's."""
    assert kind in STAGING_KINDS, kind
    folder = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.{kind}-", dir=out_dir.parent))
    folder.chmod(0o755)
    (folder / MARKER).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    return folder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_stale(folder: Path) -> bool:
    """Ours (marker written by this toolkit on this host) and its owner process is gone."""
    try:
        owner = json.loads((folder / MARKER).read_text())
        pid, host = int(owner["pid"]), str(owner["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return False  # no readable marker: not recognisably ours, leave it alone
    return host == socket.gethostname() and pid != os.getpid() and not _alive(pid)


def clean_stale(out_dir: Path) -> list[Path]:
    """Remove staging folders for out_dir left by killed exports; returns what was removed. A kill
    between moving the old artifact aside and moving the new one in left --out missing: the old
    artifact is put back first."""
    out_dir = Path(out_dir)
    if not out_dir.parent.is_dir():
        return []
    removed = []
    for kind in STAGING_KINDS:
        for folder in sorted(out_dir.parent.glob(f".{out_dir.name}.{kind}-*")):
            if folder.is_dir() and not folder.is_symlink() and _is_stale(folder):
                previous = folder / out_dir.name
                if kind == "old" and not out_dir.exists() and _is_artifact(previous):
                    os.replace(previous, out_dir)  # killed mid-swap: the old artifact is the good one
                shutil.rmtree(folder)
                removed.append(folder)
    return removed


def _is_artifact(folder: Path) -> bool:
    """A folder holding our manifest and only the files it lists (nothing a user added)."""
    try:
        data = json.loads((folder / MANIFEST_NAME).read_text())
        listed = set(data["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not isinstance(data.get("models"), dict) or "format_version" not in data:
        return False
    present = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    return present - {MANIFEST_NAME, MARKER} <= listed


def check_output(out_dir: Path, force: bool = False) -> None:
    """Refuse an output path whose replacement would destroy something that is not ours."""
    out_dir = Path(out_dir)
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise OutputExistsError(f"--out {out_dir} exists and is not a folder; choose another path")
    if not out_dir.exists() or force or not any(out_dir.iterdir()) or _is_artifact(out_dir):
        return
    raise OutputExistsError(
        f"--out {out_dir} is a non-empty folder that is not a compiled artifact of ours (or holds files "
        "its manifest does not list); nothing was changed. Choose another --out, or pass --force to "
        "replace the folder and everything in it"
    )
