"""Model plugins: one ``PluginSpec`` record per served model, in ``SPECS``.

``moshi-tiny`` (Moshi at its TINY size on a CPU, ``moshi.py``) is the service's default model;
``moshi-small`` is the same plugin at the SMALL size (more than 2 cores for 8 sessions) and
``moshi-full`` at Moshi 7B's own size on an NVIDIA GPU (it refuses to load without one).
``personaplex-tiny`` (CPU) and ``personaplex-full`` (an NVIDIA GPU) are PersonaPlex's sessions as
the slots of one batch, each with its own voice and role (``personaplex.py``). ``token2wav-full``
is MiniCPM-o 4.5's Token2Wav at full size on an NVIDIA GPU as a reply voice on stand-in speech
tokens (``token2wav.py``; with ``slots``, its sessions as the rows of one batch, ``token2wav_rows.py``),
``token2wav`` the same at reduced depth on the CPU. All of them load
torch and the vendor only when chosen; what each takes (weights, a prompt, slots, lanes) is
its record's. What a session's stream does beyond the seam (text, a client's voice) it says
itself: ``take_text`` (``serve/runtime/text.py``), ``upload_voice`` (the duplex ``ref_audio``). ``tone`` is a test double used
by the service's tests, not a
model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
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
        raise ValueError(f"{plugin.__name__} takes no option {', '.join(map(repr, unknown))}; its options: {', '.join(accepted)}")


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
        if options.get("slots") is not None:  # the sessions as the rows of one batch (token2wav_rows.py)
            if options.get("lanes") is not None:
                raise ValueError("token2wav: slots (the sessions as the rows of one batch) has no replay lanes: give one")
            from .token2wav_rows import Token2WavRowsPlugin

            _known_options(Token2WavRowsPlugin, "depth", options)
            return Token2WavRowsPlugin(depth, **options)
        from .token2wav import Token2WavPlugin

        _known_options(Token2WavPlugin, "depth", options)
        return Token2WavPlugin(depth, **options)

    return build


@dataclass(frozen=True)
class PluginSpec:
    """One served model: its ``name`` (``serve --model``), the ``factory`` that builds its plugin
    from the options (loading torch and the vendor only then), and what it takes, which the CLI
    reads to pass its flags on or refuse them by name. Adding a served model is its plugin module
    and one record in ``SPECS``; nothing else lists models."""

    name: str
    factory: PluginFactory
    loads_weights: bool = False  # takes ``weights=``: a checkpoint directory or hub repo id (``serve --weights``)
    takes_prompt: bool = False  # takes ``prompt=``: Token2Wav's speaker prompt (``serve --prompt``)
    has_slots: bool = False  # ticks its sessions as a batch's slots, of the size ``slots=`` (``serve --slots``)
    has_lanes: bool = False  # runs its sessions on replay lanes, as many as ``lanes=`` (``serve --lanes``)


SPECS: tuple[PluginSpec, ...] = (
    PluginSpec("tone", ToneModel),
    *(PluginSpec(f"moshi-{size}", _moshi(size), loads_weights=True, has_slots=True) for size in ("tiny", "small", "full")),
    *(PluginSpec(f"personaplex-{size}", _personaplex(size), loads_weights=True, has_slots=True) for size in ("tiny", "full")),
    PluginSpec("token2wav", _token2wav("reduced"), loads_weights=True, takes_prompt=True, has_slots=True, has_lanes=True),
    PluginSpec("token2wav-full", _token2wav("full"), loads_weights=True, takes_prompt=True, has_slots=True, has_lanes=True),
)

_REGISTRY: dict[str, PluginSpec] = {spec.name: spec for spec in SPECS}


def register_plugin(spec: PluginSpec) -> None:
    """A served model added at run time (a test's, an outside package's): one record, as in ``SPECS``."""
    _REGISTRY[spec.name] = spec


def plugin_names() -> list[str]:
    return sorted(_REGISTRY)


def plugin_spec(name: str) -> PluginSpec:
    """The record of served model ``name``; an unknown name is refused, naming the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model plugin {name!r}; known: {', '.join(plugin_names())}") from None


def loads_weights(name: str) -> bool:
    """Whether plugin ``name`` loads a checkpoint given as ``weights``."""
    return plugin_spec(name).loads_weights


def takes_prompt(name: str) -> bool:
    """Whether plugin ``name`` takes a speaker prompt given as ``prompt``."""
    return plugin_spec(name).takes_prompt


def has_slots(name: str) -> bool:
    """Whether plugin ``name`` ticks its sessions as a batch's slots, of the size given as ``slots``."""
    return plugin_spec(name).has_slots


def has_lanes(name: str) -> bool:
    """Whether plugin ``name`` runs its sessions on replay lanes, as many as given as ``lanes``."""
    return plugin_spec(name).has_lanes


def load_plugin(name: str, **options: Any) -> ModelPlugin:
    return plugin_spec(name).factory(**options)


__all__ = [
    "ConfigRefused",
    "DEFAULT_PLUGIN",
    "ModelPlugin",
    "ModelStream",
    "PluginInfo",
    "PluginSpec",
    "SPECS",
    "SlotsFull",
    "ToneModel",
    "has_lanes",
    "has_slots",
    "load_plugin",
    "loads_weights",
    "plugin_names",
    "plugin_spec",
    "register_plugin",
    "takes_prompt",
]
