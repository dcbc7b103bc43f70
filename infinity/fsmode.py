"""Directories created with explicit modes, whatever the process umask.

``os.makedirs(p, mode)`` applies the umask to ``mode`` (and to every parent it
creates), so under ``umask 000`` a plain ``os.makedirs`` leaves world-writable
directories. Every directory infinity creates goes through :func:`makedirs`:
output directories (models, exports, profiles) 0755, private ones (swap,
checkpoints) 0700. Directories that already exist are left as they are.
"""
from __future__ import annotations

import os

__all__ = ["makedirs", "existing_ancestor", "PUBLIC_DIR_MODE", "PRIVATE_DIR_MODE"]

PUBLIC_DIR_MODE = 0o755
PRIVATE_DIR_MODE = 0o700


def makedirs(path, mode: int = PUBLIC_DIR_MODE, *, parents_mode: int | None = None) -> list[str]:
    """``mkdir -p`` where each directory created gets exactly ``mode`` (the leaf) or
    ``parents_mode`` (missing parents; default: ``mode``), chmod'ed after creation so the
    umask cannot widen or narrow it. Raises OSError (with the path) like ``os.makedirs``.
    Returns the directories this call created, outermost first."""
    path = os.path.abspath(os.fspath(path))
    missing = []
    p = path
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    created = []
    for d in reversed(missing):
        m = mode if d == path else (mode if parents_mode is None else parents_mode)
        try:
            os.mkdir(d, m)
        except FileExistsError:
            if not os.path.isdir(d):
                raise NotADirectoryError(20, f"{d} exists and is not a directory", d) from None
            continue
        os.chmod(d, m)
        created.append(d)
    return created


def existing_ancestor(path) -> str:
    """``path`` itself if it exists, else its nearest existing ancestor (what a free-space
    or O_DIRECT check can look at before the directory is created)."""
    p = os.path.abspath(os.fspath(path))
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p
