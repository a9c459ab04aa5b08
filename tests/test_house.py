"""House rules a newcomer can rely on, checked on the source itself.

Code comments and docstrings say how things are and why, never their history: no dates,
no commit ids. A figure that explains a constant points to the benchmark script that
measures it (and to docs/BENCHMARKS.md), not to the day it was measured.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zerda_cache"

_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
#: What reads as history in the package's source: a date (2026-12-04, 2026-12,
#: "December 2026", "December 4, 2026") or a commit id ("commit a780d98", "at 37ae331";
#: a hex word of 7 to 40 characters with at least one digit, so that English words made
#: of the letters a-f, such as "defaced", do not count).
_HEX = r"(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}"
HISTORY = re.compile(
    r"\b(?:19|20)\d{2}-(?:0[1-9]|1[0-2])(?:-\d{2})?\b"
    rf"|\b(?:{_MONTHS})(?:\s+\d{{1,2}},?)?\s+(?:19|20)\d{{2}}\b"
    rf"|\bcommits?\s+{_HEX}\b"
    rf"|\bat\s+{_HEX}\b",
    re.IGNORECASE,
)
#: ``(path relative to the repository, line text)`` pairs whose date is data, not
#: history (a format example, a fixed date a test relies on). Empty: none is needed.
ALLOWED: frozenset[tuple[str, str]] = frozenset()


def _sources() -> list[Path]:
    paths = [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.lua")]
    return sorted(p for p in paths if "__pycache__" not in p.parts)


def test_code_comments_carry_no_dates_or_history() -> None:
    sources = _sources()
    assert len(sources) > 50  # the scan really reads the package
    hits = []
    for path in sources:
        rel = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            match = HISTORY.search(line)
            if match and (rel, line.strip()) not in ALLOWED:
                hits.append(f"{rel}:{number}: {match.group(0)!r} in {line.strip()}")
    assert not hits, "dates or commit ids in the package's source:\n" + "\n".join(hits)


def test_the_scan_knows_history_when_it_sees_it() -> None:
    for text in (
        "(side by side, 2026-12-03)",
        "run 2026-12 on a 2-core host",
        "measured in December 2026",
        "since December 4, 2026",
        "before commit a780d98, of three fields",
        "the tree at 37ae331 did this",
    ):
        assert HISTORY.search(text), text
    for text in (
        "a removal costs the server ~15-20 us",
        "entries 20,000 to 1,000,000 (1e-4)",
        "a graph that was defaced at decade boundaries",
        "ZCIX format 5, M=32, ef_construction=128",
        "float16 bits 0x3c00",
    ):
        assert not HISTORY.search(text), text


#: Private names of other libraries the package uses on purpose: ``(attribute, why)``.
FOREIGN_PRIVATE = {
    # usearch's compiled index, searched without the Python wrapper (index._search_one).
    "_compiled": "usearch",
}
#: Private-looking names that are public API: namedtuple methods, ``os._exit``.
_BUILTIN_PRIVATE = {"_replace", "_asdict", "_fields", "_make", "_exit"}


def _defined_names(tree: ast.Module) -> set[str]:
    """Every name a module defines: functions, classes, attributes it assigns, arguments."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def private_uses(source: str) -> list[str]:
    """``_private`` names ``source`` uses but does not define: another module's privates
    (an attribute of an object made elsewhere, inherited, or imported)."""
    tree = ast.parse(source)
    own = _defined_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = node.attr
            if (
                name.startswith("_")
                and not name.startswith("__")
                and name not in own
                and name not in _BUILTIN_PRIVATE
                and name not in FOREIGN_PRIVATE
            ):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zerda_cache"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{node.lineno}: import {alias.name}")
    return found


def test_no_module_uses_another_modules_private_names() -> None:
    """A leading underscore means private to its module. Flows, which other modules
    compose with ``yield from``, are public and named ``*_flow`` (``driver.op``)."""
    hits = []
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 40
    for path in modules:
        rel = path.relative_to(ROOT).as_posix()
        hits += [f"{rel}:{hit}" for hit in private_uses(path.read_text(encoding="utf-8"))]
    assert not hits, "private names used across modules:\n" + "\n".join(hits)


def test_the_private_name_check_sees_a_foreign_private() -> None:
    assert private_uses("def f(st):\n    return st._run(1)\n") == ["2: st._run"]
    assert private_uses("from zerda_cache.x import _helper\n") == ["1: import _helper"]
    own = "class A:\n    def _x(self):\n        return 1\n\ndef f(a):\n    return a._x()\n"
    assert private_uses(own) == []


#: What storage may build on: the configuration, the data model, errors and input checks.
#: Policy, calibration, match models and the engine sit above it and read storage's raw
#: replies (``tenant_state.py``); storage never imports them, directly or through these.
STORAGE_MAY_IMPORT = {
    "zerda_cache.apikeys",
    "zerda_cache.core.config",
    "zerda_cache.core.entry",
    "zerda_cache.core.errors",
    "zerda_cache.core.settings",
    "zerda_cache.core.validation",
}


def _module_file(module: str) -> Path:
    path = ROOT.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def package_imports(module: str) -> set[str]:
    """The package's modules that ``module`` imports (the package itself left out)."""
    tree = ast.parse(_module_file(module).read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zerda_cache"):
            assert node.module is not None
            subs = {f"{node.module}.{alias.name}" for alias in node.names}
            subs = {m for m in subs if _module_file(m).exists()}
            found |= subs  # ``from zerda_cache.storage import codec``: codec, not the package
            if len(subs) < len(node.names):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("zerda_cache.")}
    return found - {"zerda_cache"}


def test_storage_is_the_bottom_layer() -> None:
    storage = {
        f"zerda_cache.storage.{p.stem}" if p.stem != "__init__" else "zerda_cache.storage"
        for p in (PACKAGE / "storage").glob("*.py")
    }
    seen: set[str] = set()
    todo = sorted(storage)
    while todo:  # everything storage imports, directly or through what it imports
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += sorted(package_imports(module))
    outside = seen - storage - STORAGE_MAY_IMPORT
    assert not outside, f"storage depends on modules above it: {sorted(outside)}"
    assert "zerda_cache.storage.store" in seen and "zerda_cache.core.config" in seen


#: The longest function and class the package holds, in lines (decorators left out).
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 600
#: The engine's module, which wires the lookup and put steps of ``flows/``.
ENGINE = PACKAGE / "flows" / "engine.py"
MAX_ENGINE_LINES = 600


def oversized(source: str, path: str) -> list[str]:
    """Functions over ``MAX_FUNCTION_LINES`` and classes over ``MAX_CLASS_LINES``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        size = (node.end_lineno or node.lineno) - node.lineno + 1
        if isinstance(node, ast.ClassDef):
            if size > MAX_CLASS_LINES:
                found.append(f"{path}: class {node.name} is {size} lines")
        elif size > MAX_FUNCTION_LINES:
            found.append(f"{path}: def {node.name} is {size} lines")
    return found


def test_functions_and_classes_stay_readable() -> None:
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        hits += oversized(path.read_text(encoding="utf-8"), rel)
    assert not hits, "\n".join(hits)
    lines = len(ENGINE.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_ENGINE_LINES, f"flows/engine.py has {lines} lines"


def test_the_size_check_sees_a_long_function() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert oversized(f"def f():\n{body}", "m.py") == [
        f"m.py: def f is {MAX_FUNCTION_LINES + 1} lines"
    ]
    assert oversized("def g():\n    return 1\n", "m.py") == []


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules of ``graph`` (module -> the
    modules it imports): each is an import circle (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    circles.append(sorted(group))
    return circles


def test_the_package_has_no_import_circle() -> None:
    """No module imports, directly or through others, a module that imports it back:
    imports under ``TYPE_CHECKING`` and inside functions count too (a circle there is
    still two modules that cannot be read, or changed, one without the other)."""
    modules = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in PACKAGE.rglob("*.py")
    }
    graph = {m: package_imports(m) & modules for m in modules}
    assert len(graph) > 40
    assert not import_circles(graph), f"import circles: {import_circles(graph)}"


def test_the_circle_check_sees_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


#: The README is a newcomer's first page: what it is, how to install it, one example a
#: way in; the detail is in docs/ (each example's home), so that it stays read whole.
MAX_README_LINES = 250


def test_the_readme_stays_a_first_page() -> None:
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES})"
