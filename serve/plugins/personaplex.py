"""``personaplex-tiny`` (on a CPU) and ``personaplex-full`` (on an NVIDIA GPU): PersonaPlex's
sessions as the slots of one batch, each with its own voice and role.

The batch is ``models/personaplex_slots.py``'s masked loop (eager; its reference is stated in
docs/families/personaplex.md), random weights from ``seed`` at the size's configuration or a checkpoint
in the released layout (``weights``, ``models/personaplex_checkpoint.py``), ticked on
the slot scheduler's thread in the server process (``serve/runtime/slots.py``): every slot with a
frame waiting runs it, in one batched LM call, the others masked. A session is a
``PersonaPlexStream``: Moshi's stream (``serve/plugins/moshi.py``), so turns, replies, barge-in
(``cancel``), cleared input and resume behave exactly as they do for Moshi, plus ``configure``:

- ``session.update`` ``instructions`` -> the role prompt, ``voice`` -> the voice prompt
  (``personaplex_prompts.py``: the operator's named voices, a client's own WAV, ``"default"`` for
  none). An uploaded voice is usable by name only where it was uploaded: a stream opened without a
  ``client`` (every session of the service: ``serve/session/base.py``) is its own uploader, so over
  the wire a voice a session uploads (``ref_audio``) is that session's alone, resumes included, and
  is forgotten when its stream closes; the operator's named voices are every session's. The
  prompt state cache is keyed by content hash and may be shared by sessions that each uploaded
  the same WAV: a name, not a state, is what another session cannot reach.
- ``configure`` returns once the (voice, role)'s prompt state exists: primed once on a thread of
  its own while the batch ticks (the two taking turns, a tick or a prompt step at a time:
  ``personaplex_turns.py``), then found in the cache by every later session. So a session is
  ready for its persona when its ``session.updated`` arrives.
- A session's first tick joins its slot with its prompt state, copied in: the slot starts where
  the vendor's priming leaves a batch-1 session.
- **A change after the conversation started** (a frame was fed) takes effect at the slot's next
  tick: the slot joins again with the new prompt state. The conversation so far is dropped (the
  LM's context is the new prompt, and Mimi starts afresh): PersonaPlex's persona is its context,
  and a model primed with one persona cannot be turned into another without priming. A reply in
  progress goes on with the new persona's frames. ``describe()`` counts these ``rejoins``.
- The text token PersonaPlex samples with each frame it speaks is the session's transcript, as for
  Moshi (``take_text``; ``models/moshi_tokenizer.py``: the checkpoint's tokenizer, or a stand-in for random weights).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Hashable
from contextlib import ExitStack
from typing import Any

import numpy as np
import torch

from cadence_fx.models.moshi_tokenizer import TextPieces, stand_in_tokenizer

from ..runtime.slots import SlotScheduler, SlotsFull
from .base import ConfigRefused, ModelPlugin, PluginInfo
from .moshi import FRAME_SAMPLES, MoshiStream, _require_cuda
from .moshi_turns import StreamPlace, scheduler_of
from .moshi_worker import Spoken
from .personaplex_prompts import NO_VOICE, VOICE_PARAM, PromptBank, VoiceBank, WavLimits, role_tokens, stand_in_tokens
from .personaplex_turns import TICK, Turns

__all__ = ["PersonaPlexPlugin", "PersonaPlexStream"]

SAMPLE_RATE = 24_000
FRAME_SECONDS = FRAME_SAMPLES / SAMPLE_RATE  # 80 ms: a tick longer than this falls behind real time
# torch's threads in this process while the plugin is open (the caller's restored at close): a
# tick's kernels on one thread cost less than on two at the tiny size (40 ms of CPU a tick at 8
# sessions against 53), and a team of two, on cores other work shares, waits in its barriers for
# whichever thread is off its core (80 to 100 ms a tick at a load average of 4).
TORCH_THREADS = 1
SLOW_TICKS_KEPT = 1000  # the latest ticks longer than a frame that ``describe`` lists
DEVICES = {"tiny": "cpu", "full": "cuda"}
MAX_SLOTS = 64
DEFAULT_SLOTS = 8


class _Place:
    """The one place of the plugin's batch: what ``MoshiStream`` asks of a place (``StreamPlace``)."""

    index = 0

    def __init__(self) -> None:
        self.streams = 0
        self.scheduler: SlotScheduler | None = None


class PersonaPlexStream(MoshiStream):
    """Moshi's turn bookkeeping on a PersonaPlex slot, plus its persona (``configure``)."""

    _plugin: PersonaPlexPlugin  # the one plugin whose streams these are (MoshiStream's, narrowed)

    def __init__(self, plugin: PersonaPlexPlugin, place: _Place, slot: int, client: Hashable | None) -> None:
        """``client``: who may name this stream's uploads (an in-process caller's name for itself,
        shared by its streams); None: this stream alone, its uploads forgotten when it closes."""
        super().__init__(plugin, place, slot)
        self._own_uploads = client is None
        self.client: Hashable = object() if client is None else client

    def configure(self, instructions: str, voice: str) -> None:
        """The session's role prompt and voice, ready when this returns (module docstring)."""
        self._plugin._configure(self.slot, self.client, instructions, voice)

    def upload_voice(self, name: str, wav: bytes) -> None:
        """A WAV of this client's, under ``name``, usable by name by this client alone."""
        self._plugin.voices.upload(self.client, name, wav)

    def close(self) -> None:
        super().close()
        if self._own_uploads:
            self._plugin.voices.forget(self.client)


class PersonaPlexPlugin(ModelPlugin):
    """PersonaPlex at ``size`` (``tiny`` or ``full``): see the module docstring."""

    def __init__(
        self,
        *,
        size: str = "tiny",
        seed: int = 0,
        sampling: bool = True,
        slots: int | None = None,
        max_reply_frames: int = 125,
        voices: str | None = None,
        weights: str | None = None,
        prompt_rate: int = 4,
        record: bool = False,
    ) -> None:
        """``voices``: a folder of the operator's named voices (``<name>.wav`` or ``<name>.pt``;
        default: the checkpoint's ``voices/``, if any). ``weights``: a checkpoint folder in the
        released layout (``models/personaplex_checkpoint.py``; its tokenizer makes the role tokens),
        at the size's configuration; None: random weights from ``seed``.
        ``slots``: the batch (1 to ``MAX_SLOTS``; None: fixed by ``reserve`` or ``DEFAULT_SLOTS``).
        ``record`` keeps every tick's frames and joins (``history``)."""
        if size not in DEVICES:
            raise ValueError(f"unknown PersonaPlex size {size!r}; expected one of {', '.join(DEVICES)}")
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS):
            raise ValueError(f"slots must be a batch of 1 to {MAX_SLOTS} sessions, got {slots!r}")
        if max_reply_frames < 1:
            raise ValueError(f"max_reply_frames must be at least 1, got {max_reply_frames}")
        self.name, self.size, self.device = f"personaplex-{size}", size, DEVICES[size]
        if self.device == "cuda":
            _require_cuda(self.name)
        from cadence_fx.models import personaplex, personaplex_stream

        self.seed, self.sampling, self.slots, self.record = seed, sampling, slots, record
        self.max_reply_frames, self.prompt_rate = max_reply_frames, prompt_rate
        config = dataclasses.replace(personaplex_stream.TINY if size == "tiny" else personaplex_stream.FULL, seed=seed)
        if weights is None:
            self.checkpoint, self.tokenize = None, stand_in_tokens
        else:
            from cadence_fx.models.personaplex_checkpoint import PersonaPlexCheckpoint

            self.checkpoint = PersonaPlexCheckpoint.locate(weights)
            self.tokenize = self.checkpoint.tokenize
            if voices is None and self.checkpoint.voices is not None:
                voices = str(self.checkpoint.voices)
        card = config.lm_kwargs["text_card"]
        self.text = (
            TextPieces(stand_in_tokenizer(card), card, f"{self.name} (random weights)")
            if self.checkpoint is None
            else TextPieces(self.checkpoint.tokenizer, card, f"{self.name} checkpoint {weights!r}")
        )
        self.voices = VoiceBank(voices, WavLimits())  # refused before anything is built
        self._flags = ExitStack()
        self._flags.callback(torch.set_num_threads, torch.get_num_threads())
        torch.set_num_threads(TORCH_THREADS)  # before the ticking and priming threads exist: theirs too
        # The vendor's compile switch is process-wide: held off for as long as the plugin is open,
        # so the ticking thread and the priming thread never race on entering and leaving it.
        self._flags.enter_context(personaplex._vendor("utils.compile").no_compile())
        try:
            self.models = (
                personaplex_stream.build_models(config, self.device)
                if self.checkpoint is None
                else self.checkpoint.load(config, self.device)
            )
            self.turns = Turns()  # the ticks' and the priming's, one at a time
            self.prompts = PromptBank(self.models, self.turns)
        except BaseException:
            self._flags.close()
            self.voices.close()
            raise
        self._place = _Place()
        self._lock = threading.Lock()
        self._closed = False
        self.runtime: Any = None
        self._wanted: dict[int, Any] = {}  # slot -> the prompt state its stream asks for
        self._joined: dict[int, Any] = {}  # slot -> the prompt state its rows hold
        self._fed: set[int] = set()  # slots whose stream has ticked since it joined
        self.streams = self.listened = self.replied = self.silence = self.rejoins = 0
        # The batched ticks' time (the masked loop's, joins aside), wall and on the ticking thread's
        # CPU clock: against the 80 ms a frame lasts, whether the batch can keep real time.
        self.tick_seconds = self.tick_cpu_seconds = 0.0
        # Ticks (joins included) longer than a frame: (start, wall, CPU, frames, joins, a prompt
        # priming meanwhile), start on ``time.monotonic`` (the clock a load generator's replies are
        # timed on); and all ticks' wall time, apart for those that ran while a prompt was primed.
        self.slow_ticks: deque[tuple[float, float, float, int, int, bool]] = deque(maxlen=SLOW_TICKS_KEPT)
        self.tick_wall_by_priming = {False: [0, 0.0], True: [0, 0.0]}
        self.queued_at_reply_start: list[int] = []
        self._default = self.prompts.state(NO_VOICE, ())
        mimi, lm = (sum(p.numel() for p in m.parameters()) for m in (self.models.mimi, self.models.lm))
        loaded = f"random weights, seed {seed}" if weights is None else f"weights of {weights}"
        self.info = PluginInfo(
            name=self.name,
            input_rate=SAMPLE_RATE,
            output_rate=SAMPLE_RATE,
            frame_samples=FRAME_SAMPLES,
            description=(
                f"PersonaPlex {size.upper()} (Mimi {mimi / 1e6:.1f}M + LM {lm / 1e6:.1f}M parameters, "
                f"{loaded}) on {self.device}, full duplex at 12.5 frames/s, sessions as the slots "
                "of one batch (the masked loop, eager), each with its own voice and role prompt"
            ),
        )

    # -- placement ------------------------------------------------------------------------------

    def _start(self, slots: int) -> None:
        if self.runtime is not None:
            return
        from cadence_fx.models.personaplex_slots import PersonaPlexSlots

        self.slots = slots
        self.runtime = PersonaPlexSlots(self.models, slots, sampling=self.sampling, seed=self.seed, prompt_rate=self.prompt_rate)
        self._place.scheduler = SlotScheduler(slots, self._tick, name=self.name, record=self.record)

    def reserve(self, sessions: int) -> None:
        """The batch for ``sessions`` at once (the option's ``slots``, else ``sessions``), built now,
        and the default prompt state primed; refused past the slots or ``MAX_SLOTS``."""
        with self._lock:
            batch = sessions if self.slots is None else self.slots
            if sessions > min(batch, MAX_SLOTS):
                raise ValueError(
                    f"{self.name} holds {min(batch, MAX_SLOTS)} slots, not {sessions} sessions at once: "
                    f"admit at most {min(batch, MAX_SLOTS)} (a batch holds 1 to {MAX_SLOTS})"
                )
            self._start(batch)
        self._default.result()

    def open_stream(self, client: Hashable | None = None) -> PersonaPlexStream:
        """A session on a free slot; ``client``: see ``PersonaPlexStream`` (None: the stream is
        its own client, as every session of the service is)."""
        with self._lock:
            self._start(DEFAULT_SLOTS if self.slots is None else self.slots)
            scheduler = scheduler_of(self._place)
            if not scheduler.free:
                raise SlotsFull(f"{self.name}: all {self.slots} slots are taken; a session needs a free slot")
            slot = scheduler.acquire()
            self._place.streams += 1
            self.streams += 1
            self._wanted[slot] = self._default
            self._fed.discard(slot)
        return PersonaPlexStream(self, self._place, slot, client)

    def free_slots(self) -> int:
        with self._lock:
            if self.runtime is None:  # the batch is not built: every slot it will have is free
                return DEFAULT_SLOTS if self.slots is None else self.slots
            return scheduler_of(self._place).free

    def _placed_off(self, place: StreamPlace, slot: int) -> None:
        with self._lock:
            scheduler_of(place).release(slot)
            place.streams -= 1
            self._wanted.pop(slot, None)

    def _configure(self, slot: int, client: Hashable, instructions: str, voice: str) -> None:
        state = self.prompts.state(self.voices.resolve(client, voice), role_tokens(instructions, self.tokenize))
        try:
            prompt = state.result()  # primed on the bank's thread while the batch ticks
        except Exception as error:  # noqa: BLE001 - a voice file the vendor cannot read is the client's to hear about
            raise ConfigRefused(
                f"voice {voice[:64]!r} could not be primed: {type(error).__name__}: {error}", VOICE_PARAM
            ) from None
        with self._lock:
            self._wanted[slot] = state
            if slot in self._fed and self._joined.get(slot) is not prompt:
                self.rejoins += 1

    # -- ticks ---------------------------------------------------------------------------------

    def _tick(self, frames: dict[int, np.ndarray], joins: tuple[int, ...]) -> dict[int, Spoken | None]:
        """One batched tick (the scheduler's thread): each joining slot, and each whose stream asked
        for another prompt, joins with its prompt state first."""
        began, began_cpu, priming = time.monotonic(), time.thread_time(), self.prompts.priming
        with self._lock:
            wanted = self._wanted.copy()
        # Awaited before the tick's turn: a state still priming needs turns of its own.
        wanted = {slot: wanted[slot].result() for slot in frames}
        with self.turns.turn(TICK):
            outputs = self._tick_turn(frames, joins, wanted)
        whole = time.monotonic() - began
        priming |= self.prompts.priming
        self.tick_wall_by_priming[priming][0] += 1
        self.tick_wall_by_priming[priming][1] += whole
        if whole > FRAME_SECONDS:
            self.slow_ticks.append((began, whole, time.thread_time() - began_cpu, len(frames), len(joins), priming))
        return outputs

    def _tick_turn(
        self, frames: dict[int, np.ndarray], joins: tuple[int, ...], wanted: dict[int, Any]
    ) -> dict[int, Spoken | None]:
        """The tick itself, ``wanted``: each slot's prompt state."""
        runtime = self.runtime
        for slot in frames:
            if slot in joins or self._joined.get(slot) is not wanted[slot]:
                if runtime.queues[slot] is not None:
                    runtime.leave(slot)
                runtime.join(slot, prompt=wanted[slot])
                self._joined[slot] = wanted[slot]
        with self._lock:
            self._fed.update(frames)
        wall, cpu = time.perf_counter(), time.thread_time()
        outputs = runtime.tick({slot: torch.from_numpy(frame) for slot, frame in frames.items()})
        self.tick_seconds += time.perf_counter() - wall
        self.tick_cpu_seconds += time.thread_time() - cpu
        return {slot: None if out is None else (out.pcm.numpy(), int(out.tokens[0])) for slot, out in outputs.items()}

    # -- what MoshiStream counts ------------------------------------------------------------------

    def _count_reply_start(self, queued: int) -> None:
        with self._lock:
            self.queued_at_reply_start += [0] * (queued + 1 - len(self.queued_at_reply_start))
            self.queued_at_reply_start[queued] += 1

    def _count(self, listened: int = 0, replied: int = 0, silence: int = 0) -> None:
        with self._lock:
            self.listened += listened
            self.replied += replied
            self.silence += silence

    def history(self) -> list[Any]:
        scheduler = self._place.scheduler
        if scheduler is None or scheduler.history is None:
            raise ValueError(f"{self.name} keeps no history: open it with record=True (and tick it)")
        return list(scheduler.history)

    def describe(self) -> dict[str, Any]:
        scheduler = self._place.scheduler
        return {
            "model": self.name,
            "size": self.size,
            "device": self.device,
            "seed": self.seed,
            "sampling": self.sampling,
            "weights": None if self.checkpoint is None else str(self.checkpoint.directory),
            "slots": self.slots,
            "streams": self.streams,
            "max_reply_frames": self.max_reply_frames,
            "frames": {
                "ticks": 0 if scheduler is None else scheduler.frames,
                "listened": self.listened,
                "replied": self.replied,
                "silence": self.silence,
                "queued_at_reply_start": list(self.queued_at_reply_start),
            },
            "batched_ticks": 0 if scheduler is None else scheduler.ticks,
            "tick_seconds": round(self.tick_seconds, 3),
            "tick_cpu_seconds": round(self.tick_cpu_seconds, 3),
            "torch_threads": torch.get_num_threads(),
            "lm_calls": 0 if self.runtime is None else self.runtime.calls,
            "tick_wall_while_priming": {
                name: {"ticks": n, "wall_ms_per_tick": round(1e3 * seconds / n, 2) if n else None}
                for name, (n, seconds) in (("no", self.tick_wall_by_priming[False]), ("yes", self.tick_wall_by_priming[True]))
            },
            "slow_ticks": [
                {
                    "at": round(at, 3),
                    "wall_ms": round(1e3 * wall, 1),
                    "cpu_ms": round(1e3 * cpu, 1),
                    "frames": n,
                    "joins": j,
                    "priming": p,
                }
                for at, wall, cpu, n, j, p in self.slow_ticks
            ],
            "priming_spans": [[round(a, 3), round(b, 3)] for a, b in self.prompts.spans],
            "prompt_states": {"primed": self.prompts.primed, "reused": self.prompts.reused},
            # turns that waited for the other's (personaplex_turns.py): a tick for a prompt step, a step for a tick
            "turn_waits": dict(self.turns.waits),
            "rejoins": self.rejoins,
            "voices": ["default", *sorted(self.voices.named)],
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._place.scheduler is not None:
            self._place.scheduler.close()
        self.prompts.close()
        self.voices.close()
        self._flags.close()
