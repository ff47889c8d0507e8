"""The one module that imports vendor model packages, and says clearly what is missing.

MiniCPM-o 4.5 Token2Wav comes from PyPI ``minicpmo-utils==1.0.6`` (module ``stepaudio2``). Only
the flow (``stepaudio2.cosyvoice2``) and the HiFT vocoder (``stepaudio2.flashcosyvoice``) are
used here; they need ``einops`` and ``scipy`` besides torch. Importing any ``stepaudio2`` module
first runs ``stepaudio2/__init__.py``, which imports ``stepaudio2/token2wav.py``, which imports
``torchaudio``, ``s3tokenizer``, ``onnxruntime``, ``hyperpyyaml`` and (through
``flashcosyvoice/utils/audio.py``) ``librosa`` at module level, although only prompt preparation
and model-directory loading use them. No torchaudio wheel loads beside CPU torch 2.13, so each
of those modules that does not import cleanly is replaced by an inert placeholder in
``sys.modules``; touching anything on a placeholder raises :class:`PlaceholderUsed` naming the
missing module, the vendor code that needs it and the real import error.

Install (never with the package's own dependencies: they pin torchaudio, old transformers,
pillow and librosa)::

    pip install --no-deps minicpmo-utils==1.0.6 einops==0.8.1    # scipy>=1.10 must be present

Importing the vendor's ``upsample_encoder_v2`` sets ``torch._dynamo.config.suppress_errors =
True`` and ``cache_size_limit = 128`` process-wide; :func:`token2wav_vendor` restores both, so a
failing ``torch.compile`` arm fails loudly instead of silently running eager.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

__all__ = [
    "MINICPMO_UTILS",
    "PROMPT_ONLY_IMPORTS",
    "PlaceholderUsed",
    "PromptOnlyImport",
    "Token2WavVendor",
    "VendorDiT",
    "VendorFlow",
    "VendorMissing",
    "VendorPackage",
    "hift_generator_class",
    "flow_classes",
    "placeholders",
    "register_placeholder",
    "require",
    "token2wav_vendor",
]


@dataclass(frozen=True)
class VendorPackage:
    distribution: str
    version: str
    module: str
    requires: tuple[str, ...]
    install: str
    pinned_because: str = ""


MINICPMO_UTILS = VendorPackage(
    distribution="minicpmo-utils",
    version="1.0.6",
    module="stepaudio2",
    requires=("einops", "scipy"),
    install="pip install --no-deps minicpmo-utils==1.0.6 einops==0.8.1 'scipy>=1.10'",
    pinned_because="1.0.6 has the HiFT vocoder that draws RNG on every call; 1.0.7 pre-draws noise tables",
)


class VendorMissing(ImportError):
    """A vendor package (or one of the modules its model code needs) is absent or the wrong version."""


class PlaceholderUsed(AttributeError):
    """Something touched a prompt-only module that was replaced by a placeholder.

    An AttributeError, so ``hasattr``/``getattr(..., default)`` probes see an empty module instead
    of crashing; any real use raises with the reason.
    """


@dataclass(frozen=True)
class PromptOnlyImport:
    module: str
    names: tuple[str, ...]
    used_by: str


# `names` are the attributes the vendor binds with `from module import name` while importing;
# they exist on the placeholder as callables that raise when called.
PROMPT_ONLY_IMPORTS = (
    PromptOnlyImport(
        "torchaudio.compliance.kaldi",
        (),
        "stepaudio2/token2wav.py Token2wav._prepare_prompt (kaldi.fbank, torchaudio.load, Resample) "
        "and Token2wav.__call__ (torchaudio.save)",
    ),
    PromptOnlyImport(
        "s3tokenizer",
        (),
        "stepaudio2/token2wav.py Token2wav.__init__ and _prepare_prompt (speech tokenizer of the prompt wav)",
    ),
    PromptOnlyImport(
        "onnxruntime",
        (),
        "stepaudio2/token2wav.py Token2wav.__init__ (campplus speaker model); "
        "cosyvoice2/flow/flow_matching.py imports it without using it",
    ),
    PromptOnlyImport("hyperpyyaml", ("load_hyperpyyaml",), "stepaudio2/token2wav.py Token2wav.__init__ (reading flow.yaml)"),
    PromptOnlyImport(
        "librosa.filters",
        ("mel",),
        "stepaudio2/flashcosyvoice/utils/audio.py mel_spectrogram (prompt mel, Token2wav._prepare_prompt)",
    ),
)


class _Placeholder(types.ModuleType):
    def __init__(self, name: str, reason: str) -> None:
        super().__init__(name, f"cadence-fx placeholder for {name}: {reason}")
        self.__cadence_placeholder__ = reason
        self.__spec__ = importlib.machinery.ModuleSpec(name, None, origin="cadence-fx placeholder")

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise PlaceholderUsed(f"{self.__name__}.{attr} is unavailable: {self.__cadence_placeholder__}")


def _raising(qualname: str, reason: str) -> Callable[..., Any]:
    def missing(*args: Any, **kwargs: Any) -> Any:
        raise PlaceholderUsed(f"{qualname}() is unavailable: {reason}")

    missing.__name__ = missing.__qualname__ = qualname.rsplit(".", 1)[-1]
    return missing


def _purge(root: str) -> None:
    for name in [m for m in sys.modules if m == root or m.startswith(root + ".")]:
        del sys.modules[name]


def register_placeholder(spec: PromptOnlyImport) -> bool:
    """Import ``spec.module``; if that fails, register a placeholder chain for it. True if placeholder."""
    try:
        importlib.import_module(spec.module)
        return False
    except Exception as error:  # a wheel built for another torch fails with OSError, not ImportError
        failure = f"{type(error).__name__}: {error}"
    reason = (
        f"{spec.module} did not import ({failure}); cadence-fx registered a placeholder because only "
        f"prompt preparation needs it: {spec.used_by}. Install it to prepare prompts from audio."
    )
    parts = spec.module.split(".")
    _purge(parts[0])
    parent = None
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        module = _Placeholder(name, reason)
        if depth < len(parts):
            module.__path__ = []
        sys.modules[name] = module
        if parent is not None:
            setattr(parent, parts[depth - 1], module)
        parent = module
    for attr in spec.names:
        setattr(parent, attr, _raising(f"{spec.module}.{attr}", reason))
    return True


def placeholders() -> dict[str, str]:
    """Placeholder modules registered in this process: module name -> reason."""
    return {name: module.__cadence_placeholder__ for name, module in sys.modules.items() if isinstance(module, _Placeholder)}


def require(package: VendorPackage) -> None:
    """Raise VendorMissing unless ``package`` is installed at exactly its version, with its requires."""
    try:
        found = importlib.metadata.version(package.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise VendorMissing(
            f"{package.distribution}=={package.version} (module {package.module}) is not installed; "
            f"install it with: {package.install}"
        ) from None
    if found != package.version:
        raise VendorMissing(
            f"{package.distribution} {found} is installed but cadence-fx needs exactly {package.version}"
            + (f" ({package.pinned_because})" if package.pinned_because else "")
            + f"; install it with: {package.install}"
        )
    absent = [name for name in package.requires if importlib.util.find_spec(name) is None]
    if absent:
        raise VendorMissing(
            f"{package.distribution}'s flow and vocoder import {', '.join(absent)}, which "
            f"{'is' if len(absent) == 1 else 'are'} not installed; install with: {package.install}"
        )


# stepaudio2 ships no type information, so an instance of its classes is checked as Any: these
# names say which class a value is, and the attributes the code reads on it are the vendor's.
#: ``stepaudio2.cosyvoice2.flow.flow.CausalMaskedDiffWithXvec``: its ``setup_cache`` and
#: ``inference_chunk``, ``up_rate``, ``encoder`` and ``decoder`` (the CFM, whose ``estimator`` is a DiT).
VendorFlow: TypeAlias = Any
#: ``stepaudio2.cosyvoice2.flow.decoder_dit.DiT``: its blocks, cache buffers and CUDA-graph tables.
VendorDiT: TypeAlias = Any


@dataclass(frozen=True)
class Token2WavVendor:
    """The vendor classes and helpers MiniCPM-o 4.5 Token2Wav streaming is built from."""

    version: str
    root: Path
    flow: type  # stepaudio2.cosyvoice2.flow.flow.CausalMaskedDiffWithXvec
    encoder: type  # stepaudio2.cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2
    estimator: type  # stepaudio2.cosyvoice2.flow.decoder_dit.DiT
    cfm: type  # stepaudio2.cosyvoice2.flow.flow_matching.CausalConditionalCFM
    hift: type  # stepaudio2.flashcosyvoice.modules.hifigan.HiFTGenerator
    fade_in_out: Callable[..., Any]  # stepaudio2.token2wav.fade_in_out


@functools.cache
def token2wav_vendor() -> Token2WavVendor:
    """Import minicpmo-utils' streaming Token2Wav pieces, registering placeholders first.

    The streaming API (``setup_cache``/``inference_chunk``) lives in ``stepaudio2.cosyvoice2``,
    which is what ``stepaudio2.token2wav.Token2wav`` builds from flow.yaml; the
    ``stepaudio2.flashcosyvoice`` flow has no streaming API and only its HiFT is used.
    """
    require(MINICPMO_UTILS)
    for spec in PROMPT_ONLY_IMPORTS:
        register_placeholder(spec)
    import torch._dynamo

    dynamo_config = torch._dynamo.config
    saved = (dynamo_config.suppress_errors, dynamo_config.cache_size_limit)
    try:
        flow = importlib.import_module("stepaudio2.cosyvoice2.flow.flow")
        flow_matching = importlib.import_module("stepaudio2.cosyvoice2.flow.flow_matching")
        decoder_dit = importlib.import_module("stepaudio2.cosyvoice2.flow.decoder_dit")
        encoder = importlib.import_module("stepaudio2.cosyvoice2.transformer.upsample_encoder_v2")
        hifigan = importlib.import_module("stepaudio2.flashcosyvoice.modules.hifigan")
        token2wav = importlib.import_module("stepaudio2.token2wav")
    except ImportError as error:
        raise VendorMissing(
            f"{MINICPMO_UTILS.distribution}=={MINICPMO_UTILS.version} failed to import "
            f"({type(error).__name__}: {error}); install with: {MINICPMO_UTILS.install}"
        ) from error
    finally:
        dynamo_config.suppress_errors, dynamo_config.cache_size_limit = saved
    assert token2wav.__file__ is not None  # a module imported from its .py file
    return Token2WavVendor(
        version=MINICPMO_UTILS.version,
        root=Path(token2wav.__file__).parent,
        flow=flow.CausalMaskedDiffWithXvec,
        encoder=encoder.UpsampleConformerEncoderV2,
        estimator=decoder_dit.DiT,
        cfm=flow_matching.CausalConditionalCFM,
        hift=hifigan.HiFTGenerator,
        fade_in_out=token2wav.fade_in_out,
    )


def flow_classes() -> tuple[type, type, type, type]:
    """(CausalMaskedDiffWithXvec, UpsampleConformerEncoderV2, DiT, CausalConditionalCFM)."""
    vendor = token2wav_vendor()
    return vendor.flow, vendor.encoder, vendor.estimator, vendor.cfm


def hift_generator_class() -> type:
    """HiFTGenerator of minicpmo-utils 1.0.6 (draws device RNG on every call)."""
    return token2wav_vendor().hift
