"""The package's import layout (docs/families.md): no import circle anywhere under ``app/``;
every family's ``decoder/model.py`` imports nothing of the service but the shared layers (``ops``,
``attention``), its ``encoder/model.py`` nothing but those, the encoder base
(``app.families.encoder``) and its own family's ``decoder/model.py``; every family package
exports its ``FAMILY`` descriptor, keyed by its package name.

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


def _package_dirs() -> list[tuple[str, Path]]:
    """(package name, folder) of every family of the service (``app.families.PACKAGES``)."""
    from app.families import PACKAGES

    assert PACKAGES, "no families"
    return [(package, APP / "families" / package) for package in PACKAGES]


SHARED_LAYERS = {"app.families.ops", "app.families.attention"}


def test_family_models_import_only_shared_layers() -> None:
    for _, folder in _package_dirs():
        path = folder / "decoder" / "model.py"
        imports = module_level_imports(path) - SHARED_LAYERS
        assert not imports, f"{path}: imports {sorted(imports)}"


def test_encoder_models_import_only_shared_layers_and_their_decoder_model() -> None:
    shared = SHARED_LAYERS | {"app.families.encoder"}
    for package, folder in _package_dirs():
        path = folder / "encoder" / "model.py"
        if not path.exists():
            continue  # a decoder-only family
        allowed = shared | {f"app.families.{package}.decoder.model"}
        imports = module_level_imports(path) - allowed
        assert not imports, f"{path}: imports {sorted(imports)}"


def test_every_family_exports_its_descriptor() -> None:
    """``app/families/<package>/__init__`` exports ``FAMILY``, keyed by the package name with
    '-' for '_', whose parts are the sub-packages' own classes and functions."""
    import importlib

    from app.families import family, key_of
    from app.families.descriptor import Family

    for package, folder in _package_dirs():
        module = importlib.import_module(f"app.families.{package}")
        described = module.FAMILY
        assert isinstance(described, Family), f"{package}: FAMILY is not a Family"
        assert described.key == key_of(package) == package.replace("_", "-")
        assert family(described.key) is described
        parts = {"decoder": described.decoder, "encoder": described.encoder}
        for part, given in parts.items():
            if not (folder / part).is_dir():
                assert given is None, f"{package}: a {part} without a {part}/ package"
                continue
            sub = importlib.import_module(f"app.families.{package}.{part}")
            cls = sub.Decoder if part == "decoder" else sub.Encoder
            assert given is not None, f"{package}: its {part}/ is not in FAMILY"
            assert given.module is cls and given.convert is sub.convert, package
            assert given.init_synthetic is sub.init_synthetic, package
            assert cls.family == described.key  # set by the descriptor
        for name, recipe in described.synthetic.items():
            assert recipe.config, f"{package}: {name} has no decoder config"


def test_every_family_follows_the_template() -> None:
    """Each ``decoder/`` (``encoder/``) sub-package exports ``Decoder`` from ``decode.py``
    (``Encoder`` from ``encode.py``), ``convert``, ``SYNTHETIC`` and ``init_synthetic`` (from
    ``synthetic.py``); ``Decoder`` has a ``forward`` of its own and no ``__new__``."""
    import importlib

    from app.families.decoder import VAEDecoder
    from app.families.encoder import VAEEncoder

    for package, folder in _package_dirs():
        for part, cls_name, own, base in (
            ("decoder", "Decoder", "decode", VAEDecoder),
            ("encoder", "Encoder", "encode", VAEEncoder),
        ):
            if part == "encoder" and not (folder / part).is_dir():
                continue
            name = f"app.families.{package}.{part}"
            module = importlib.import_module(name)
            for export in (cls_name, "convert", "SYNTHETIC", "init_synthetic"):
                assert hasattr(module, export), f"{name} exports no {export}"
            cls = getattr(module, cls_name)
            assert cls.__module__ == f"{name}.{own}"
            assert module.init_synthetic.__module__ == f"{name}.synthetic"
            assert cls.__name__ == cls_name and issubclass(cls, base)
            assert "__new__" not in vars(cls)
            if part == "decoder":
                assert cls.forward is not VAEDecoder.forward, f"{name}: no forward"
