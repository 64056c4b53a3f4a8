"""The project's import graph. Every import (module level, in a function, or under `if TYPE_CHECKING:`)
goes down the layer order transport < engine < actors < router < frontend < {server, client} < cli; server and
client share a layer (the server may drive the client). No modules import each other in a cycle, even through
others, type-only imports included: they never run, but a circle of them still ties the modules into one unit
that can be read, changed or split only together. bench/ is a tool on top: it may import anything, and nothing
imports it. tests/ is not walked.

One declared exception: engine/__init__.py re-exports LLM and AsyncLLM from client/ lazily, in a module
`__getattr__`, so that `from engine import LLM` keeps working. Only that function may import client/ from
engine/, and only it may import a computed name (`import_module(HOMES[name])`): its targets are the module
names spelt as strings in engine/__init__.py. Those edges are left out of the cycle search (they run after
both packages are imported).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

REPO = Path(__file__).resolve().parent.parent
LAYERS = {"transport": 0, "engine": 1, "actors": 2, "router": 3, "frontend": 4, "server": 5, "client": 5, "commands": 6,
          "cli": 6}
TOOLS = ("bench",)  # may import every layer; no layer may import a tool
FACADE = ("engine", "client", "__getattr__")  # (package whose __init__ re-exports, from package, in function)
DYNAMIC = "<computed name>"  # the target of import_module(name) where name is not a literal


@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted
    target: str  # imported project module, dotted
    path: Path
    line: int
    function: str | None  # qualified name of the function the import runs in; None: at import time
    type_only: bool = False  # under `if TYPE_CHECKING:`: never runs

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}:{self.line}"


# ---------------------------------------------------------------- walking the tree


def project_modules(root: Path, top: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for the packages (directories) and single modules (cli.py) named in top."""
    modules: dict[str, Path] = {}
    for name in top:
        if (root / f"{name}.py").is_file():
            modules[name] = root / f"{name}.py"
        for path in sorted((root / name).rglob("*.py")) if (root / name).is_dir() else ():
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(module: str, path: Path, modules: Mapping[str, Path],
               facade: tuple[str, str, str] | None = None) -> Iterator[Import]:
    """Import statements, and calls of importlib.import_module / __import__: with a literal name they are
    ordinary edges, with a computed one their target is DYNAMIC. A dynamic import in the facade function
    reaches the modules its package names in string constants, so those are its edges."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    dynamic_facade = False
    for node, function, type_only in _walk(tree, ()):
        names = _imported_names(node, package) if not isinstance(node, ast.Call) else [_called_name(node)]
        for name in names:
            target = DYNAMIC if name is None else _project_module(name, modules)
            if target is not None and target != module:
                yield Import(module, target, path, node.lineno, function, type_only)
            dynamic_facade |= name is None and facade is not None and (module, function) == (facade[0], facade[2])
    if dynamic_facade:
        for const in ast.walk(tree):
            if isinstance(const, ast.Constant) and const.value in modules and const.value != module:
                yield Import(module, const.value, path, const.lineno, facade[2])


def _called_name(call: ast.Call) -> str | None:
    """The module an import_module / __import__ call names, or None when it is computed."""
    arg = call.args[0] if call.args else None
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def _is_import_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("import_module", "__import__")


def _walk(node: ast.AST, scope: tuple[str, ...], in_def: bool = False,
          type_only: bool = False) -> Iterator[tuple[ast.AST, str | None, bool]]:
    """Import statements with the qualified name of the function they run in (None: at import time) and
    whether they sit under `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)) or _is_import_call(child):
            yield child, ".".join(scope) if in_def else None, type_only
        is_def = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
        if is_def or isinstance(child, ast.ClassDef):
            yield from _walk(child, scope + (child.name,), in_def or is_def, type_only)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for branch, only in ((child.body, True), (child.orelse, False)):
                for stmt in branch:
                    yield from _walk(ast.Module(body=[stmt], type_ignores=[]), scope, in_def, type_only or only)
        else:
            yield from _walk(child, scope, in_def, type_only)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(node: ast.AST, package: str) -> list[str]:
    """Dotted names, absolute: `from a import b` gives a.b (b may be a module or a name in a)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return [f"{base}.{alias.name}" if base else alias.name for alias in node.names]


def _project_module(name: str, modules: Mapping[str, Path]) -> str | None:
    """The longest prefix of name that is a project module (`engine.llm.LLM` -> `engine.llm`)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def all_imports(root: Path, layers: Mapping[str, int], tools: tuple[str, ...],
                facade: tuple[str, str, str] | None = FACADE) -> list[Import]:
    modules = project_modules(root, tuple(layers) + tools)
    found = {(i.source, i.target, i.line): i
             for name, path in modules.items() for i in imports_of(name, path, modules, facade)}
    return list(found.values())  # `from a import b, c` is one edge when b and c are names in a


# ---------------------------------------------------------------- the two rules


def is_facade(imp: Import, facade: tuple[str, str, str] | None) -> bool:
    return facade is not None and imp.source == facade[0] and _top(imp.target) == facade[1] \
        and imp.function == facade[2]


def layer_violations(imports: list[Import], layers: Mapping[str, int], tools: tuple[str, ...],
                     facade: tuple[str, str, str] | None, root: Path) -> list[str]:
    bad = []
    for imp in imports:
        src, dst = _top(imp.source), _top(imp.target)
        if imp.target == DYNAMIC:
            if facade is None or (imp.source, imp.function) != (facade[0], facade[2]):
                bad.append(f"{imp.where(root)}: {imp.source} imports a computed name (only the facade may)")
            continue
        if src in tools or src == dst or is_facade(imp, facade):
            continue
        if dst in tools or layers[dst] > layers[src]:
            bad.append(f"{imp.where(root)}: {imp.source} -> {imp.target} ({src} -> {dst}: "
                       f"{'a tool' if dst in tools else 'upward'})")
    return sorted(bad)


def cycles(imports: list[Import], facade: tuple[str, str, str] | None) -> list[list[Import]]:
    """Each strongly connected set of modules (more than one), as the imports between its members. Imports under
    `if TYPE_CHECKING:` count: they never run, but they tie the modules together all the same."""
    imports = [i for i in imports if not is_facade(i, facade) and i.target != DYNAMIC]
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.source, set()).add(imp.target)
    found = []
    for component in _strongly_connected(graph):
        inside = [i for i in imports if i.source in component and i.target in component]
        found.append(sorted(inside, key=lambda i: (i.source, i.line)))
    return found


def _strongly_connected(graph: Mapping[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative; components of one module are left out."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def _top(module: str) -> str:
    return module.partition(".")[0]


def report(root: Path, layers: Mapping[str, int] = LAYERS, tools: tuple[str, ...] = TOOLS,
           facade: tuple[str, str, str] | None = FACADE) -> list[str]:
    """Every problem, one line each (empty when the tree is clean)."""
    imports = all_imports(root, layers, tools, facade)
    problems = layer_violations(imports, layers, tools, facade, root)
    for cycle in cycles(imports, facade):
        edges = ", ".join(f"{i.source} -> {i.target} ({i.where(root)})" for i in cycle)
        problems.append(f"import cycle between {sorted({i.source for i in cycle})}: {edges}")
    return problems


# ---------------------------------------------------------------- the project


def test_imports_go_down_the_layers_and_never_round_in_a_cycle():
    problems = report(REPO)
    assert not problems, "\n".join([f"{len(problems)} import problems:"] + problems)


def test_engine_imports_client_only_through_its_lazy_facade():
    """The facade is the one engine -> client arrow: inside engine/__init__.py's module __getattr__, nowhere
    else in engine/ (the layer test lets exactly that function through)."""
    imports = all_imports(REPO, LAYERS, TOOLS)
    into_client = [i for i in imports if _top(i.source) == "engine" and _top(i.target) in ("client", DYNAMIC)]
    assert all(i.source == "engine" and i.function == "__getattr__" for i in into_client), \
        [f"{i.where(REPO)}: {i.source} -> {i.target} in {i.function or 'module level'}" for i in into_client]


def test_every_project_package_has_a_layer():
    """A new top-level package must be placed in LAYERS (or TOOLS) before the layer test can see it."""
    packages = {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()} - {"tests"}
    assert packages <= set(LAYERS) | set(TOOLS), packages - set(LAYERS) - set(TOOLS)


# ---------------------------------------------------------------- the checker, on synthetic trees

SMALL_LAYERS = {"low": 0, "mid": 1, "high": 2}


def write_tree(root: Path, files: Mapping[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


LEGAL = {
    "low/__init__.py": "",
    "low/a.py": "import os\n",
    "low/b.py": "from low import a\nfrom . import a as again\n",
    "mid/__init__.py": "from mid.c import C\n",
    "mid/c.py": "from low.b import x\nC = 1\n",
    "high/__init__.py": "",
    "high/d.py": "def f():\n    from mid import C\n    import low.a\n",
    "tool/__init__.py": "",
    "tool/t.py": "import high.d\nimport low\n",
}


def test_checker_passes_a_legal_tree(tmp_path):
    assert report(write_tree(tmp_path, LEGAL), SMALL_LAYERS, ("tool",), None) == []


def test_checker_reports_an_upward_import_with_its_line_even_inside_a_function(tmp_path):
    tree = write_tree(tmp_path, {**LEGAL, "low/a.py": "import os\n\n\ndef g():\n    from high.z import f\n",
                                 "high/z.py": "", "mid/e.py": "import tool.t\n"})
    assert report(tree, SMALL_LAYERS, ("tool",), None) == [
        "low/a.py:5: low.a -> high.z (low -> high: upward)",
        "mid/e.py:1: mid.e -> tool.t (mid -> tool: a tool)",
    ]


def test_checker_reports_a_cycle_within_one_package(tmp_path):
    tree = write_tree(tmp_path, {**LEGAL, "low/a.py": "from .b import y\n"})  # low.b imports low.a
    (problem,) = report(tree, SMALL_LAYERS, ("tool",), None)
    assert problem.startswith("import cycle between ['low.a', 'low.b']: ")
    assert "low.a -> low.b (low/a.py:1)" in problem and "low.b -> low.a (low/b.py:1)" in problem


def test_checker_lets_the_declared_facade_through_only_inside_its_function(tmp_path):
    lazy = "def __getattr__(name):\n    from high.d import f\n    return f\n"
    tree = write_tree(tmp_path, {**LEGAL, "mid/__init__.py": lazy, "high/d.py": "import mid\n"})
    assert report(tree, SMALL_LAYERS, ("tool",), ("mid", "high", "__getattr__")) == []
    eager = write_tree(tmp_path, {"mid/__init__.py": "from high.d import f\n" + lazy})
    assert report(eager, SMALL_LAYERS, ("tool",), ("mid", "high", "__getattr__"))[0] == \
        "mid/__init__.py:1: mid -> high.d (mid -> high: upward)"


def test_checker_counts_a_type_only_import_in_cycles_and_in_the_layers(tmp_path):
    guarded = "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from {} import f\nelse:\n    import os\n"
    tree = write_tree(tmp_path, {**LEGAL, "low/a.py": guarded.format("low")})
    assert report(tree, SMALL_LAYERS, ("tool",), None) == []  # a type-only import that closes no circle
    write_tree(tmp_path, {"low/a.py": guarded.format("low.b")})
    assert report(tree, SMALL_LAYERS, ("tool",), None) == ["import cycle between ['low.a', 'low.b']: "
                                                         "low.a -> low.b (low/a.py:4), low.b -> low.a (low/b.py:1), "
                                                         "low.b -> low.a (low/b.py:2)"]
    write_tree(tmp_path, {"low/a.py": guarded.format("high.d").replace("import os", "import low.b")})
    assert report(tree, SMALL_LAYERS, ("tool",), None) == [  # upward, and round through high.d's own imports
        "low/a.py:4: low.a -> high.d (low -> high: upward)",
        "import cycle between ['high.d', 'low.a', 'low.b', 'mid', 'mid.c']: high.d -> mid (high/d.py:2), "
        "high.d -> low.a (high/d.py:3), low.a -> high.d (low/a.py:4), low.a -> low.b (low/a.py:6), "
        "low.b -> low.a (low/b.py:1), low.b -> low.a (low/b.py:2), mid -> mid.c (mid/__init__.py:1), "
        "mid.c -> low.b (mid/c.py:1)"]


def test_checker_reads_a_facade_that_imports_by_computed_name(tmp_path):
    """`import_module(HOMES[name])` in the facade reaches the modules named in HOMES; elsewhere a computed
    name is refused, since the checker cannot see where it leads."""
    lazy = ("from importlib import import_module\nHOMES = {'C': 'mid.c', 'f': 'high.d'}\n\n\n"
            "def __getattr__(name):\n    return getattr(import_module(HOMES[name]), name)\n")
    facade = ("mid", "high", "__getattr__")
    tree = write_tree(tmp_path, {**LEGAL, "mid/__init__.py": lazy, "high/d.py": "import mid\n"})
    assert report(tree, SMALL_LAYERS, ("tool",), facade) == []
    write_tree(tmp_path, {"mid/__init__.py": lazy.replace("'high.d'", "'tool.t'"),
                          "low/a.py": "import importlib\n\n\ndef g(n):\n    return importlib.import_module(n)\n"})
    assert report(tree, SMALL_LAYERS, ("tool",), facade)[:2] == [  # then the cycle mid -> tool.t -> high.d -> mid
        "low/a.py:5: low.a imports a computed name (only the facade may)",
        "mid/__init__.py:2: mid -> tool.t (mid -> tool: a tool)",
    ]
    write_tree(tmp_path, {"low/a.py": "import importlib\nB = importlib.import_module('low.b')\n"})
    problems = report(tree, SMALL_LAYERS, ("tool",), facade)  # a literal name is an ordinary edge: a cycle here
    assert any(p.startswith("import cycle between ['low.a', 'low.b']") for p in problems), problems
