"""Model plugins. A real model plugin registers itself here with ``register_plugin``.

``moshi-tiny`` (Moshi at its TINY size on a CPU, ``moshi.py``) is the service's default model;
``moshi-small`` is the same plugin at the SMALL size (more than 2 cores for 8 sessions) and
``moshi-full`` at Moshi 7B's own size on an NVIDIA GPU (it refuses to load without one). All three
load torch and the vendor only when chosen. ``token2wav-full`` is MiniCPM-o 4.5's Token2Wav at full
size on an NVIDIA GPU as a reply voice on stand-in speech tokens (``token2wav.py``), ``token2wav``
the same at reduced depth on the CPU; both load a published checkpoint with ``weights`` and a
speaker prompt with ``prompt``. ``tone`` is a test double used by the service's tests, not a model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import ModelPlugin, ModelStream, PluginInfo
from .tone import ToneModel

PluginFactory = Callable[..., ModelPlugin]

DEFAULT_PLUGIN = "moshi-tiny"


def _moshi(size: str) -> PluginFactory:
    def build(**options: Any) -> ModelPlugin:
        from .moshi import MoshiPlugin

        return MoshiPlugin(size=size, **options)

    return build


def _token2wav(depth: str) -> PluginFactory:
    def build(**options: Any) -> ModelPlugin:
        from .token2wav import Token2WavPlugin

        return Token2WavPlugin(depth, **options)

    return build


_REGISTRY: dict[str, PluginFactory] = {
    "tone": ToneModel,
    "moshi-tiny": _moshi("tiny"),
    "moshi-small": _moshi("small"),
    "moshi-full": _moshi("full"),
    "token2wav": _token2wav("reduced"),
    "token2wav-full": _token2wav("full"),
}


# Options a user may set from the command line (`cadence-fx serve --weights/--prompt`), per plugin.
_USER_OPTIONS: dict[str, frozenset[str]] = {
    "token2wav": frozenset({"weights", "prompt"}),
    "token2wav-full": frozenset({"weights", "prompt"}),
}


def register_plugin(name: str, factory: PluginFactory, user_options: frozenset[str] = frozenset()) -> None:
    _REGISTRY[name] = factory
    _USER_OPTIONS[name] = user_options


def plugin_names() -> list[str]:
    return sorted(_REGISTRY)


def load_plugin(name: str, **options: Any) -> ModelPlugin:
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model plugin {name!r}; known: {', '.join(plugin_names())}") from None
    return factory(**options)


def check_user_options(name: str, options: dict[str, Any]) -> None:
    """Refuse a command-line option the plugin does not take, naming the plugins that take it."""
    allowed = _USER_OPTIONS.get(name, frozenset())
    for option in sorted(set(options) - allowed):
        takers = sorted(n for n, names in _USER_OPTIONS.items() if option in names)
        raise ValueError(f"--{option} is not an option of --model {name}; the models that take it: {', '.join(takers)}")


__all__ = [
    "DEFAULT_PLUGIN",
    "ModelPlugin",
    "ModelStream",
    "PluginInfo",
    "ToneModel",
    "check_user_options",
    "load_plugin",
    "plugin_names",
    "register_plugin",
]
