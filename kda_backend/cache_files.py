"""Files in the cache folder that several processes share (plans, compiled kernels): every TP rank of a serve, and
the users of one machine, read and write them.

A writer fills a temp file beside the target and renames it over the target (:func:`publish`), so no reader sees
a torn file; the file is made readable by everyone first (``mkstemp`` creates it for its owner only, and a cache a
warm-up job filled must serve the serving user). Temp files of writers killed mid-write are removed by later
writers once they are older than :data:`STALE_TMP_S` (:func:`remove_stale_temps`).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

STALE_TMP_S = 60.0  # a write takes milliseconds; an older temp file's writer is gone
FILE_MODE = 0o644  # everyone reads; the writer alone writes (a rename replaces the file whoever owns it)


def publish(tmp: str | Path, path: Path) -> None:
    """Make the written temp file ``tmp`` readable by everyone, then rename it to ``path`` atomically."""
    os.chmod(tmp, FILE_MODE)
    os.replace(tmp, path)


def remove_stale_temps(folder: Path, pattern: str) -> None:
    """Delete the files of ``folder`` matching ``pattern`` older than :data:`STALE_TMP_S`."""
    now = time.time()
    for tmp in folder.glob(pattern):
        with contextlib.suppress(FileNotFoundError):  # another writer removed it first
            if now - tmp.stat().st_mtime > STALE_TMP_S:
                tmp.unlink()
