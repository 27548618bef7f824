"""The package's import structure: no import cycle among caffempi's modules
(lazy imports inside functions count: they tie the modules all the same),
and no private name imported from another module."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "caffempi"


def _modules():
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _imports(mods):
    """{module: {imported module}} and [(module, private name, source)]."""
    edges, private = {m: set() for m in mods}, []
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = []
                for alias in node.names:
                    sub = base + "." + alias.name
                    targets.append(sub if sub in mods else base)
                    if sub not in mods and alias.name.startswith("_") and not alias.name.startswith("__") \
                            and base in mods and base != mod:
                        private.append((mod, alias.name, base))
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                # a module importing its own package's __init__ is no cycle worth naming
                if t and t != mod and not mod.startswith(t + "."):
                    edges[mod].add(t)
    return edges, private


def _cycles(edges):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    edges, _ = _imports(_modules())
    assert _cycles(edges) == []


def test_no_private_names_imported_across_modules():
    _, private = _imports(_modules())
    assert private == []


def test_the_checker_sees_a_cycle_and_a_lazy_import():
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    edges, _ = _imports(_modules())
    # solvers reach the parallel package's strategies; the reverse would be a cycle
    assert "caffempi.parallel.sync" in edges["caffempi.solvers.solver"]
