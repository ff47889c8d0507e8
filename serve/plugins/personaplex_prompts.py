"""PersonaPlex's voices and roles in the service: what a session's ``voice`` and ``instructions``
become, and the prompt states they are turned into once.

- **Roles.** ``instructions`` is the role prompt: wrapped in ``<system>`` tags as the vendor's
  ``offline.py`` wraps it, then tokenized by the checkpoint's tokenizer. With random weights there
  is none, so the tokens are a stand-in: the wrapped text's UTF-8 bytes, each plus 4 (above the
  vendor's padding codes). At most ``MAX_ROLE_TOKENS``.
- **Voices.** ``"default"`` is no voice prompt (the vendor's own default when none is loaded).
  Named voices are the operator's prompt files, shared by every client: a folder given as the
  plugin option ``voices``, each ``<name>.wav`` (stepped as ``load_voice_prompt`` steps a WAV) or
  ``<name>.pt`` (the vendor's saved embeddings, replayed as ``load_voice_prompt_embeddings`` does).
  A client may also give a WAV of its own (``VoiceBank.upload``): checked against ``WavLimits``
  and refused by name, keyed by its content's SHA-256, and usable by name only by the client that
  gave it (over the wire, a client is one session: ``personaplex.py``). Another client naming it
  is refused as for a name that does not exist, with why: the refusal neither confirms nor denies
  that someone else uploaded a voice of that name (its name is its content's hash).
- **Prompt states.** A (voice, role) is primed once, by the vendor's own priming on a batch-1
  ``LMGen`` of its own (greedy: priming draws nothing that stays, `models/personaplex_prompt.py`),
  on a thread of its own so the batch keeps ticking (the two taking turns, a tick or a prompt
  step at a time: ``personaplex_turns.py``), and captured; every later session with that
  (voice, role) copies the state into its slot. The cache is keyed by the voice's content hash
  (a named voice's file bytes, an upload's bytes) and the role's tokens.
"""

from __future__ import annotations

import copy
import hashlib
import io
import itertools
import os
import tempfile
import threading
import wave
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .base import ConfigRefused
from .personaplex_turns import PRIME, Turns

__all__ = ["MAX_ROLE_TOKENS", "PromptBank", "VoiceBank", "WavLimits", "role_tokens"]

MAX_ROLE_TOKENS = 1024
VOICE_PARAM = "session.audio.output.voice"


def _quoted(name: str) -> str:
    """A client's name in a message: at most 64 characters of it."""
    return repr(name[:64]) + ("..." if len(name) > 64 else "")


def stand_in_tokens(text: str) -> list[int]:
    """Random weights' role tokens: the wrapped text's UTF-8 bytes, each plus 4."""
    from cadence_fx.models.personaplex_stream import role_prompt

    return [4 + byte for byte in role_prompt(text).encode("utf-8")]


def role_tokens(instructions: str, tokenize: Callable[[str], list[int]] = stand_in_tokens) -> tuple[int, ...]:
    """A role prompt's tokens (``tokenize``: a checkpoint's tokenizer, else the stand-in); refused
    past ``MAX_ROLE_TOKENS``. No instructions: no role prompt."""
    if not instructions:
        return ()
    tokens = tuple(int(t) for t in tokenize(instructions))
    if len(tokens) > MAX_ROLE_TOKENS:
        raise ConfigRefused(
            f"session.instructions is {len(tokens)} tokens as a role prompt; PersonaPlex takes at most {MAX_ROLE_TOKENS}",
            "session.instructions",
        )
    return tokens


@dataclass(frozen=True)
class WavLimits:
    """What a client's voice WAV may be: RIFF/WAVE, 16-bit PCM, mono or stereo, at most
    ``max_bytes`` and ``max_seconds``, at least ``min_seconds``."""

    max_bytes: int = 4 * 1024 * 1024
    max_seconds: float = 30.0
    min_seconds: float = 0.5

    def check(self, data: bytes, name: str) -> float:
        """The WAV's duration in seconds, or a refusal naming what is wrong and what was expected."""
        where = f"voice {_quoted(name)}"
        if len(data) > self.max_bytes:
            raise ConfigRefused(f"{where} is {len(data)} bytes; a voice WAV is at most {self.max_bytes}", VOICE_PARAM)
        if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
            raise ConfigRefused(f"{where} is not a WAV file (RIFF/WAVE header expected)", VOICE_PARAM)
        try:
            with wave.open(io.BytesIO(data)) as wav:
                width, channels, rate, frames = wav.getsampwidth(), wav.getnchannels(), wav.getframerate(), wav.getnframes()
        except (wave.Error, EOFError) as error:
            raise ConfigRefused(f"{where} is not a 16-bit PCM WAV file ({error})", VOICE_PARAM) from None
        if width != 2 or channels not in (1, 2):
            raise ConfigRefused(
                f"{where} is {8 * width}-bit with {channels} channels; a voice WAV is 16-bit PCM, mono or stereo", VOICE_PARAM
            )
        seconds = frames / rate
        if not self.min_seconds <= seconds <= self.max_seconds:
            raise ConfigRefused(
                f"{where} lasts {seconds:.2f} s; a voice WAV lasts {self.min_seconds:g} to {self.max_seconds:g} s", VOICE_PARAM
            )
        return seconds


@dataclass(frozen=True)
class Voice:
    """A voice prompt: its cache key (``sha256:`` of its bytes, or ``""`` for none) and where the
    vendor reads it from (a WAV, or saved embeddings)."""

    key: str
    wav: str | None = None
    embeddings: str | None = None


NO_VOICE = Voice("")


class VoiceBank:
    """The operator's named voices (shared) and each client's uploads (its own)."""

    def __init__(self, folder: str | None, limits: WavLimits = WavLimits()) -> None:
        self.limits = limits
        self.named: dict[str, Voice] = {}
        if folder is not None:
            if not os.path.isdir(folder):
                raise ValueError(
                    f"voices: {folder!r} is not a folder (expected a folder of <name>.wav or <name>.pt voice prompt files)"
                )
            for entry in sorted(os.listdir(folder)):
                name, ext = os.path.splitext(entry)
                path = os.path.join(folder, entry)
                if ext not in (".wav", ".pt") or name == "default":
                    continue
                if name in self.named:
                    raise ValueError(f"voices: {name!r} is both {name}.wav and {name}.pt in {folder!r}; keep one")
                with open(path, "rb") as file:
                    key = "sha256:" + hashlib.sha256(file.read()).hexdigest()
                self.named[name] = Voice(key, wav=path) if ext == ".wav" else Voice(key, embeddings=path)
        self._uploads: dict[tuple[Hashable, str], Voice] = {}  # (client, name) -> the client's voice
        self._files = tempfile.TemporaryDirectory(prefix="personaplex-voices-")
        self._lock = threading.Lock()

    def upload(self, client: Hashable, name: str, data: bytes) -> Voice:
        """A client's WAV under ``name``, for that client alone; its file written once per content."""
        if not name or name == "default" or name in self.named:
            raise ConfigRefused(
                f"voice {_quoted(name)} is taken (the operator's voices and 'default'); name an uploaded voice otherwise",
                VOICE_PARAM,
            )
        self.limits.check(data, name)
        digest = hashlib.sha256(data).hexdigest()
        path = os.path.join(self._files.name, f"{digest}.wav")
        with self._lock:
            if not os.path.exists(path):
                with open(path, "wb") as file:
                    file.write(data)
            voice = Voice(f"sha256:{digest}", wav=path)
            self._uploads[(client, name)] = voice
        return voice

    def resolve(self, client: Hashable, name: str) -> Voice:
        """The voice ``client`` names: ``default``, an operator's, or one ``client`` uploaded."""
        if name == "default":
            return NO_VOICE
        with self._lock:
            voice = self.named.get(name) or self._uploads.get((client, name))
        if voice is None:
            known = ", ".join(["default", *sorted(self.named)])
            raise ConfigRefused(
                f"voice {_quoted(name)} is not a voice this client may use: the server's voices are {known}; an "
                "uploaded voice (ref_audio) is usable by name only by the client that uploaded it (a session and its resumes)",
                VOICE_PARAM,
            )
        return voice

    def forget(self, client: Hashable) -> None:
        """A client's uploads, gone with its last session (the cached prompt states stay, by hash)."""
        with self._lock:
            for key in [key for key in self._uploads if key[0] == client]:
                del self._uploads[key]

    def close(self) -> None:
        self._files.cleanup()


class PromptBank:
    """Prompt states by (voice key, role tokens), each primed once on the bank's own thread."""

    def __init__(self, models: Any, turns: Turns | None = None) -> None:
        """``turns``: shared with the batch's ticks (``personaplex_turns.py``), each prompt step a
        turn; None: priming runs whenever its thread does."""
        from cadence_fx.models.personaplex_stream import lm_gen

        self.turns = turns

        weights = {id(t): t for m in (models.mimi, models.lm) for t in itertools.chain(m.parameters(), m.buffers())}
        self.models = copy.deepcopy(models, weights)
        self.gen = lm_gen(self.models.lm, sampling=False)
        self._streaming = [self.models.mimi.streaming(1), self.gen.streaming(1)]
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="personaplex-prompts")
        self._thread.submit(self._enter).result()
        self._states: dict[tuple[str, tuple[int, ...]], Future] = {}
        self._lock = threading.Lock()
        self.primed = 0  # prompt states made (cache misses)
        self.reused = 0  # prompt states found made
        # When each priming ran (``time.monotonic``, start and end): what the batch's ticks shared
        # the CPU with; ``priming`` says whether one runs now.
        self.spans: deque[tuple[float, float]] = deque(maxlen=1000)  # the latest
        self.priming = False

    def _enter(self) -> None:
        import torch

        torch.set_grad_enabled(False)
        for context in self._streaming:
            context.__enter__()

    def state(self, voice: Voice, role: tuple[int, ...]) -> Future:
        key = (voice.key, role)
        with self._lock:
            future = self._states.get(key)
            if future is None:
                future = self._thread.submit(self._prime, voice, role)
                self._states[key] = future
                self.primed += 1
            else:
                self.reused += 1
        return future

    def _prime(self, voice: Voice, role: tuple[int, ...]) -> Any:
        import time

        from cadence_fx.models.personaplex_prompt import capture, prime

        start, self.priming = time.monotonic(), True
        turns = self.turns
        if turns is not None:
            turns.enter(PRIME)
        try:
            prime(
                self.models.mimi,
                self.gen,
                text_prompt_tokens=role,
                voice_prompt=voice.wav,
                voice_prompt_embeddings=voice.embeddings,
                checkpoint=None if turns is None else lambda: turns.step(PRIME),
            )
            return capture(self.gen, voice=voice.key, role=role)
        finally:
            if turns is not None:
                turns.leave(PRIME)
            self.priming = False
            self.spans.append((start, time.monotonic()))

    def close(self) -> None:
        def leave() -> None:
            for context in reversed(self._streaming):
                context.__exit__(None, None, None)

        self._thread.submit(leave).result()
        self._thread.shutdown(wait=True)
