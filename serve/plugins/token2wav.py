"""``token2wav-full`` and ``token2wav``: MiniCPM-o 4.5's speech back end as the reply voice.

What runs. Token2Wav (the flow: conformer encoder and a 10-step CFM over a DiT; then the HiFT
vocoder) from minicpmo-utils 1.0.6, transformed by cadence-fx
(``transform((flow, hift), contract)``, ``models/token2wav_carry.py``): carries at the derived
bounds and, on a GPU, the CFM loop, the conformer encoder and HiFT replayed as CUDA graphs (the
SRc arm of ``bench/token2wav.py``). ``token2wav-full`` is the MiniCPM-o 4.5 configuration on a
CUDA device; ``token2wav`` is the reduced depth (1 + 1 conformer blocks, 2 DiT blocks) on the CPU,
for tests and for trying the mapping without a GPU. It does not keep real time there.

Weights. By default the weights are random (the reduced or the full configuration) and so is the
prompt state. ``weights`` (``--weights``) loads a published checkpoint instead, from a folder or
a hub id (``models/token2wav_checkpoint.py``), at the size its flow.yaml describes: the full
MiniCPM-o 4.5 flow on ``token2wav-full``; on the CPU (``token2wav``) whatever size it is.
``prompt`` (``--prompt``) is the speaker prompt: a prompt file written by ``cadence-fx prompt``,
or a WAV prepared at start-up by the vendor's own code (needs the prompt packages and CUDA); with
weights and no prompt, the model's reference voice (``assets/system_ref_audio.wav``) is prepared.
The contract follows the loaded flow's depth and the prompt's length.

What it says. In MiniCPM-o the LLM writes the speech tokens (25 a second) that Token2Wav turns
into 24 kHz speech. The LLM is not part of this plugin (no weights can be downloaded here), so a
reply's tokens come from a stand-in: a seeded pseudo-random token stream, one per stream and turn
(``token_seed``). The user's audio only sets the reply's length: as many 1-second chunks as the
turn has whole seconds, at least ``MIN_REPLY_CHUNKS`` and at most ``max_reply_chunks``. The
minimum comes from the contract: its catalog has the flushing last chunk only at the full cache
extent (``56@402``), which a reply's third chunk reaches. Each chunk is the vendor's streaming
step (``Token2wav.stream``): 28 tokens (25 + 3 look-ahead) to 50 mel frames to 24,000 samples; the
reply's last chunk flushes the tail (``last_chunk=True``). Every reply starts from the prompt state
(``reset_turn``), as a new utterance does in the vendor.

Sessions, on lanes. The plugin runs its streams on L replay lanes (``lanes``, ``serve --lanes``;
``cadence_fx.lanes``): each lane is one host thread and one CUDA stream with its own transformed
flow (its own weights' copy, captured graphs, graph pool, carries and prompt state), so the lanes'
chunks run at the same time on one GPU. A new stream goes to the lane with the fewest open streams
(the lowest index among them) and stays there. Inside a lane, streams take turns over its graphs:
each stream owns a ``SessionState`` (its carries' contents and extents and its RNG state, seeded
with ``rng_seed``) and a ``CarryStream`` (its cache dict and HiFT cache); a chunk swaps its state
in, runs, and swaps it out, on the lane's thread (``TransformedFlow.swap_in`` / ``swap_out``).
HiFT draws noise every call from the process's one generator, so its calls, from every lane, go
through one ``RngSection`` from the stream's own generator state. A stream's audio is the stock
vendor stream of its tokens from its seed, bit for bit, whichever lane it runs on and whatever runs
beside it. ``DEFAULT_LANES``: 8 on ``token2wav-full`` (on an H200, 8 lanes kept 24 streams in real
time in the capacity benchmark, ``bench/results/token2wav_lanes8.json``), 1 on the CPU.

Admission. ``reserve(sessions)`` (the server's session limit, at start-up) gives each lane room
for ``ceil(sessions / lanes)`` streams; ``free_slots`` is the room left over all lanes, which the
server's ``/health`` and ``rate_limits.updated`` report, and ``open_stream`` raises ``SlotsFull``
when no lane has room. Before ``reserve`` (the plugin used without a server) a lane's room is not
bounded.

Start-up. Construction builds the flow, makes the lanes, and warms each lane in turn before any
session: the prompt state, then one reply of ``WARM_UP_CHUNKS`` chunks, which certifies and
captures every catalog class the service uses, so no session's chunk pays for a capture. Each
lane prints a line of progress on stderr as it finishes; ``describe`` reports the start-up time.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cadence_fx import transform
from cadence_fx.determinism import pin_deterministic
from cadence_fx.lanes import Lane, RngSection
from cadence_fx.models import token2wav_checkpoint as checkpoint
from cadence_fx.models.token2wav_carry import (
    CarryStream,
    TransformedFlow,
    contract_for_flow,
    reference_flow,
)
from cadence_fx.models.token2wav_stream import Prompt, build_hift, random_chunks, random_prompt
from cadence_fx.models.vendor import VendorFlow
from cadence_fx.multiplex import SessionState

from .base import ModelPlugin, ModelStream, PluginInfo, SlotsFull, add_counters

INPUT_RATE = 24_000
FRAME_SAMPLES = 1_920  # 80 ms; the plugin only counts the user's samples
OUTPUT_RATE = 24_000
CHUNK_SAMPLES = 24_000  # one chunk: 25 tokens, 50 mel frames, 1 s
MIN_REPLY_CHUNKS = 3
WARM_UP_CHUNKS = 4  # extents 302, 352, 402, then the flush at 402: every class of the catalog
WARM_UP_SEED = 999_999  # tokens and RNG of the warm-up reply, which no session hears
DEPTHS = {"full": "cuda", "reduced": "cpu"}
# Replay lanes when ``lanes`` is not given: on an H200, 8 lanes kept 24 streams in real time
# (bench/results/token2wav_lanes8.json); on the CPU, eager, lanes only add threads.
DEFAULT_LANES = {"full": 8, "reduced": 1}


def token_seed(stream: int, turn: int) -> int:
    """The seed of the stand-in token stream of a stream's turn (both counted from 0)."""
    return 1_000 * stream + turn


def rng_seed(seed: int, stream: int) -> int:
    """The seed of a stream's RNG state (HiFT draws noise every call)."""
    return seed + stream


def reply_chunks(turn_samples: int, max_reply_chunks: int) -> int:
    """Chunks in the reply to a turn of ``turn_samples`` input samples."""
    return min(max_reply_chunks, max(MIN_REPLY_CHUNKS, turn_samples // INPUT_RATE))


class TurnInput:
    """The user's side of a stream, which both of the plugin's streams (a lane's, a row's) keep: the
    samples of the turn so far, which set the length of its reply (the plugin only counts them)."""

    def __init__(self) -> None:
        self.samples = 0

    def feed(self, frame: np.ndarray) -> None:
        if frame.shape != (FRAME_SAMPLES,) or frame.dtype != np.float32:
            raise ValueError(f"a frame is float32 of shape ({FRAME_SAMPLES},), got {frame.dtype} of shape {frame.shape}")
        self.samples += FRAME_SAMPLES

    def clear(self) -> None:
        self.samples = 0

    def take_reply_chunks(self, max_reply_chunks: int) -> int:
        """The reply's length in chunks; the next turn counts from zero."""
        n = reply_chunks(self.samples, max_reply_chunks)
        self.samples = 0
        return n


class ReplayLane:
    """One lane of the plugin (module docstring): a ``Lane`` (host thread, CUDA stream), its own
    transformed flow, and the streams assigned to it."""

    def __init__(self, index: int, transformed: TransformedFlow, lane: Lane) -> None:
        self.index = index
        self.transformed = transformed
        self.lane = lane
        self.room: int | None = None  # streams it may hold (``reserve``); None: not bounded
        self.streams = 0  # open streams assigned here (under the plugin's lock)
        self.served = 0  # streams ever assigned here
        self.chunks = 0  # session chunks run here (counted on the lane's thread)
        self.warm_s = 0.0  # the warm-up's seconds: prompt state, then every class certified and captured
        self.captured = 0  # classes captured by the warm-up

    def run(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the lane's thread and stream; waits for it (and its device work)."""
        return self.lane.submit(fn, *args).result()

    def free(self) -> int | None:
        return None if self.room is None else self.room - self.streams


class Token2WavStream(ModelStream):
    """One session's stream, on one lane: every device call runs on that lane's thread."""

    def __init__(self, plugin: Token2WavPlugin, index: int, lane: ReplayLane) -> None:
        self._plugin = plugin
        self.index = index
        self.lane = lane
        self.turn = 0
        self.input = TurnInput()
        self._stream: CarryStream | None = None  # made on the lane's thread, at the first reply
        self._state: SessionState | None = None
        self._tokens: list[torch.Tensor] = []
        self._next = 0
        self._closed = False

    def feed(self, frame: np.ndarray) -> None:
        self.input.feed(frame)

    def clear_input(self) -> None:
        self.input.clear()

    def begin_response(self) -> None:
        n = self.input.take_reply_chunks(self._plugin.max_reply_chunks)
        self.lane.run(self._begin, n, self.turn)
        self.turn += 1

    def _begin(self, n: int, turn: int) -> None:
        """On the lane's thread: the reply's tokens, and the stream back at the prompt state."""
        plugin, transformed = self._plugin, self.lane.transformed
        self._tokens = random_chunks(token_seed(self.index, turn), n, device=plugin.device)
        self._next = 0
        if self._stream is None or self._state is None:
            self._stream, self._state = plugin.session(self.lane, rng_seed(plugin.seed, self.index))
            return  # a new session starts at the prompt state
        transformed.swap_in(self._state, rng=False)
        self._stream.reset_turn()  # the prompt state, written into the carries in place
        transformed.swap_out(self._state, rng=False)

    def step(self) -> np.ndarray | None:
        if self._next >= len(self._tokens):
            self._tokens = []
            return None
        i = self._next
        self._next += 1
        return self.lane.run(self._chunk, self._tokens[i], i == len(self._tokens) - 1)

    def _chunk(self, tokens: torch.Tensor, last_chunk: bool) -> np.ndarray:
        """On the lane's thread: one chunk of the reply, over the lane's graphs."""
        transformed, stream, state = self.lane.transformed, self._stream, self._state
        if stream is None or state is None:
            raise RuntimeError(f"stream {self.index}: a chunk before its reply began")
        transformed.swap_in(state, rng=False)
        out = stream.step(tokens, last_chunk=last_chunk)
        transformed.swap_out(state, rng=False)
        self.lane.chunks += 1
        return out.speech.float().reshape(-1).cpu().numpy()

    def cancel(self) -> None:
        self._tokens = []

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.lane.run(self._release)
            self._plugin.placed_off(self.lane)

    def _release(self) -> None:
        """On the lane's thread: the stream's device state is freed where its device work ran."""
        self._stream, self._state, self._tokens = None, None, []


def _is_wav(prompt: str | Path | None) -> bool:
    """A prompt given as audio, to prepare, rather than as a saved prompt file."""
    return prompt is not None and Path(prompt).suffix.lower() == ".wav"


def check_settings(depth: str, max_reply_chunks: int) -> tuple[str, torch.device]:
    """The served model's name and device for ``depth``, refusing what cannot run; on CUDA the
    determinism envelope is pinned for the process's life (a stream is bit-exact against
    deterministic eager)."""
    if depth not in DEPTHS:
        raise ValueError(f"depth must be one of {sorted(DEPTHS)}, got {depth!r}")
    if max_reply_chunks < MIN_REPLY_CHUNKS:
        raise ValueError(
            f"max_reply_chunks must be at least {MIN_REPLY_CHUNKS} (the catalog's first flush), got {max_reply_chunks}"
        )
    name = "token2wav-full" if depth == "full" else "token2wav"
    device = torch.device(DEPTHS[depth])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"{name} runs MiniCPM-o 4.5's Token2Wav at full size on a CUDA device, and "
            "torch.cuda.is_available() is False here; `token2wav` is the reduced depth on the CPU"
        )
    if device.type == "cuda":
        pin_deterministic()
    return name, device


def build_models(
    depth: str, device: torch.device, seed: int, weights: str | Path | None, prompt: str | Path | None
) -> tuple[VendorFlow, torch.nn.Module, Prompt, str]:
    """The flow, HiFT and speaker prompt the plugin serves (module docstring, Weights), checked
    to fit, and a few words on what they are."""
    if weights is None:
        flow, hift, loaded = _random(depth, device, seed, prompt)
        what = f"{depth} depth, random weights"
    else:
        flow, hift, loaded = _loaded(device, seed, weights, prompt)
        what = f"weights from {weights}"
    checkpoint.prompt_frames_fit(loaded, flow.up_rate, str(prompt or "the prompt"))
    return flow, hift, loaded, what


def _random(depth: str, device: torch.device, seed: int, prompt: str | Path | None) -> tuple[VendorFlow, torch.nn.Module, Prompt]:
    """The reference flow at this depth with random weights; a random prompt unless a prompt
    file is given (a WAV needs the checkpoint's speech tokenizer and speaker model)."""
    if _is_wav(prompt):
        raise ValueError(
            f"--prompt {prompt} is a WAV; preparing it needs the checkpoint's speech tokenizer "
            "and speaker model: pass --weights too, or a prompt file written by `cadence-fx prompt`"
        )
    loaded = None if prompt is None else checkpoint.load_prompt(prompt, device=device)
    tokens = None if loaded is None else loaded.tokens.shape[1]
    flow, _, tokens = reference_flow(depth, prompt_tokens=tokens)
    if loaded is None:
        loaded = random_prompt(seed, n_tokens=tokens, device=device)
    return flow.to(device), build_hift(device=device), loaded


def _loaded(
    device: torch.device, seed: int, weights: str | Path, prompt: str | Path | None
) -> tuple[VendorFlow, torch.nn.Module, Prompt]:
    """A published checkpoint's flow and HiFT; the prompt from its file, or prepared from a WAV
    (the model's reference voice when none is given)."""
    from_audio = prompt is None or _is_wav(prompt)
    files = checkpoint.STREAM_FILES + (checkpoint.PROMPT_FILES if from_audio else ())
    found = checkpoint.locate_checkpoint(weights, files, reference_voice=prompt is None)
    if prompt is not None and not from_audio:
        loaded = checkpoint.load_prompt(prompt, device=device)
    else:
        voice = prompt if prompt is not None else found.reference_voice
        assert voice is not None  # locate_checkpoint refuses a checkpoint without it when asked
        loaded = checkpoint.prepare_prompt(found, voice).to(device)
    flow = checkpoint.load_flow(found, seed=seed, device=device)
    return flow, checkpoint.load_hift(found, device=device), loaded


class Token2WavPlugin(ModelPlugin):
    def __init__(
        self,
        depth: str = "full",
        *,
        seed: int = 0,
        max_reply_chunks: int = 8,
        weights: str | Path | None = None,
        prompt: str | Path | None = None,
        lanes: int | None = None,
    ) -> None:
        started = time.perf_counter()
        name, self.device = check_settings(depth, max_reply_chunks)
        lanes = DEFAULT_LANES[depth] if lanes is None else lanes
        if not isinstance(lanes, int) or isinstance(lanes, bool) or lanes < 1:
            raise ValueError(f"lanes must be a positive integer (replay lanes, each its own copy of the flow), got {lanes!r}")
        self.depth, self.seed, self.max_reply_chunks = depth, seed, max_reply_chunks
        self.weights = None if weights is None else str(weights)
        flow, hift, self.prompt, what = build_models(depth, self.device, seed, weights, prompt)
        contract = contract_for_flow(flow, self.prompt.mels.shape[1])
        self.info = PluginInfo(
            name=name,
            input_rate=INPUT_RATE,
            output_rate=OUTPUT_RATE,
            frame_samples=FRAME_SAMPLES,
            description=f"MiniCPM-o 4.5 Token2Wav ({what}) transformed by cadence-fx, on stand-in speech tokens",
        )
        self._lock = threading.Lock()  # the lanes' stream counts and the plugin's
        self.streams = 0
        self.rng = RngSection(self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # built on the default stream, which the lanes' streams do not wait for
        with torch.no_grad():  # a lane's thread runs in the grad mode of the thread that made it
            threads = [Lane(f"{name}-lane{k}", self.device) for k in range(lanes)]
        # Each lane's flow is transformed (its graphs captured) on the lane's own thread: lanes whose
        # graphs were captured on one thread hung when replaying at once (``cadence_fx.lanes``).
        try:
            self.lanes = [
                ReplayLane(k, thread.submit(transform, (flow, hift), contract).result()[0], thread)
                for k, thread in enumerate(threads)
            ]
        except BaseException:
            for thread in threads:
                thread.close()
            raise
        del flow, hift  # each lane holds its own copy (the flow's around the same weights, its buffers its own)
        for lane in self.lanes:
            lane.run(self._warm, lane)
            eager = " (a CPU captures none: every class runs eager)" if self.device.type == "cpu" else ""
            print(
                f"{name}: lane {lane.index + 1}/{lanes} warm: {lane.captured} classes captured{eager} in {lane.warm_s:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        self.startup_s = time.perf_counter() - started
        print(f"{name}: {lanes} lane(s) warm; start-up took {self.startup_s:.1f} s", file=sys.stderr, flush=True)

    def session(self, lane: ReplayLane, seed: int) -> tuple[CarryStream, SessionState]:
        """On ``lane``'s thread: a stream's carry loop and state at the prompt state (the lane's
        first one computes it), HiFT's draws through the plugin's ``RngSection`` from the state's
        own generator state, which ``seed`` gives."""
        transformed = lane.transformed
        stream = CarryStream(transformed, self.prompt)
        if transformed.base is None:
            stream.setup()  # the prompt state every reply on this lane starts from, kept by the lane
        else:
            stream.reset_turn()
        state = transformed.session_state(seed)
        assert transformed.hift is not None  # transformed with the plugin's HiFT
        stream.hift = functools.partial(self.rng.call, state, transformed.hift)
        return stream, state

    def _warm(self, lane: ReplayLane) -> None:
        """On ``lane``'s thread: the prompt state, then a reply that runs every class of the catalog."""
        started = time.perf_counter()
        stream, _ = self.session(lane, WARM_UP_SEED)
        tokens = random_chunks(WARM_UP_SEED, WARM_UP_CHUNKS, device=self.device)
        for i, chunk in enumerate(tokens):
            stream.step(chunk, last_chunk=i == WARM_UP_CHUNKS - 1)
        lane.captured = sum(engine.counters.captures for engine in lane.transformed.report.replays.values())
        lane.warm_s = time.perf_counter() - started

    def reserve(self, sessions: int) -> None:
        """Room for ``sessions`` streams: ``ceil(sessions / lanes)`` on each lane; refused when a
        lane already holds more open streams than that."""
        room = -(-sessions // len(self.lanes))
        with self._lock:
            crowded = [lane.index for lane in self.lanes if lane.streams > room]
            if crowded:
                raise ValueError(
                    f"{self.info.name}: lanes {crowded} already hold more than {room} streams, the room "
                    f"{sessions} sessions over {len(self.lanes)} lanes give each"
                )
            for lane in self.lanes:
                lane.room = room
        print(
            f"{self.info.name}: room for {sessions} sessions, {room} on each of {len(self.lanes)} lane(s)",
            file=sys.stderr,
            flush=True,
        )

    def free_slots(self) -> int | None:
        """Streams the lanes still have room for (None before ``reserve``: not bounded)."""
        with self._lock:
            free = [lane.free() for lane in self.lanes]
        bounded = [room for room in free if room is not None]
        return None if len(bounded) < len(free) else sum(bounded)

    def open_stream(self) -> Token2WavStream:
        """On the lane with the fewest open streams (the lowest index among them) that has room;
        ``SlotsFull`` when none has."""
        with self._lock:
            open_lanes = [lane for lane in self.lanes if lane.free() != 0]
            if not open_lanes:
                raise SlotsFull(
                    f"{self.info.name}: every lane holds its {self.lanes[0].room} streams "
                    f"({len(self.lanes)} lanes); a session needs a lane with room"
                )
            lane = min(open_lanes, key=lambda lane: lane.streams)
            lane.streams += 1
            lane.served += 1
            stream = Token2WavStream(self, self.streams, lane)
            self.streams += 1
        return stream

    def placed_off(self, lane: ReplayLane) -> None:
        """A stream on ``lane`` closed: its room is free."""
        with self._lock:
            lane.streams -= 1

    def describe(self) -> dict[str, Any]:
        replays: dict[str, dict[str, Any]] = {}
        for lane in self.lanes:
            for name, engine in lane.transformed.report.replays.items():
                add_counters(replays.setdefault(name, {}), engine.counters.as_dict())
        with self._lock:
            lanes = [
                {
                    "lane": lane.index,
                    "streams_open": lane.streams,
                    "streams_served": lane.served,
                    "room": lane.room,
                    "chunks": lane.chunks,
                    "warm_seconds": round(lane.warm_s, 2),
                    "classes_captured": lane.captured,
                }
                for lane in self.lanes
            ]
            streams = self.streams
        return {
            "model": self.info.name,
            "depth": self.depth,
            "weights": self.weights or "random",
            "device": str(self.device),
            "streams": streams,
            "streams_open": sum(lane["streams_open"] for lane in lanes),
            "chunks": sum(lane["chunks"] for lane in lanes),
            "startup_seconds": round(self.startup_s, 2),
            "lanes": lanes,
            "lanes_used": sum(1 for lane in lanes if lane["chunks"]),  # lanes that ran a session's chunk
            "rng_section_calls": self.rng.calls,
            "stamps": list(self.lanes[0].transformed.report.stamps),
            "replays": replays,
        }

    def close(self) -> None:
        for lane in self.lanes:
            lane.lane.close()
