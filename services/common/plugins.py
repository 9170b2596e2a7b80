"""Plugins named by import path (--custom-rm-path, --data-buffer-class, --eval-function-path, ...):
one importer, whose error names the flag and its value, and `maybe_await` for a sync or async plugin's answer."""

from __future__ import annotations

import importlib
import inspect
from typing import Any


def load_object(path: str, what: str) -> Any:
    """Import `module.attr` (or `module:attr`), with an error that names the flag's value."""
    module_name, sep, attr = path.replace(":", ".").rpartition(".")
    if not sep or not module_name:
        raise ValueError(f"{what} {path!r} is not an import path of the form package.module.name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r}: {e}") from e
    except SystemExit as e:  # a module that runs a program on import must not end the process importing it
        raise ValueError(f"{what} {path!r}: importing {module_name!r} exited ({e.code!r})") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}") from None


async def maybe_await(x: Any) -> Any:
    """A plugin's answer, awaited when it is awaitable (a plugin may be sync or async)."""
    return await x if inspect.isawaitable(x) else x
