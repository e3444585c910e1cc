"""The families: one package each, ``app/families/<package>/`` (docs/families.md), exporting its
``FAMILY`` descriptor (``family.Family``). Everything that knows families (the store, the
command line, previews, the runtime's device choices, the benches, the GPU proof) derives from
the descriptors: a family is added as one folder and one line in ``PACKAGES``.

A family's key is its package name with '-' for '_' (``hunyuan_video`` -> ``hunyuan-video``):
manifests, the command line and metrics spell it so, and the descriptor's modules take it.
"""

from __future__ import annotations

import importlib
from functools import cache
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.families.descriptor import Family

PACKAGES: tuple[str, ...] = (
    "flux",
    "hunyuan_video",
    "ltx",
    "minimax_h3",
    "taesd",
    "wan",
)
# families registered at run time by module path (the tests' stand-ins), by key
_REGISTERED: dict[str, str] = {}


def key_of(package: str) -> str:
    return package.replace("_", "-")


def keys() -> list[str]:
    """Every family's key, without importing any (no torch)."""
    return [key_of(p) for p in PACKAGES] + list(_REGISTERED)


def family(key: str) -> Family:
    """One family's descriptor; ``KeyError`` names the known ones."""
    module = _module_of(key)
    if module is None:
        raise KeyError(f"unknown family {key!r}; known: {', '.join(keys())}")
    return _load(module, key)


def families() -> MappingProxyType[str, Family]:
    """Every family's descriptor, by key."""
    return MappingProxyType({key: family(key) for key in keys()})


def register(key: str, module: str) -> None:
    """Make the ``FAMILY`` of ``module`` known as ``key`` in this process (test stand-ins)."""
    _REGISTERED[key] = module


def unregister(key: str) -> None:
    _REGISTERED.pop(key, None)


def _module_of(key: str) -> str | None:
    if key in _REGISTERED:
        return _REGISTERED[key]
    package = key.replace("-", "_")
    return f"app.families.{package}" if package in PACKAGES and key == key_of(package) else None


@cache
def _load(module: str, key: str) -> Family:
    found = importlib.import_module(module).FAMILY
    if found.key != key:
        raise KeyError(f"{module} describes family {found.key!r}, registered as {key!r}")
    return found
