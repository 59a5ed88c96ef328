"""Model and data set names that stand for local folders, built on first use by a package above the library.

The library resolves such a name here and never imports the package that knows it: the tiny world (tiny/)
registers its model names (`tiny`, `tiny-sft`, ...) and data set names (`synthetic:shapes`, ...) when it is
imported, as every script does. A name no resolver knows, and any path, comes back unchanged.

    from utils.core import names
    names.register(model=resolve_my_model, dataset=resolve_my_dataset)   # each: name -> folder, or the name
    names.resolve_dataset("synthetic:shapes")                            # -> outputs/tiny-cache/shapes-...
"""

from __future__ import annotations

from typing import Callable

_RESOLVERS: dict[str, list[Callable[[str], str]]] = {"model": [], "dataset": []}


def register(*, model: Callable[[str], str] | None = None, dataset: Callable[[str], str] | None = None):
    """Add a resolver of model names and/or one of data set names: `resolver(name)` returns the folder of a name
    it knows (building it if needed) and any other name unchanged. Registering the same resolver twice is a no-op."""
    for kind, resolver in (("model", model), ("dataset", dataset)):
        if resolver is None:
            continue
        if not callable(resolver):
            raise TypeError(f"names.register: the {kind} resolver must be callable, got {type(resolver).__name__}")
        if resolver not in _RESOLVERS[kind]:
            _RESOLVERS[kind].append(resolver)


def _resolve(kind: str, name):
    for resolver in _RESOLVERS[kind]:
        resolved = resolver(name)
        if resolved != name:
            return resolved
    return name


def resolve_model(name):
    """The folder a registered model name stands for (built on first use); any other name or path unchanged."""
    return _resolve("model", name)


def resolve_dataset(name):
    """The folder a registered data set name stands for (built on first use); any other name or path unchanged."""
    return _resolve("dataset", name)
