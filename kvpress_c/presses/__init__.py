"""Presses: kvpress names and arguments, computed in C. Each also accepts budget= (tokens kept per
KV head per layer, the papers' convention) instead of compression_ratio=.

One file per press: every module of this folder is imported here and the press classes it defines
(subclasses of BasePress whose names end in "Press") are exported, so a new press is its file alone."""
import importlib
import pkgutil

from .base import BasePress, ScorerPress, press_params


def _discover() -> dict:
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_") or info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for name, obj in vars(module).items():
            if (isinstance(obj, type) and issubclass(obj, BasePress) and obj.__module__ == module.__name__
                    and name.endswith("Press") and not name.startswith("_")):
                found[name] = obj
    return found


_PRESSES = _discover()
globals().update(_PRESSES)

__all__ = ["BasePress", "ScorerPress", "press_params", *sorted(_PRESSES)]
