"""Imports flow one way, never in a cycle, and nothing private crosses a module boundary.

The import graph of ``jaxspec/``, ``pallas_kernels/`` and ``experiments/`` is built from the
sources with :mod:`ast` (module-level and function-level imports alike; ``from x import y``
counts as an import of the submodule ``x.y`` when there is one). The layers, lowest first::

    pallas_kernels  <-  jaxspec.config, jaxspec.parallel  <-  jaxspec.models  <-  jaxspec.decoding
        <-  jaxspec.dustin, jaxspec.knapspec, jaxspec.baselines  <-  experiments

A module may import its own layer or a lower one. ``jaxspec.parallel`` imports nothing from
jaxspec but itself; ``pallas_kernels`` nothing from jaxspec. ``jaxspec.assets`` and
``jaxspec.data`` sit low beside them: anyone may use them, and they import no model, decoding,
Dustin, KnapSpec, baseline or experiment code. The three siblings may import each other one
way only. A private name (``_x``, not a dunder) is never imported from another module nor read
as ``module._x`` from an imported one: what another module needs is public. Test modules share
helpers through ``conftest.py``, never by importing another test module.

Each failure lists every offender as ``file:line: [rule] what``.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOT_PACKAGES = ("jaxspec", "pallas_kernels", "experiments")

# Layer ranks (higher imports lower). Low modules (assets, data) are handled by their own rule.
_RANKS = (
    ("pallas_kernels", 0),
    ("jaxspec.config", 1),
    ("jaxspec.parallel", 1),
    ("jaxspec.models", 2),
    ("jaxspec.decoding", 3),
    ("jaxspec.dustin", 4),
    ("jaxspec.knapspec", 4),
    ("jaxspec.baselines", 4),
    ("experiments", 5),
)
LOW = ("jaxspec.assets", "jaxspec.data")
SIBLINGS = ("jaxspec.dustin", "jaxspec.knapspec", "jaxspec.baselines")
LAYER_ORDER = ("pallas_kernels <- jaxspec.config/jaxspec.parallel <- jaxspec.models <- jaxspec.decoding <- "
               "{jaxspec.dustin, jaxspec.knapspec, jaxspec.baselines} <- experiments")
LOW_FORBIDDEN = ("jaxspec.models", "jaxspec.decoding", "jaxspec.dustin", "jaxspec.knapspec", "jaxspec.baselines",
                 "experiments")


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _group(module: str, groups) -> str | None:
    """The longest entry of ``groups`` that ``module`` lies within."""
    found = [group for group in groups if _within(module, group)]
    return max(found, key=len) if found else None


# NamedTuple's public API is spelt with one underscore.
_PUBLIC_UNDERSCORE_NAMES = {"_replace", "_asdict", "_fields", "_field_defaults", "_make"}


def _is_private(name: str) -> bool:
    if name in _PUBLIC_UNDERSCORE_NAMES:
        return False
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# ---------------------------------------------------------------------------- the graph
@dataclasses.dataclass(frozen=True)
class Edge:
    source: str        # importing module
    target: str        # imported internal module
    file: str          # repository-relative path of the importing file
    line: int


@dataclasses.dataclass
class Graph:
    modules: dict[str, pathlib.Path]  # dotted name -> source file
    edges: list[Edge]
    private_uses: list[str]           # ready-made messages for the private-name rule


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_modules(root: pathlib.Path, packages=ROOT_PACKAGES) -> dict[str, pathlib.Path]:
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            modules[module_name(path, root)] = path
    return modules


def _resolve_relative(module: str, is_package: bool, level: int, base: str | None) -> str:
    """The absolute module of ``from .base import ...`` (``level`` dots) inside ``module``."""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([base] if base else []))


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of attribute reads on a name, else None."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    names.append(node.id)
    return ".".join(reversed(names))


def build_graph(root: pathlib.Path = REPO, packages=ROOT_PACKAGES) -> Graph:
    modules = find_modules(root, packages)
    edges: list[Edge] = []
    private_uses: list[str] = []

    def internal(name: str) -> str | None:
        """The internal module ``name`` or, for ``a.b.c`` not a module, its longest module prefix."""
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            candidate = ".".join(parts[:end])
            if candidate in modules:
                return candidate
        return None

    for module, path in modules.items():
        relative = str(path.relative_to(root))
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=relative)
        is_package = path.name == "__init__.py"
        bound: dict[str, str] = {}  # local name -> internal module it is bound to (any scope)

        def add(target: str | None, line: int) -> None:
            if target is not None and target != module:
                edges.append(Edge(module, target, relative, line))

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = internal(alias.name)
                    add(target, node.lineno)
                    if target is None:
                        continue
                    if alias.asname:
                        bound[alias.asname] = alias.name if alias.name in modules else target
                    else:
                        top = alias.name.split(".")[0]
                        if top in modules:
                            bound[top] = top
                    if _is_private(alias.name.split(".")[-1]) and not _within(module, alias.name.rsplit(".", 1)[0]):
                        private_uses.append(f"{relative}:{node.lineno}: [private] imports the private module "
                                            f"{alias.name}")
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = _resolve_relative(module, is_package, node.level, node.module)
                base_module = internal(base) if base else None
                if base_module is None:
                    continue
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    if submodule in modules:
                        add(submodule, node.lineno)
                        bound[alias.asname or alias.name] = submodule
                        if _is_private(alias.name) and not _within(module, base):
                            private_uses.append(f"{relative}:{node.lineno}: [private] imports the private module "
                                                f"{submodule}")
                    else:
                        add(base_module, node.lineno)
                        if alias.name != "*" and _is_private(alias.name):
                            private_uses.append(f"{relative}:{node.lineno}: [private] imports the private name "
                                                f"{alias.name} from {base}")

        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
                continue
            chain = _dotted(node.value)
            if chain is None:
                continue
            head, _, rest = chain.partition(".")
            if head not in bound:
                continue
            target = bound[head] + ("." + rest if rest else "")
            if target in modules and target != module:
                private_uses.append(f"{relative}:{node.lineno}: [private] uses {chain}.{node.attr}, a private "
                                    f"name of {target}")
    return Graph(modules, edges, sorted(set(private_uses), key=_location_key))


def _location_key(message: str):
    file, line, _ = message.split(":", 2)
    return file, int(line), message


# ---------------------------------------------------------------------------- the rules
def cycle_violations(graph: Graph) -> list[str]:
    """One message per strongly connected component of more than one module, with a cycle in it."""
    adjacency: dict[str, dict[str, Edge]] = {module: {} for module in graph.modules}
    for edge in graph.edges:
        adjacency[edge.source].setdefault(edge.target, edge)

    index_of: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def visit(start: str) -> None:  # iterative Tarjan
        work = [(start, iter(sorted(adjacency[start])))]
        index_of[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index_of:
                    index_of[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(adjacency[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index_of[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index_of[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index_of:
            visit(module)

    messages = []
    for component in sorted(components):
        members = set(component)
        start = component[0]
        # shortest cycle through ``start`` inside the component (BFS back to it)
        parents: dict[str, str] = {}
        frontier = [start]
        found = None
        while frontier and found is None:
            next_frontier = []
            for node in frontier:
                for child in sorted(adjacency[node]):
                    if child not in members:
                        continue
                    if child == start:
                        found = node
                        break
                    if child not in parents:
                        parents[child] = node
                        next_frontier.append(child)
                if found is not None:
                    break
            frontier = next_frontier
        path = [found]
        while path[-1] != start:
            path.append(parents[path[-1]])
        path.reverse()
        path.append(start)
        hops = [adjacency[a][b] for a, b in zip(path, path[1:])]
        where = ", ".join(f"{hop.file}:{hop.line} imports {hop.target}" for hop in hops)
        first = hops[0]
        messages.append(f"{first.file}:{first.line}: [cycle] {' -> '.join(path)} ({where}); "
                        f"all modules in this cycle: {', '.join(component)}")
    return messages


def _rank(module: str) -> int | None:
    group = _group(module, [name for name, _ in _RANKS])
    return dict(_RANKS)[group] if group else None


def layer_violations(graph: Graph) -> list[str]:
    messages = []
    sibling_edges: dict[tuple[str, str], Edge] = {}
    for edge in sorted(graph.edges, key=lambda e: (e.file, e.line, e.target)):
        source, target = edge.source, edge.target
        where = f"{edge.file}:{edge.line}"
        if _group(source, LOW) is not None:
            forbidden = _group(target, LOW_FORBIDDEN)
            if forbidden is not None:
                messages.append(f"{where}: [upward] {source} imports {target}; {_group(source, LOW)} sits low and "
                                f"imports no {forbidden} code")
            continue
        if _within(source, "pallas_kernels") and _within(target, "jaxspec"):
            messages.append(f"{where}: [upward] {source} imports {target}; pallas_kernels imports nothing from "
                            "jaxspec")
            continue
        if _within(source, "jaxspec.parallel") and not _within(target, "jaxspec.parallel") \
                and _within(target, "jaxspec"):
            messages.append(f"{where}: [upward] {source} imports {target}; jaxspec.parallel is a leaf that imports "
                            "nothing from jaxspec but itself")
            continue
        source_rank, target_rank = _rank(source), _rank(target)
        if source_rank is not None and target_rank is not None and target_rank > source_rank:
            messages.append(f"{where}: [upward] {source} imports {target}, a higher layer; imports flow "
                            f"{LAYER_ORDER}")
        source_sibling, target_sibling = _group(source, SIBLINGS), _group(target, SIBLINGS)
        if source_sibling and target_sibling and source_sibling != target_sibling:
            sibling_edges.setdefault((source_sibling, target_sibling), edge)
    for (one, other), edge in sorted(sibling_edges.items()):
        if one < other and (other, one) in sibling_edges:
            back = sibling_edges[(other, one)]
            messages.append(f"{edge.file}:{edge.line}: [siblings] {one} imports {other} ({edge.source} -> "
                            f"{edge.target}) and {back.file}:{back.line} imports back ({back.source} -> "
                            f"{back.target}); siblings import each other one way only")
    return messages


def test_module_imports(root: pathlib.Path = REPO) -> list[str]:
    """Imports of another test module by the files of ``tests/`` (``conftest`` is the shared place)."""
    tests = root / "tests"
    names = {path.stem for path in tests.rglob("*.py")} - {"conftest", "__init__"}
    messages = []
    for path in sorted(tests.rglob("*.py")):
        relative = path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(relative))):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level:  # from .x import y, from . import x
                candidates = [f"tests.{node.module}"] if node.module else [f"tests.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module == "tests":
                candidates = [f"tests.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                candidates = [node.module or ""]
            else:
                continue
            for name in candidates:
                parts = name.split(".")
                stem = parts[-1]  # the module itself: tests.test_x, tests.pkg.test_x, `import test_x`
                if stem in names and stem != path.stem:
                    messages.append(f"{relative}:{node.lineno}: [tests] imports the test module {stem}; "
                                    "shared helpers belong in tests/conftest.py")
    return sorted(set(messages), key=_location_key)


test_module_imports.__test__ = False  # a helper, not a test (its name starts with test_)


# ---------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def graph() -> Graph:
    return build_graph()


def _fail_listing(messages: list[str], rule: str) -> None:
    if messages:
        pytest.fail(f"{len(messages)} {rule} violation(s):\n" + "\n".join(messages), pytrace=False)


def test_graph_covers_the_packages(graph):
    """Guard against a checker that passes because it saw nothing."""
    for package in ROOT_PACKAGES + ("jaxspec.models", "jaxspec.decoding", "jaxspec.data"):
        assert sum(_within(module, package) for module in graph.modules) >= 2, package
    assert any(e.source == "jaxspec.models.registry" and e.target == "jaxspec.assets" for e in graph.edges)
    assert any(e.source == "jaxspec.models.loading" and e.target == "jaxspec.models.registry" for e in graph.edges)


def test_no_import_cycles(graph):
    _fail_listing(cycle_violations(graph), "import-cycle")


def test_imports_flow_one_way(graph):
    _fail_listing(layer_violations(graph), "layering")


def test_no_private_names_across_modules(graph):
    _fail_listing(graph.private_uses, "private-name")


def test_tests_do_not_import_each_other():
    _fail_listing(test_module_imports(), "test-module import")


# ---------------------------------------------------------------------------- the checker itself
def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_finds_each_kind_of_violation(tmp_path):
    _write(tmp_path, {
        "jaxspec/__init__.py": "",
        "jaxspec/config.py": "",
        "jaxspec/assets.py": "def f():\n    from jaxspec.models import llama\n",
        "jaxspec/parallel/__init__.py": "from jaxspec import config\n",
        "jaxspec/models/__init__.py": "",
        "jaxspec/models/llama.py": "import jaxspec.models.cache as cache\nx = cache._private\n",
        "jaxspec/models/cache.py": "from jaxspec.models.llama import _helper\n",
        "jaxspec/decoding/__init__.py": "",
        "jaxspec/decoding/speculative.py": "def g():\n    import experiments.run\n",
        "jaxspec/dustin/__init__.py": "from jaxspec.knapspec import dp\n",
        "jaxspec/knapspec/__init__.py": "",
        "jaxspec/knapspec/dp.py": "import jaxspec.dustin\njaxspec.dustin.__doc__\n",
        "pallas_kernels/__init__.py": "from jaxspec.config import ModelConfig\n",
        "experiments/__init__.py": "",
        "experiments/run.py": "from jaxspec.models import cache\ncache._state\nfrom jaxspec.decoding import speculative\n",
        "tests/__init__.py": "",
        "tests/conftest.py": "",
        "tests/test_a.py": "from .conftest import X\nfrom .test_b import helper\n",
        "tests/test_b.py": "from tests import test_a\n",
    })
    graph = build_graph(tmp_path)
    cycles = cycle_violations(graph)
    assert any("jaxspec.models.cache -> jaxspec.models.llama -> jaxspec.models.cache" in m for m in cycles), cycles
    assert any("[cycle]" in m and "jaxspec.decoding.speculative" in m and "experiments.run" in m for m in cycles)
    layers = "\n".join(layer_violations(graph))
    assert "jaxspec/assets.py:2: [upward] jaxspec.assets imports jaxspec.models.llama" in layers
    assert "jaxspec/parallel/__init__.py:1: [upward] jaxspec.parallel imports jaxspec.config" in layers
    assert "jaxspec/decoding/speculative.py:2: [upward] jaxspec.decoding.speculative imports experiments.run" in layers
    assert "pallas_kernels/__init__.py:1: [upward] pallas_kernels imports jaxspec.config" in layers
    assert "[siblings] jaxspec.dustin imports jaxspec.knapspec" in layers
    assert "experiments/run.py" not in layers  # experiments may import anything below
    private = "\n".join(graph.private_uses)
    assert "jaxspec/models/cache.py:1: [private] imports the private name _helper from jaxspec.models.llama" in private
    assert "jaxspec/models/llama.py:2: [private] uses cache._private, a private name of jaxspec.models.cache" in private
    assert "experiments/run.py:2: [private] uses cache._state" in private
    assert "__init__" not in private  # dunders are not private
    tests = test_module_imports(tmp_path)
    assert tests == ["tests/test_a.py:2: [tests] imports the test module test_b; shared helpers belong in "
                     "tests/conftest.py",
                     "tests/test_b.py:1: [tests] imports the test module test_a; shared helpers belong in "
                     "tests/conftest.py"]


def test_checker_accepts_a_clean_tree(tmp_path):
    _write(tmp_path, {
        "jaxspec/__init__.py": "",
        "jaxspec/config.py": "import pallas_kernels\n",
        "jaxspec/assets.py": "import os\n",
        "jaxspec/data/__init__.py": "from jaxspec import assets\nassets.cache_dir\n",
        "jaxspec/models/__init__.py": "",
        "jaxspec/models/llama.py": "from jaxspec.config import ModelConfig\nfrom jaxspec.models import cache\n"
                                   "def f(self):\n    return self._x, cache.__name__\n",
        "jaxspec/models/cache.py": "def _local():\n    pass\n_local()\n",
        "jaxspec/dustin/__init__.py": "from jaxspec.knapspec import dp\n",
        "jaxspec/knapspec/__init__.py": "", "jaxspec/knapspec/dp.py": "from jaxspec.models import llama\n",
        "pallas_kernels/__init__.py": "import numpy as np\nnp._private_numpy_thing = 1\n",
        "experiments/__init__.py": "", "experiments/run.py": "import jaxspec.dustin\nfrom jaxspec.data import x\n",
        "tests/conftest.py": "", "tests/test_a.py": "from .conftest import helper\nimport test_helpers_not_ours\n",
    })
    graph = build_graph(tmp_path)
    assert cycle_violations(graph) == []
    assert layer_violations(graph) == []
    assert graph.private_uses == []
    assert test_module_imports(tmp_path) == []
