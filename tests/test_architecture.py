"""The house stays drawn as docs/architecture.md draws it: folders in data-path order,
imports pointing down only, no import cycle, no file over 800 lines.

Every package and top-level module of ``infinity/`` has a rank below.  An import (at
module level or inside a function; parsed with ``ast``, nothing is imported) from a
module of rank r may only reach a module of rank <= r (the same rank: inside one
package); a name the package root re-exports lazily (``from infinity import
initialize``, ``infinity.Init``) counts as an import of the module behind it.  A package or
module that does not exist (yet) is simply not checked; one that exists without a rank
fails the test, so a new floor is placed on purpose.
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "infinity"
MAX_LINES = 800

#: the floors, lowest first (rank = position).  Read top to bottom it is the data path
#: (io -> memory -> runtime -> grads -> optim), then what builds on it.
FLOORS = [
    "__init__",          # the package root only re-exports, lazily (importlib strings)
    "procutil",
    "fsmode",            # directories created with explicit modes (any umask)
    "config_sections",   # the config's sections and value checkers
    "config_deepspeed",  # DeepSpeed config -> infinity config dict
    "config",            # InfinityConfig (from_deepspeed calls the translation)
    "curriculum",        # the seqlen curriculum schedule and batch truncation (config, torch)
    "quant",             # the blockwise quantizer (quantized export, ZeRO++ qwZ): torch only
    "io",                # NVMe tier
    "memory",            # host and device tiers, records, placement plan
    "runtime",           # grouping, hooks, trace prefetch (every world size)
    "grads",             # gradients leaving the device, the NVMe gradient home
    "optim",             # kernels, the NVMe optimizer step, the step driver
    "zero",              # partitioning across ranks, Init
    "checkpoint",
    "profile",
    "estimate",
    "data",
    "engine",            # initialize, Engine, its assembly
    "finetune",
    "integrations",      # Hugging Face Trainer / TRL
    "cli",
    "__main__",
]
RANKS = {name: i for i, name in enumerate(FLOORS)}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under infinity/."""
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _lazy_exports() -> dict[str, str]:
    """``infinity.<name>`` -> the module the package root re-exports it from (its
    ``_LAZY`` table, read with ``ast``): ``from infinity import initialize`` or
    ``infinity.initialize`` is an import of ``infinity.engine``, not of the root."""
    tree = ast.parse((ROOT / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            return {k: v[0] for k, v in ast.literal_eval(node.value).items()}
    return {}


LAZY = _lazy_exports()


def _floor(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def _resolve(name: str) -> str | None:
    """The longest existing module ``name`` or a prefix of it names (``a.b.c`` where
    ``c`` is a function of ``a.b`` -> ``a.b``)."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in MODULES:
            return cand
        parts.pop()
    return None


def _imports(mod: str, path: Path) -> set[str]:
    """Every ``infinity`` module ``mod`` imports, wherever the import statement is."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "infinity" and node.attr in LAZY:
            names = [f"infinity.{node.attr}"]    # `import infinity; infinity.initialize(...)`
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - (node.level - 1)]
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module or ""
            # `from pkg import sub` names the submodule when there is one, else pkg itself
            names = [f"{base_name}.{a.name}" for a in node.names]
        else:
            continue
        for n in names:
            if n == "infinity" or not n.startswith("infinity."):
                continue          # the root re-exports lazily; outside modules don't count
            head = n.split(".")[1]
            if head in LAZY and f"infinity.{head}" not in MODULES:
                n = LAZY[head]    # a lazy re-export of the root: the module behind it
            target = _resolve(n)
            if target is not None and target != mod:
                found.add(target)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_floor_has_a_rank():
    missing = sorted({_floor(m) for m in MODULES} - set(RANKS))
    assert not missing, (f"give these infinity/ packages or modules a rank in "
                         f"tests/test_architecture.py: {missing}")


def test_imports_point_down():
    bad = []
    for mod, targets in GRAPH.items():
        r = RANKS.get(_floor(mod))
        if r is None:
            continue                     # reported by test_every_floor_has_a_rank
        for t in targets:
            rt = RANKS.get(_floor(t))
            if rt is not None and rt > r:
                bad.append(f"{mod} (rank {r}) imports {t} (rank {rt})")
    assert not bad, "imports that point up:\n  " + "\n  ".join(sorted(bad))


def test_no_import_cycle():
    # Tarjan's strongly connected components over module -> imported module
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n  " + "\n  ".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_file_size(mod):
    n = len(MODULES[mod].read_text().splitlines())
    assert n <= MAX_LINES, f"{MODULES[mod]} has {n} lines (> {MAX_LINES}): split the concept"


def test_root_re_exports_count_as_imports_of_their_module(tmp_path):
    """``from infinity import initialize`` in a lower floor is an upward import of
    infinity.engine (the root only re-exports it), and so is ``infinity.Init``."""
    src = tmp_path / "fake.py"
    src.write_text("import infinity\nfrom infinity import initialize\n"
                   "def f():\n    return infinity.Init\n")
    found = _imports("infinity.memory.fake", src)
    assert LAZY["initialize"] in found and LAZY["Init"] in found
    assert all(RANKS[_floor(t)] > RANKS["memory"] for t in found)


def test_the_graph_is_not_empty():
    """The checks above found the code (a wrong ROOT would pass them vacuously)."""
    assert "infinity.engine.core" in MODULES or "infinity.engine" in MODULES
    assert sum(len(t) for t in GRAPH.values()) > 50


def _private_imports(mod: str, path: Path) -> list[str]:
    """``from <infinity module> import _name`` in ``mod`` where ``_name`` is not a module
    (the C extensions ``_aio``, ``_cpu_adam``, ``_quant`` are modules of the package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = pkg[:len(pkg) - (node.level - 1)]
            base_name = ".".join(base + ([node.module] if node.module else []))
        else:
            base_name = node.module or ""
        if not (base_name == "infinity" or base_name.startswith("infinity.")):
            continue
        for a in node.names:
            name = a.name
            if not name.startswith("_") or name.startswith("__"):
                continue
            sub = ROOT.parent / Path(*f"{base_name}.{name}".split("."))
            if sub.with_suffix(".py").exists() or sub.is_dir() or \
                    any(sub.parent.glob(f"{name}.*.so")):
                continue          # a private *module* of the package (a C extension)
            out.append(f"{mod}:{node.lineno}: from {base_name} import {name}")
    return out


def test_no_module_imports_another_modules_private_names():
    """A name with a leading underscore is its module's own: a module that needs it from
    elsewhere gets a public name (or the helper moves where both can use it)."""
    bad = [line for m, p in MODULES.items() for line in _private_imports(m, p)]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


_ENGINE_PRIVATE = re.compile(r"\b(?:engine|eng|self\.engine|self\.e)\._[a-z]\w*")


def test_no_module_reaches_into_the_engines_private_attributes():
    """Only infinity/engine/core.py touches ``Engine``'s private attributes; the modules
    around it go through its public attributes and methods (or get a collaborator)."""
    bad = []
    for m, p in MODULES.items():
        if m == "infinity.engine.core":
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            hit = _ENGINE_PRIVATE.search(line.split("#")[0])
            if hit:
                bad.append(f"{m}:{i}: {hit.group(0)}")
    assert not bad, "private Engine attributes used outside engine/core.py:\n" + "\n".join(bad)
