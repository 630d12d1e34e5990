"""The layout shows the architecture (DESIGN.md §1.1): the import graph read from the source.

Every import counts, a function-local one included (one placed inside a function to dodge a cycle
is still a cycle). Checked: no cycle among jaxpar's modules beyond the ones listed as still to
break (that list may only shrink), no module over 800 lines, and the walls between layers."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "jaxpar")
MAX_LINES = 800


def _modules() -> dict[str, str]:
    """Dotted module name -> file path, for every module of the package."""
    out = {}
    for d, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(d, f)
    return out


def _imports(name: str, path: str, modules: dict[str, str], nodes=None) -> set[str]:
    """The jaxpar modules `name` imports anywhere in its source (`from a import b` counts as
    `a.b` where that is a module, else as `a`); or in `nodes` only (e.g. the module's top level)."""
    if nodes is None:
        with open(path, encoding="utf-8") as f:
            nodes = list(ast.walk(ast.parse(f.read(), path)))
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import jaxpar.train.step` names the module itself
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    cycles = _cycles(import_graph())
    assert not cycles, "import cycles among jaxpar's modules:\n" + "\n".join(
        " <-> ".join(sorted(c)) for c in cycles)


def test_no_module_over_800_lines():
    long = {}
    for name, path in _modules().items():
        with open(path, encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            long[name] = n
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_walls_between_layers():
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith("jaxpar.model"):  # the maths only
            bad = {d for d in deps if d.startswith(("jaxpar.parallel", "jaxpar.train", "jaxpar.plan"))}
            assert not bad, f"{name} imports {bad}: model/ knows no parallel/, train/ or plan/"
    # The schedule tables are plain Python (no JAX anywhere in them), and so is what a module
    # importing them loads on the way: the package `jaxpar.parallel.pipeline` imports only plain
    # modules at its top level (its executor's names load on first use, inside `__getattr__`), and
    # the old paths `jaxpar.parallel.schedules` / `timeline` are the same modules.
    modules = _modules()
    plain = {"jaxpar.errors", "jaxpar.parallel", "jaxpar.parallel.schedules", "jaxpar.parallel.timeline",
             "jaxpar.parallel.pipeline", "jaxpar.parallel.pipeline.schedules", "jaxpar.parallel.pipeline.timeline",
             "jaxpar.parallel.pipeline.table", "jaxpar.parallel.pipeline.simulate", "jaxpar.parallel.pipeline.vshape",
             "jaxpar.parallel.pipeline.placement"}
    for name in sorted(plain - {"jaxpar.errors"}):
        with open(modules[name], encoding="utf-8") as f:
            tree = ast.parse(f.read())
        nodes = tree.body if name == "jaxpar.parallel.pipeline" else list(ast.walk(tree))
        top = {a.name.split(".")[0] for n in nodes if isinstance(n, ast.Import) for a in n.names}
        top |= {(n.module or "").split(".")[0] for n in nodes if isinstance(n, ast.ImportFrom) and not n.level}
        assert "jax" not in top, f"schedule tables are plain Python: {name} imports no JAX"
        deps = _imports(name, modules[name], modules, nodes)
        assert deps <= plain, f"{name} (plain Python) imports {deps - plain}"


def test_the_graph_reader_sees_a_function_local_import(tmp_path):
    """The reader itself: an import inside a function is an edge (so a cycle hidden there fails)."""
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from jaxpar.train import step\n    import jaxpar.mesh as mesh\n")
    modules = _modules()
    assert _imports("jaxpar.somewhere", str(path), modules) == {"jaxpar.train.step", "jaxpar.mesh"}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
