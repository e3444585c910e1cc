"""The package's import layout (docs/decoders.md): no import circle anywhere under ``app/``,
and every decoder family's ``model.py`` imports nothing of the service but
``app.families.ops``.

The graph is read from the source (the AST), not by importing: module-level ``import`` /
``from`` statements of ``app.*`` (those under ``if TYPE_CHECKING:`` included: a type-only
circle is still a circle for a reader), relative ones resolved; imports inside functions are
deferred by design and not edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[1] / "app"


def module_name(path: Path) -> str:
    parts = path.relative_to(APP.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_level_imports(path: Path, modules: set[str] | None = None) -> set[str]:
    """The ``app.*`` names ``path`` imports at module level: ``from X import Y`` is an edge to
    module ``X.Y`` where that is a module of ``modules``, else to ``X``."""
    modules = modules if modules is not None else all_modules()
    tree = ast.parse(path.read_text(), str(path))
    package = (
        module_name(path)
        if path.name == "__init__.py"
        else module_name(path)[: -len(path.stem) - 1]
    )
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                subs = {f"{base}.{a.name}" for a in node.names}
                found.update(subs & modules)
                if subs - modules:
                    found.add(base)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return {name for name in found if name == "app" or name.startswith("app.")}


def all_modules() -> set[str]:
    return {module_name(p) for p in APP.rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    """module -> the app modules it imports."""
    paths = {module_name(p): p for p in APP.rglob("*.py")}
    modules = set(paths)
    graph = {}
    for name, path in paths.items():
        graph[name] = {m for m in module_level_imports(path, modules) if m in modules and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := walk(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := walk(node)):
            return cycle
    return None


def test_no_import_circle_under_app() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_the_checker_sees_a_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_family_models_import_only_ops() -> None:
    from app.families import FAMILIES

    for package in FAMILIES.values():
        path = APP.parent / Path(*package.split(".")) / "model.py"
        imports = module_level_imports(path) - {"app.families.ops"}
        assert not imports, f"{path}: imports {sorted(imports)}"


def test_every_family_follows_the_template() -> None:
    """``__init__`` exports ``Decoder`` (from ``decode.py``), ``convert``, ``SYNTHETIC`` and
    ``init_synthetic`` (from ``synthetic.py``); ``Decoder`` has a ``forward`` of its own."""
    import importlib

    from app.families import FAMILIES
    from app.families.decoder import VAEDecoder

    for package in FAMILIES.values():
        module = importlib.import_module(package)
        for name in ("Decoder", "convert", "SYNTHETIC", "init_synthetic"):
            assert hasattr(module, name), f"{package} exports no {name}"
        assert module.Decoder.__module__ == f"{package}.decode"
        assert module.init_synthetic.__module__ == f"{package}.synthetic"
        assert module.Decoder.__name__ == "Decoder" and issubclass(module.Decoder, VAEDecoder)
        assert module.Decoder.forward is not VAEDecoder.forward, f"{package}: no forward"
        assert "__new__" not in vars(module.Decoder)
