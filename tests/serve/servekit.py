"""Helpers for the duplex service tests: real uvicorn servers on loopback, and a client socket
that checks every event it receives against OpenAI's published GA schema."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import numpy as np
import pydantic
import soakkit as soak
from openai.types.realtime import RealtimeServerEvent

from cadence_fx.serve.access import Access
from cadence_fx.serve.app import background_server
from cadence_fx.serve.client import RealtimeSocket, read_wav
from cadence_fx.serve.plugins import ToneModel, tone
from cadence_fx.serve.protocol import PCM24K, decode_event
from cadence_fx.serve.protocol import audio as wire_audio
from cadence_fx.serve.protocol import events as ev
from cadence_fx.serve.session import Limits

AUDIO = Path(__file__).resolve().parent / "audio"  # shared/audio, kept with the tests (see its README)
GA_SCHEMA = pydantic.TypeAdapter(RealtimeServerEvent)
TIER3 = {cls.TYPE for cls in ev.EVENTS.values() if cls.TIER == 3}


def check_event(event: dict, duplex: bool) -> None:
    """Tier 1/2 events validate against the GA schema (Tier 1 connections: no extra fields at all);
    Tier 3 events decode with our codec and appear only on duplex connections."""
    if event["type"] in TIER3:
        assert duplex, f"Tier 3 event on a Realtime connection: {event['type']}"
        decode_event(json.dumps(event))
        return
    model = GA_SCHEMA.validate_python(_as_ga_formats(event) if duplex else event)
    if not duplex:
        assert not model.model_extra, f"{event['type']} has non-GA fields {sorted(model.model_extra)}"


def _as_ga_formats(event: dict) -> dict:
    """A duplex event with the formats a vLLM-Omni client may ask for (``audio/pcm`` at another
    rate, ``audio/pcm_f32le``; serve/protocol/duplex.py) in its session object read as GA's
    24 kHz ``audio/pcm``: the one value GA's schema has no room for; every other field is checked."""
    session = event.get("session")
    if not isinstance(session, dict) or not isinstance(session.get("audio"), dict):
        return event
    audio = {}
    for side, block in session["audio"].items():
        fmt = block.get("format") if isinstance(block, dict) else None
        if isinstance(fmt, dict) and fmt.get("type") in ("audio/pcm", "audio/pcm_f32le"):
            block = {**block, "format": PCM24K.to_wire()}
        audio[side] = block
    return {**event, "session": {**session, "audio": audio}}


class CheckedSocket(RealtimeSocket):
    """A RealtimeSocket that validates every event it receives and remembers it."""

    duplex = True

    def __init__(self, ws, duplex: bool) -> None:
        super().__init__(ws)
        self.duplex = duplex
        self.received: list[dict] = []

    async def recv(self, timeout: float = 5.0) -> dict:
        event = await super().recv(timeout)
        check_event(event, self.duplex)
        self.received.append(event)
        return event

    async def recv_all(self, quiet_s: float = 0.3) -> list[dict]:
        """Everything until the server has been quiet for ``quiet_s``."""
        out = []
        with contextlib.suppress(asyncio.TimeoutError):
            while True:
                out.append(await self.recv(quiet_s))
        return out

    async def update(self, session: dict) -> dict:
        await self.send({"type": "session.update", "session": {"type": "realtime", **session}})
        return (await self.recv_until("session.updated"))[-1]

    async def no_vad(self) -> dict:
        return await self.update({"audio": {"input": {"turn_detection": None}}})

    async def append(self, pcm: bytes, chunk_bytes: int = 9600) -> None:
        for i in range(0, len(pcm), chunk_bytes):
            await self.send({"type": "input_audio_buffer.append", "audio": wire_audio.b64encode(pcm[i : i + chunk_bytes])})

    async def reply_to(self, pcm: bytes, timeout: float) -> list[dict]:
        """One turn without server VAD: ``pcm`` appended and committed, a response asked for;
        every event until its ``response.done``."""
        await self.no_vad()
        await self.append(pcm)
        await self.send({"type": "input_audio_buffer.commit"})
        await self.send({"type": "response.create"})
        return await self.recv_until("response.done", timeout=timeout)


class Server:
    def __init__(self, handle) -> None:
        self.handle = handle

    async def connect(self, path: str = "/v1/duplex", created: bool = True, stalls: bool = False) -> CheckedSocket:
        """A client socket; with ``created``, past the session's opening pair: ``session.created``,
        then ``rate_limits.updated`` (kept as ``sock.rate_limits``). ``stalls``: a socket whose
        reader will stop, with a small fixed receive buffer and no compression, so that the
        server's outbound budget is what fills up (``soak.connect``)."""
        url = self.handle.ws_url + path
        ws = await soak.connect(url) if stalls else (await RealtimeSocket.connect(url)).ws
        sock = CheckedSocket(ws, duplex="duplex" in path)
        if created:
            first, second = await sock.recv(), await sock.recv()
            assert (first["type"], second["type"]) == ("session.created", "rate_limits.updated"), (first, second)
            sock.session_id = first["session"]["id"]
            sock.resume_token = first.get("resume_token")
            sock.rate_limits = second["rate_limits"]
        return sock

    def session(self, session_id: str):
        return self.handle.manager.sessions.get(session_id)

    def on_loop(self, fn):
        return self.handle.call(fn)

    def eventually(self, predicate, timeout: float = 3.0) -> bool:
        """Poll ``predicate`` on the server's loop until it holds (True) or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while not self.on_loop(predicate):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True


# Tests open many sessions from one address, and a closed duplex socket's session lingers for its
# grace period: no per-client limit unless a test asks for one.
ROOMY = Limits(max_sessions=64, max_sessions_per_client=64)


@contextlib.contextmanager
def running(limits: Limits | None = None, access: Access | None = None, **tone_options):
    with background_server(lambda: ToneModel(**tone_options), limits or ROOMY, access=access) as handle:
        yield Server(handle)


def wav_pcm(name: str) -> bytes:
    samples, _ = read_wav(AUDIO / name)
    return wire_audio.encode_samples(samples, PCM24K)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def deltas_of(events: list[dict], response_id: str | None = None) -> bytes:
    return b"".join(
        wire_audio.b64decode(e["delta"])
        for e in events
        if e["type"] == "response.output_audio.delta" and response_id in (None, e["response_id"])
    )


def tone_reply_pcm(chunks: int) -> bytes:
    return wire_audio.encode_samples(tone.render(chunks), PCM24K)


RESPONSE_HEAD = [
    "response.created",
    "response.output_item.added",
    "conversation.item.added",
    "response.content_part.added",
]
RESPONSE_TAIL = [
    "response.output_audio.done",
    "response.content_part.done",
    "response.output_item.done",
    "conversation.item.done",
    "response.done",
]
COMMIT = ["input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]


# What ``types_of`` leaves out unless asked: the audio deltas, and on a duplex connection the
# response.speak that comes once before the first of them (test_server_flow asserts where).
DELTA_TYPES = ("response.output_audio.delta", "response.speak")


def types_of(events: list[dict], skip_deltas: bool = True) -> list[str]:
    return [e["type"] for e in events if not (skip_deltas and e["type"] in DELTA_TYPES)]


def drain(stream) -> list[np.ndarray]:
    """A model stream's chunks until its reply is over."""
    chunks = []
    while (chunk := stream.step()) is not None:
        chunks.append(chunk)
    return chunks


def slot_reference(models, plugin, place: int, slot: int, session: int) -> tuple[list[np.ndarray], list]:
    """What the ``session``-th session of ``slot`` of a Moshi plugin's place sent (the plugin
    opened with ``record=True``), tick by tick, and what the vendor's own batched loop over that
    place's recorded ticks gave that slot: 1920 samples, None before its acoustic delay."""
    import torch

    from cadence_fx.models.moshi_slots import Tick, vendor_slots

    history = plugin.history(place)
    ticks = [Tick({s: torch.from_numpy(f) for s, f in r.frames.items()}, r.joins) for r in history]
    outputs = vendor_slots(models, plugin.slots, ticks, sampling=plugin.sampling, seed=plugin.seed)
    sent, got, seen = [], [], -1
    for record, out in zip(history, outputs):
        seen += slot in record.joins
        if seen == session and slot in record.frames:
            sent.append(record.frames[slot])
            row = out.slot(slot)
            got.append(None if row is None else row[1].cpu().numpy())
    return sent, got


def same(frames: list[np.ndarray], want: list[np.ndarray]) -> bool:
    """Two lists of frames, equal frame for frame, bit for bit."""
    return len(frames) == len(want) and all(np.array_equal(a, b) for a, b in zip(frames, want))


def interleaved_replies(a, b, turns: list[list[np.ndarray]], steps: int) -> tuple[list, list]:
    """Two model streams fed their turns frame by frame in alternation, their replies' first
    ``steps`` chunks taken in alternation too; both streams are closed."""
    for frame_a, frame_b in zip(*turns, strict=True):
        a.feed(frame_a)
        b.feed(frame_b)
    a.begin_response()
    b.begin_response()
    out_a, out_b = [], []
    for _ in range(steps):
        out_a.append(a.step())
        out_b.append(b.step())
    a.close()
    b.close()
    return out_a, out_b


def two_streams_are_their_slots_rows(plugin, models, turns: list[list[np.ndarray]], steps: int) -> dict:
    """Two streams of a Moshi ``plugin`` (opened with ``record=True``, nothing served yet) fed
    ``turns`` in alternation (``interleaved_replies``), then the plugin described and closed. Asserts
    that each stream sent its turn then ``steps - 1`` frames of silence (its reply opens with the
    turn's last frame), and that its replies are its slot's row of the vendor's batched loop over
    the recorded ticks, bit for bit. Returns the description."""
    from cadence_fx.serve.plugins.moshi import SILENCE

    try:
        outs = interleaved_replies(plugin.open_stream(), plugin.open_stream(), turns, steps)
        described = plugin.describe()
    finally:
        plugin.close()
    for slot, (turn, out) in enumerate(zip(turns, outs, strict=True)):
        sent, got = slot_reference(models, plugin, place=0, slot=slot, session=0)
        assert same(sent, turn + [SILENCE] * (steps - 1)), slot
        assert same(out, got[len(turn) - 1 : len(turn) - 1 + steps]), slot
    return described


def silence(ms: int, rate: int = 24_000) -> bytes:
    return np.zeros(rate * ms // 1000, dtype="<i2").tobytes()


class TalkingTone(ToneModel):
    """The tone model with a text source: each chunk says its number (serve/runtime/text.py)."""

    def open_stream(self):
        stream = super().open_stream()
        step, said = stream.step, []

        def counted_step():
            chunk = step()
            said.append(f" w{len(said)}" if chunk is not None else "")
            return chunk

        stream.step = counted_step
        stream.take_text = lambda: said[-1]
        return stream
