"""Files in the cache folder that several processes share (plans, compiled kernels): every TP rank of a serve, and
the users of one machine, read and write them.

A writer fills a temp file beside the target and renames it over the target (:func:`publish`), so no reader sees
a torn file; the file is made readable by everyone first (``mkstemp`` creates it for its owner only, and a cache a
warm-up job filled must serve the serving user). Temp files of writers killed mid-write are removed by later
writers once they are older than :data:`STALE_TMP_S` (:func:`remove_stale_temps`). Files that belong to one version
of the code (compiled kernels) live in a folder per version, marked at the first use of each process that may write
it (:func:`mark_used`); a version no process marked for :data:`UNUSED_VERSION_S` is removed
(:func:`remove_unused_versions`), so upgrades do not fill the disk.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import re
import stat
import time
from pathlib import Path

from kda_backend.log import warn_once

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


UNUSED_VERSION_S = 30 * 24 * 3600.0  # a code version's files that no process marked used for 30 days are removed


def mark_used(folder: Path) -> None:
    """Create ``folder`` if needed (with its parent's permission bits, so a cache folder an administrator made
    group-writable stays so) and set its modification time to now: the mark of use that
    :func:`remove_unused_versions` reads (writing a file into it marks it too). Only a process that may write the
    folder marks it: one that only reads a cache another user filled leaves the mark its writers left."""
    with contextlib.suppress(OSError):
        try:
            folder.mkdir()
            os.chmod(folder, stat.S_IMODE(folder.parent.stat().st_mode))
        except FileNotFoundError:  # no parent yet: made as this process makes folders
            folder.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            pass
        os.utime(folder)


def remove_unused_versions(parent: Path, current: str, version_name: str, patterns: tuple[str, ...]) -> None:
    """Remove, from ``parent``, the folders of code versions other than ``current`` (names matching the regular
    expression ``version_name``) that no process marked used for :data:`UNUSED_VERSION_S`, and files matching
    ``patterns`` lying directly in ``parent`` (outside any version folder) as old.

    Only files matching ``patterns`` are deleted, then the folder emptied of them. A folder this process may not
    write (a cache another user filled, or another user's version) is left alone, without a word. Where a removal
    fails otherwise (a folder that holds anything else) the rest stays, with one warning, and serving goes on: the
    files cost only disk.
    """
    if not os.access(parent, os.W_OK):
        return
    cutoff = time.time() - UNUSED_VERSION_S
    failures = []
    with contextlib.suppress(OSError), os.scandir(parent) as entries:  # OSError: parent removed meanwhile
        for entry in entries:
            try:
                _remove_if_unused(entry, current, version_name, patterns, cutoff)
            except OSError as exc:
                failures.append(f"{entry.path}: {exc}")
    if failures:
        warn_once(f"remove-unused:{parent}", f"cannot remove files of code versions unused for "
                  f"{UNUSED_VERSION_S / 86400:.0f} days: {'; '.join(failures)}; remove them by hand")


def _remove_if_unused(entry: os.DirEntry, current: str, version_name: str, patterns: tuple[str, ...],
                      cutoff: float) -> None:
    if not entry.is_dir(follow_symlinks=False):
        if _matches(entry.name, patterns) and _older(entry, cutoff):
            Path(entry.path).unlink(missing_ok=True)
        return
    if (entry.name == current or not re.fullmatch(version_name, entry.name) or not _older(entry, cutoff)
            or not os.access(entry.path, os.W_OK)):
        return
    folder = Path(entry.path)
    for path in [path for path in folder.iterdir() if _matches(path.name, patterns)]:
        path.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except FileNotFoundError:  # every rank of a serve starting at once: another removed it
        pass
    except OSError as exc:
        if exc.errno != errno.ENOTEMPTY or not all(_matches(name, patterns) for name in os.listdir(folder)):
            raise
        # A process of that version stored a kernel into it meanwhile: in use again.


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)


def _older(entry: os.DirEntry, cutoff: float) -> bool:
    """Whether ``entry`` was last modified before ``cutoff`` (no: another process removed it first)."""
    try:
        return entry.stat(follow_symlinks=False).st_mtime < cutoff
    except FileNotFoundError:
        return False
