"""Every name README.md and docs/ give for infinity's code still exists: dotted names
(``infinity.optim.adam_step``, ``infinity.Init``) import and resolve, and source paths
(``infinity/grads/route.py``, ``infinity/runtime/``) are there.  A module that moves must
leave its documented names importable (re-exported) or the docs must follow it.

Only names whose first component is a real part of the package are checked, so prose
such as "infinity/DeepSpeed" (a ratio) or ``infinity.json`` (a file name) is not."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "infinity"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_DOTTED = re.compile(r"\binfinity(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
_PATH = re.compile(r"\binfinity/[A-Za-z0-9_./-]*")


def _parts() -> set[str]:
    """Top-level packages and modules of infinity/, and what the root re-exports."""
    import infinity
    names = {p.stem for p in PKG.glob("*.py")} | {p.name for p in PKG.iterdir() if p.is_dir()}
    return (names | set(infinity.__all__)) - {"__init__", "__pycache__"}


PARTS = _parts()


def _mentions(pattern: re.Pattern) -> list[tuple[str, str]]:
    out = set()
    for doc in DOCS:
        for m in pattern.finditer(doc.read_text(encoding="utf-8")):
            name = m.group(0).rstrip(".")
            head = re.split(r"[./]", name)[1]      # the part of infinity it names
            if head in PARTS:
                out.add((name, doc.name))
    return sorted(out)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_the_docs_mention_code():
    """The scan finds the documented names (a broken pattern would pass vacuously)."""
    assert len(_mentions(_DOTTED)) > 20 and len(_mentions(_PATH)) > 20


@pytest.mark.parametrize("name,doc", _mentions(_DOTTED))
def test_documented_name_resolves(name, doc):
    assert _resolves(name), f"{doc} names {name}, which does not import/resolve"


@pytest.mark.parametrize("path,doc", _mentions(_PATH))
def test_documented_path_exists(path, doc):
    p = REPO / path.rstrip("/")
    assert p.exists() or p.with_suffix(".py").exists(), f"{doc} names {path}, which is gone"
