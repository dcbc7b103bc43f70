"""The docs site builds: ``mkdocs build --strict`` over docs/ (mkdocs.yml at the root,
README.md as the index, API pages from the docstrings) fails on a broken link or anchor
and on a page missing from the navigation, so neither can land unnoticed.

Skipped with one line where mkdocs is not installed (``scripts/setup.sh`` installs it)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="mkdocs not installed (scripts/setup.sh installs it)")

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "mkdocs.yml"


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
         "-d", str(site)],
        cwd=config.parent, capture_output=True, text=True, timeout=120,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin", "HOME": str(site.parent)})


def test_site_builds_strict(tmp_path):
    r = _build(CONFIG, tmp_path / "site")
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    assert (tmp_path / "site" / "index.html").exists()
    api = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    assert 'id="infinity.engine.initialize"' in api and "for offloaded training" in api, \
        "no docstrings on the API page"


def test_every_page_is_in_the_nav():
    """The nav lists every page of docs/ (strict mode also fails on an omitted one)."""
    text = CONFIG.read_text(encoding="utf-8")
    nav = set(re.findall(r":\s*([\w.-]+\.md)\s*$", text, flags=re.M))
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    assert pages == nav, f"not in the nav: {sorted(pages - nav)}; missing: {sorted(nav - pages)}"


def test_api_page_documents_the_root_exports():
    """Every name ``import infinity`` re-exports has its entry on the API page."""
    import infinity
    api = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    entries = {line.split()[1].rsplit(".", 1)[-1] for line in api.splitlines()
               if line.startswith("::: ")}
    missing = sorted(set(infinity.__all__) - {"__version__"} - entries)
    assert not missing, f"docs/api.md lacks {missing}"


def test_strict_catches_a_broken_link_and_an_unlisted_page(tmp_path):
    """The repository's ``validation`` settings make strict mode fail on both."""
    validation = re.search(r"^validation:\n(?:[ \t]+.*\n)+", CONFIG.read_text(encoding="utf-8"),
                           flags=re.M)
    assert validation, "mkdocs.yml has no validation section"
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[gone](gone.md), [no anchor](#nowhere)\n")
    (docs / "extra.md").write_text("# Not in the nav\n")
    cfg = tmp_path / "mkdocs.yml"
    cfg.write_text("site_name: t\nnav:\n  - index.md\n" + validation.group(0))
    r = _build(cfg, tmp_path / "site")
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "gone.md" in out and "nowhere" in out and "extra.md" in out, out
