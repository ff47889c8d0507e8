"""Load generator: many concurrent sessions streaming audio in real time, with wire-level
accounting of every input byte and every output sample (bench/serve_load.py, tests). A test
kit, not part of the installed service: bench/serve_load.py puts tests/serve/ on its path.

Each session turns server VAD on (barge-in off, so turns never race their replies), streams its
audio in fixed chunks at real-time pace, commits whatever is left at the end, and closes. From
the events alone it checks that every appended byte was committed and that every response's
audio arrived contiguous, in order, and as long as ``response.done`` says.

Whether the server keeps real time shows in two figures per reply: the time from the append that
ended the user's turn to the reply's first audio delta, and the **stall**: how long a client that
starts playing the reply at its first delta, with no further buffering, would wait for audio it
should already be playing, all its waits together (0 when every delta arrives before its play
time), and when the last of those waits ended (``Reply.stall_at``).

Each session also times its start, from the moment it opens its WebSocket (``start``):

- ``session.created`` (``start_to_created_s``);
- **ready** (``start_to_ready_s``): the ``session.updated`` that answers the session's first
  ``session.update`` (its turn detection and, if given, its ``persona``: ``instructions`` and
  ``voice``). The server answers it only once the session's configuration is applied; a model
  with a persona (PersonaPlex) applies it only once the (voice, role)'s prompt state exists, so
  this is the wire's "ready": no other event marks the prompt phase done. The session streams no
  audio before it is ready, as a client that waits for its persona would;
- its first reply's first audio delta (``start_to_first_audio_s``): ready, plus the user's first
  turn (the audio up to where the server VAD ends it), plus the reply's latency.

Its synchronisation (``barrier``) is a ``session.update`` that changes nothing (only its
``type``), answered in order: it never sets ``instructions`` or ``voice``, so it never primes a
persona again.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from cadence_fx.serve.client import RealtimeSocket
from cadence_fx.serve.protocol import PCM24K
from cadence_fx.serve.protocol import audio as wire_audio


@dataclass
class Reply:
    response_id: str
    turn_bytes: int  # input bytes of the turn it answers
    audio: bytearray = field(default_factory=bytearray)
    offsets_contiguous: bool = True
    done_samples: int | None = None
    status: str | None = None
    first_delta_at: float | None = None
    # Playback from the first delta on, with no further buffering: how long the client waited in all
    # (each late delta delays the rest of the playback, so its lateness against the schedule set by
    # the first delta is every wait so far, summed; the largest such lateness is the reply's total).
    stall_s: float = 0.0
    stall_at: float | None = None  # when the delta that made ``stall_s`` arrived (``time.monotonic``)

    def take(self, delta: bytes, offset: int, now: float) -> None:
        """One audio delta (PCM16 at 24 kHz) arriving at ``now``."""
        self.offsets_contiguous &= offset == len(self.audio) // 2
        if self.first_delta_at is None:
            self.first_delta_at = now
        else:
            due = self.first_delta_at + len(self.audio) // 2 / PCM24K.rate
            if now - due > self.stall_s:
                self.stall_s, self.stall_at = now - due, now
        self.audio += delta


@dataclass
class SessionLoad:
    session_id: str = ""
    appended_bytes: int = 0
    committed_bytes: int = 0
    replies: list[Reply] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)  # append that ended a turn -> first delta
    errors: list[dict] = field(default_factory=list)
    turns: int = 0  # turns the server VAD ended (speech_stopped)
    # ... of which ended while a reply to an earlier turn was still in progress: with barge-in off
    # the server commits such a turn and opens no response for it (one response at a time).
    turns_ended_during_a_reply: int = 0
    # From the moment the session opened its WebSocket (module docstring); None: never came.
    start_to_created_s: float | None = None
    start_to_ready_s: float | None = None
    start_to_first_audio_s: float | None = None

    @property
    def accounted(self) -> bool:
        return self.appended_bytes == self.committed_bytes and all(
            r.offsets_contiguous and r.status == "completed" and r.done_samples == len(r.audio) // 2 for r in self.replies
        )


def speech_pattern(seconds: float, burst_s: float = 0.8, gap_s: float = 0.7) -> bytes:
    """Deterministic 24 kHz PCM: tone bursts (speech to an energy VAD) separated by silence."""
    rate = PCM24K.rate
    t = np.arange(int(seconds * rate)) / rate
    on = (t % (burst_s + gap_s)) < burst_s
    return wire_audio.encode_samples((0.1 * np.sin(2 * np.pi * 220 * t) * on).astype(np.float32), PCM24K)


async def drive_session(
    url: str, pcm: bytes, chunk_ms: int = 200, realtime: bool = True, patience_s: float = 30.0, persona: dict | None = None
) -> SessionLoad:
    """``patience_s``: how long the session waits for any one answer of the server before it gives
    up (a server behind real time answers late, and the run still accounts for everything).
    ``persona``: ``session.update`` fields set with the first update (``instructions``, ``voice``)."""
    result = SessionLoad()
    step = PCM24K.rate * chunk_ms // 1000 * 2
    sent_at: list[tuple[int, float]] = []  # (end ms of the append, when it was sent)
    active: dict[str, Reply] = {}
    pending_turns: list[int] = []
    finished = asyncio.Event()
    answered = asyncio.Event()  # set at each answer to a session.update of this session's
    updates = {"sent": 0, "answered": 0}

    start = time.monotonic()
    sock = await RealtimeSocket.connect(url)
    created = await sock.recv()
    if created.get("type") != "session.created":
        await sock.close()
        raise RuntimeError(f"the server did not open a session: its first event was {created}")
    result.start_to_created_s = time.monotonic() - start
    result.session_id = created["session"]["id"]
    first = {"type": "realtime", "audio": {"input": {"turn_detection": {"type": "server_vad", "interrupt_response": False}}}}
    if persona:
        first["instructions"] = persona.get("instructions", "")
        first["audio"]["output"] = {"voice": persona.get("voice", "default")}

    async def update(session: dict) -> None:
        """One ``session.update``; returns once the server has answered it, and with it everything
        sent before (its mailbox is ordered)."""
        updates["sent"] += 1
        await sock.send({"type": "session.update", "event_id": f"loadgen_update_{updates['sent']}", "session": session})
        while updates["answered"] < updates["sent"]:
            answered.clear()
            await asyncio.wait_for(answered.wait(), patience_s)

    async def send() -> None:
        paced_from = time.monotonic()  # once the session is ready
        for offset in range(0, len(pcm), step):
            chunk = pcm[offset : offset + step]
            sent_at.append(((offset + len(chunk)) * 1000 // (2 * PCM24K.rate), time.monotonic()))
            await sock.send({"type": "input_audio_buffer.append", "audio": wire_audio.b64encode(chunk)})
            result.appended_bytes += len(chunk)
            if realtime:
                await asyncio.sleep(max(0.0, paced_from + (offset + step) / (2 * PCM24K.rate) - time.monotonic()))

    async def receive() -> None:
        turn_ended_at = 0.0
        while True:
            event = await sock.recv(timeout=patience_s)
            kind = event["type"]
            if kind == "input_audio_buffer.speech_stopped":
                turn_ended_at = next(t for end_ms, t in sent_at if end_ms >= event["audio_end_ms"])
                result.turns += 1
                result.turns_ended_during_a_reply += bool(active)
            elif kind == "input_audio_buffer.committed":
                result.committed_bytes += event["audio_bytes"]
                pending_turns.append(event["audio_bytes"])
            elif kind == "response.created":
                reply = Reply(event["response"]["id"], pending_turns[-1] if pending_turns else 0)
                active[reply.response_id] = reply
                result.replies.append(reply)
            elif kind == "response.output_audio.delta":
                reply = active[event["response_id"]]
                now = time.monotonic()
                if not reply.audio:
                    result.latencies_s.append(now - turn_ended_at)
                if result.start_to_first_audio_s is None:
                    result.start_to_first_audio_s = now - start
                reply.take(wire_audio.b64decode(event["delta"]), event["audio_offset"], now)
            elif kind == "response.done":
                reply = active.pop(event["response"]["id"])
                reply.status = event["response"]["status"]
                reply.done_samples = event["playback"]["audio_samples"]
            elif kind == "error":
                result.errors.append(event["error"])
                if str(event["error"].get("event_id", "")).startswith("loadgen_update_"):  # an update refused
                    updates["answered"] += 1
                    answered.set()
            elif kind == "session.updated":
                if result.start_to_ready_s is None:
                    result.start_to_ready_s = time.monotonic() - start
                updates["answered"] += 1
                answered.set()
            elif kind == "session.closed":
                finished.set()
                return

    async def barrier() -> None:
        """Returns once the server has handled everything sent so far: an update that changes
        nothing (no persona primed again)."""
        await update({"type": "realtime"})

    receiver = asyncio.create_task(receive())
    try:
        await update(first)
        if result.errors:
            raise RuntimeError(f"the server refused the session's first session.update: {result.errors}")
        await send()
        await barrier()
        while active:
            await asyncio.sleep(0.02)
        if result.appended_bytes > result.committed_bytes:  # trailing silence after the last turn
            await sock.send({"type": "input_audio_buffer.commit"})
            await barrier()
        await sock.send({"type": "session.close"})
        await asyncio.wait_for(finished.wait(), patience_s)
    finally:
        receiver.cancel()
        await sock.close()
    return result


async def run_load(
    url: str,
    pcm: bytes,
    sessions: int,
    realtime: bool = True,
    patience_s: float = 30.0,
    chunk_ms: int = 200,
    personas: list[dict] | None = None,
) -> list[SessionLoad]:
    """``chunk_ms``: the audio each ``input_audio_buffer.append`` carries (a browser or a telephony
    bridge sends 20 to 100 ms; 200 ms is the coarse default). ``personas``: each session's
    (``drive_session``), one per session."""
    if personas is not None and len(personas) != sessions:
        raise ValueError(f"personas: one per session expected, {sessions} sessions, got {len(personas)}")
    return list(
        await asyncio.gather(
            *(
                drive_session(
                    url,
                    pcm,
                    chunk_ms=chunk_ms,
                    realtime=realtime,
                    patience_s=patience_s,
                    persona=None if personas is None else personas[i],
                )
                for i in range(sessions)
            )
        )
    )
