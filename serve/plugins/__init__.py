"""Model plugins. A real model plugin registers itself here with ``register_plugin``.

``moshi-small`` (Moshi at its SMALL size on a CPU, ``moshi.py``) is the service's default model;
it loads torch and the vendor only when chosen. ``tone`` is a test double used by the service's
tests, not a model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import ModelPlugin, ModelStream, PluginInfo
from .tone import ToneModel

PluginFactory = Callable[..., ModelPlugin]

DEFAULT_PLUGIN = "moshi-small"


def _moshi_small(**options: Any) -> ModelPlugin:
    from .moshi import MoshiPlugin

    return MoshiPlugin(**options)


_REGISTRY: dict[str, PluginFactory] = {"tone": ToneModel, DEFAULT_PLUGIN: _moshi_small}


def register_plugin(name: str, factory: PluginFactory) -> None:
    _REGISTRY[name] = factory


def plugin_names() -> list[str]:
    return sorted(_REGISTRY)


def load_plugin(name: str, **options: Any) -> ModelPlugin:
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model plugin {name!r}; known: {', '.join(plugin_names())}") from None
    return factory(**options)


__all__ = [
    "DEFAULT_PLUGIN",
    "ModelPlugin",
    "ModelStream",
    "PluginInfo",
    "ToneModel",
    "load_plugin",
    "plugin_names",
    "register_plugin",
]
