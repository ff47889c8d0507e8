"""Model plugins. A real model plugin registers itself here with ``register_plugin``.

``moshi-tiny`` (Moshi at its TINY size on a CPU, ``moshi.py``) is the service's default model;
``moshi-small`` is the same plugin at the SMALL size (more than 2 cores for 8 sessions) and
``moshi-full`` at Moshi 7B's own size on an NVIDIA GPU (it refuses to load without one). All three
load torch and the vendor only when chosen, and load a published checkpoint instead of random
weights when given ``weights`` (``loads_weights``). ``token2wav-full`` is MiniCPM-o 4.5's Token2Wav at full
size on an NVIDIA GPU as a reply voice on stand-in speech tokens (``token2wav.py``), ``token2wav``
the same at reduced depth on the CPU; both load a published checkpoint too, take a speaker
prompt as ``prompt`` (``takes_prompt``) and run their sessions on replay lanes, as many as
``lanes`` (``has_lanes``). ``personaplex-tiny`` (CPU) and ``personaplex-full`` (an NVIDIA GPU) are
PersonaPlex's sessions as the slots of one batch, each with its own voice and role
(``personaplex.py``; its batch size and voices are plugin options). ``tone`` is a test double used by the service's tests, not
a model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from .base import ConfigRefused, ModelPlugin, ModelStream, PluginInfo, SlotsFull
from .tone import ToneModel

PluginFactory = Callable[..., ModelPlugin]

DEFAULT_PLUGIN = "moshi-tiny"


def _known_options(plugin: type, fixed: str, options: dict[str, Any]) -> None:
    """Refuse, by name, an option the plugin does not take (``fixed`` is the one its name sets)."""
    accepted = [name for name in inspect.signature(plugin).parameters if name != fixed]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"{plugin.__name__} takes no option {', '.join(map(repr, unknown))}; "
                         f"its options: {', '.join(accepted)}")


def _moshi(size: str) -> PluginFactory:
    def build(**options: Any) -> ModelPlugin:
        from .moshi import MoshiPlugin

        _known_options(MoshiPlugin, "size", options)
        return MoshiPlugin(size=size, **options)

    return build


def _personaplex(size: str) -> PluginFactory:
    def build(**options: Any) -> ModelPlugin:
        from .personaplex import PersonaPlexPlugin

        _known_options(PersonaPlexPlugin, "size", options)
        return PersonaPlexPlugin(size=size, **options)

    return build


def _token2wav(depth: str) -> PluginFactory:
    def build(**options: Any) -> ModelPlugin:
        from .token2wav import Token2WavPlugin

        _known_options(Token2WavPlugin, "depth", options)
        return Token2WavPlugin(depth, **options)

    return build


_REGISTRY: dict[str, PluginFactory] = {
    "tone": ToneModel,
    "moshi-tiny": _moshi("tiny"),
    "moshi-small": _moshi("small"),
    "moshi-full": _moshi("full"),
    "personaplex-tiny": _personaplex("tiny"),
    "personaplex-full": _personaplex("full"),
    "token2wav": _token2wav("reduced"),
    "token2wav-full": _token2wav("full"),
}


#: The plugins that take ``weights=`` (a checkpoint directory or hub repo id: ``serve --weights``).
_LOADS_WEIGHTS = {"moshi-tiny", "moshi-small", "moshi-full", "token2wav", "token2wav-full"}
#: The plugins that take ``prompt=`` (Token2Wav's speaker prompt: ``serve --prompt``).
_TAKES_PROMPT = {"token2wav", "token2wav-full"}
#: The plugins that tick their sessions as the slots of a batch and take its size as ``slots=``
#: (``serve --slots``).
_HAS_SLOTS = {"moshi-tiny", "moshi-small", "moshi-full"}
#: The plugins that run their sessions on replay lanes and take how many as ``lanes=``
#: (``serve --lanes``).
_HAS_LANES = {"token2wav", "token2wav-full"}


def register_plugin(name: str, factory: PluginFactory, *, loads_weights: bool = False) -> None:
    _REGISTRY[name] = factory
    if loads_weights:
        _LOADS_WEIGHTS.add(name)


def plugin_names() -> list[str]:
    return sorted(_REGISTRY)


def loads_weights(name: str) -> bool:
    """Whether plugin ``name`` loads a checkpoint given as ``weights``."""
    return name in _LOADS_WEIGHTS


def takes_prompt(name: str) -> bool:
    """Whether plugin ``name`` takes a speaker prompt given as ``prompt``."""
    return name in _TAKES_PROMPT


def has_slots(name: str) -> bool:
    """Whether plugin ``name`` ticks its sessions as a batch's slots, of the size given as ``slots``."""
    return name in _HAS_SLOTS


def has_lanes(name: str) -> bool:
    """Whether plugin ``name`` runs its sessions on replay lanes, as many as given as ``lanes``."""
    return name in _HAS_LANES


def load_plugin(name: str, **options: Any) -> ModelPlugin:
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model plugin {name!r}; known: {', '.join(plugin_names())}") from None
    return factory(**options)


__all__ = [
    "ConfigRefused",
    "DEFAULT_PLUGIN",
    "ModelPlugin",
    "ModelStream",
    "PluginInfo",
    "SlotsFull",
    "ToneModel",
    "has_lanes",
    "has_slots",
    "load_plugin",
    "loads_weights",
    "plugin_names",
    "register_plugin",
    "takes_prompt",
]
