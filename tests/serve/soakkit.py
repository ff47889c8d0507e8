"""Fault soak of the duplex service: sessions that, for a while, take turns and faults at random
(cancels, barge-ins, disconnects and resumes, stalled readers, oversize and malformed frames),
while a ledger per session accounts for every input byte and every output sample.

The model is the ``tone`` test double, whose reply to a turn is known exactly (half as long, a
440 Hz sine; ``serve/plugins/tone.py``), so every reply can be checked sample for sample. Appends are
whole 20 ms frames, so a turn of ``n`` committed bytes (24 kHz PCM16) is ``n / 3`` samples at the
model's 16 kHz, with nothing padded.

What a run must show (``SessionLedger.violations`` lists every breach, by session):

* events: every ``server_event_seq`` arrives exactly once and in order, across every reconnect;
  no ``session.resync_required``;
* input: appended = refused + committed + cleared, in bytes (a client disconnects only once every
  append it sent has been handled, so no append is in flight);
* output: every response's deltas are contiguous, as long as its ``response.done`` says, and equal
  to the tone's reply: all of it when completed, its beginning when cut short;
* errors: only the ones a step provoked (and a cancel that raced its reply's end); no
  ``server_error``;
* shutdown: when the server stops, every session gets ``session.closed`` (``server_shutdown``)
  and close code 1001.

A test kit, not part of the installed service: tests/serve/test_soak_short.py runs it short, and
bench/soak.py (which puts tests/serve/ on its path, and its server's) for minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import numpy as np
import websockets

from cadence_fx.serve.plugins import ToneModel, tone
from cadence_fx.serve.protocol import PCM24K
from cadence_fx.serve.protocol import audio as wire_audio
from cadence_fx.serve.session import Limits

# The tone speaks in real time (a 40 ms chunk each 40 ms), so replies last long enough to be cut
# into by a cancel, a barge-in, a disconnect or a stall.
STEP_DELAY_S = 0.04
APPEND_MS = 200
PATIENCE_S = 60.0
# Steps and their weights.
STEPS = {
    "turn": 30,
    "cancel": 15,
    "disconnect": 15,
    "soft_stall": 10,
    "barge_in": 10,
    "bad_frames": 10,
    "clear": 5,
    "hard_stall": 3,
}
# A step's provoked errors, in order (``bad_frames``).
BAD_FRAME_CODES = ["frame_too_large", "invalid_json", "unknown_event_type", "invalid_base64", "invalid_audio_length"]


def soak_limits(sessions: int) -> Limits:
    """Budgets small enough that a stalled reader meets the outbound one (4008) in seconds."""
    return Limits(
        max_sessions=sessions,
        max_sessions_per_client=sessions,
        max_frame_bytes=64 << 10,
        input_bytes=1 << 20,
        outbound_bytes=2 << 20,
        journal_bytes=4 << 20,
        drain_s=2.0,
    )


def soak_model() -> ToneModel:
    return ToneModel(step_delay_s=STEP_DELAY_S)


# A client socket's receive buffer, fixed: the kernel would otherwise grow it to tens of MB on
# loopback, and a stalled reader would stall only once all of that is full.
RECEIVE_BUFFER_BYTES = 256 << 10


async def connect(url: str) -> websockets.ClientConnection:
    """A client socket with a fixed receive buffer of RECEIVE_BUFFER_BYTES and no compression
    (the tone's audio deflates to almost nothing), so what the server sends is what fills it."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port))
    return await websockets.connect(url, sock=sock, max_size=None, ping_interval=None, compression=None)


def speech(ms: int) -> bytes:
    """24 kHz PCM16 that the server VAD hears as speech (a 220 Hz tone at -23 dBFS)."""
    t = np.arange(PCM24K.rate * ms // 1000) / PCM24K.rate
    return wire_audio.encode_samples((0.1 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), PCM24K)


def quiet(ms: int) -> bytes:
    return bytes(PCM24K.rate * ms // 1000 * 2)


def tone_reply(turn_bytes: int) -> bytes:
    """The tone's whole reply, as 24 kHz PCM16, to a committed turn of ``turn_bytes``."""
    return _tone_pcm(tone.reply_chunks(turn_bytes // 3))


@functools.cache
def _tone_pcm(chunks: int) -> bytes:
    return wire_audio.encode_samples(tone.render(chunks), PCM24K)


@dataclass
class SessionLedger:
    session_id: str = ""
    steps: Counter = field(default_factory=Counter)
    # events
    events: int = 0
    replayed: int = 0
    resumes: int = 0
    lost_events: int = 0  # named lost by a session.resync_required
    slow_consumer_closes: int = 0
    # input, in bytes
    appended: int = 0
    refused: int = 0
    committed: int = 0
    cleared: int = 0
    # output
    responses: Counter = field(default_factory=Counter)  # by final status
    delta_samples: int = 0
    done_samples: int = 0  # the sum of response.done's playback.audio_samples
    barge_ins: int = 0
    retrieved: int = 0
    # errors
    errors: Counter = field(default_factory=Counter)  # by code
    cancel_races: int = 0  # a cancel that met its reply's end (response_cancel_not_active)
    shutdown: str | None = None  # "session.closed <reason>, close <code>" at the end
    violations: list[str] = field(default_factory=list)

    @property
    def input_accounted(self) -> bool:
        return self.appended == self.refused + self.committed + self.cleared

    def to_dict(self) -> dict:
        out = asdict(self)
        out["steps"], out["responses"], out["errors"] = dict(self.steps), dict(self.responses), dict(self.errors)
        out["input_accounted"] = self.input_accounted
        return out


@dataclass
class _Reply:
    id: str
    expected: bytes  # the whole reply the turn asks for
    audio: bytearray = field(default_factory=bytearray)
    status: str | None = None


class SoakClient:
    """One session's random walk; ``run`` returns its ledger."""

    def __init__(self, base_url: str, seed: int, seconds: float, first: list[str]) -> None:
        self.url = base_url + "/v1/duplex"
        self.rng = random.Random(seed)
        self.seconds = seconds
        self.first = first  # steps taken before the random ones
        self.ledger = SessionLedger()
        self.ws: websockets.ClientConnection  # from the first _open on
        self.token = ""
        self.last_seq = 0
        self.vad = True  # the server's default turn detection
        # Committed since the model's last reply began or its input was cleared: what the next
        # response answers (the model hears input as it is appended, committed or not).
        self.turn_bytes = 0
        self.last_item_id = ""
        self.replies: dict[str, _Reply] = {}
        self.active: _Reply | None = None
        self.item_audio: dict[str, bytes] = {}  # what was committed as an item, for retrieves
        self.expected_errors: list[str] = []  # the codes a step provoked, in order
        self.cancel_may_race = False  # a cancel is on its way: its reply may end before it arrives
        self.closed_event: dict | None = None
        self._reading = asyncio.Event()
        self._reading.set()
        self._changed = asyncio.Event()  # an event arrived or the socket closed
        self._reader: asyncio.Task | None = None
        self._marks = 0
        self._synced = 0

    # ------------------------------------------------------------ the walk

    async def run(self, settled: Callable[[], Awaitable[None]]) -> SessionLedger:
        """Walk for ``seconds``, settle (nothing buffered, no reply running), await ``settled()``
        (the server's shutdown), then read until the socket closes."""
        try:
            await self._open()
            deadline = time.monotonic() + self.seconds
            first = list(self.first)
            while first or time.monotonic() < deadline:
                step = first.pop(0) if first else self.rng.choices(list(STEPS), weights=list(STEPS.values()))[0]
                self.ledger.steps[step] += 1
                await getattr(self, "_" + step)()
            await self._mode(vad=False)
            await self._send({"type": "input_audio_buffer.clear"})
            await self._sync()
        except Exception as exc:  # the walk is over for this session; the ledger says why
            self._violate(f"walk stopped: {type(exc).__name__}: {exc}")
        await settled()
        await self._until_closed()
        return self.ledger

    async def _turn(self) -> None:
        await self._reply_to_manual_turn()
        await self._until(lambda: self.active is None)

    async def _cancel(self) -> None:
        reply = await self._reply_to_manual_turn(deltas=self.rng.randint(1, 5))
        self.cancel_may_race = True
        await self._send({"type": "response.cancel", "response_id": reply.id})
        await self._until(lambda: self.active is None)
        await self._sync()  # the cancel's answer (or its race) has come
        self.cancel_may_race = False

    async def _disconnect(self) -> None:
        await self._reply_to_manual_turn(deltas=self.rng.randint(1, 10))
        await self._drop(abort=self.rng.random() < 0.5)
        await asyncio.sleep(self.rng.uniform(0.0, 0.5))  # the reply goes on into the journal
        await self._resume()
        await self._until(lambda: self.active is None)

    async def _soft_stall(self) -> None:
        """Stop reading for a moment while a reply streams: its events wait in the buffers."""
        await self._reply_to_manual_turn(deltas=self.rng.randint(1, 5))
        self._reading.clear()
        await asyncio.sleep(self.rng.uniform(0.5, 2.0))
        self._reading.set()
        await self._until(lambda: self.active is None or self._closed())
        await self._resume_if_closed_for_stalling()
        await self._until(lambda: self.active is None)

    async def _barge_in(self) -> None:
        await self._mode(vad=True)
        responses = len(self.replies)
        await self._append(speech(self.rng.randrange(1500, 3000, 20)) + quiet(600))
        await self._until(lambda: self.active is not None and len(self.active.audio) > 0)
        # Speech while the reply plays: VAD cuts it (barge_in, cancelled) and answers the new turn.
        await self._append(speech(self.rng.randrange(600, 1200, 20)) + quiet(600))
        await self._until(lambda: len(self.replies) == responses + 2 and self.active is None)

    async def _bad_frames(self) -> None:
        oversize = json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (70 << 10)})
        odd = wire_audio.b64encode(b"\x01\x02\x03")  # not whole 16-bit samples
        self.expected_errors += BAD_FRAME_CODES
        await self._send(oversize)
        await self._send("{oops")
        await self._send({"type": "input_audio_buffer.explode"})
        await self._send({"type": "input_audio_buffer.append", "audio": "not base64!"})
        await self._send_append(odd, 3)
        await self._sync()
        if self.expected_errors:
            self._violate(f"bad frames went unanswered: {self.expected_errors}")
            self.expected_errors.clear()

    async def _clear(self) -> None:
        await self._mode(vad=False)
        await self._append(speech(self.rng.randrange(200, 1000, 20)))
        await self._send({"type": "input_audio_buffer.clear"})
        await self._sync()

    async def _hard_stall(self) -> None:
        """Ask for a turn's audio again and again and read nothing: the server gives up on this
        socket (4008) once its outbound budget is full; the resume replays what it missed."""
        await self._mode(vad=False)
        await self._send({"type": "input_audio_buffer.clear"})
        pcm = speech(3000)
        await self._append(pcm)
        await self._send({"type": "input_audio_buffer.commit"})
        await self._sync()
        item_id = self.last_item_id
        self.item_audio[item_id] = pcm
        asked, retrieved = 120, self.ledger.retrieved
        self._reading.clear()
        for _ in range(asked):  # 120 x 190 KB: more than the socket buffers and the 2 MiB budget hold
            await self._send({"type": "conversation.item.retrieve", "item_id": item_id})
        await asyncio.sleep(3.0)
        self._reading.set()
        await self._until(lambda: self._closed() or self.ledger.retrieved == retrieved + asked)
        await self._resume_if_closed_for_stalling()
        await self._sync()

    async def _resume_if_closed_for_stalling(self) -> None:
        """After a stall: the server may have closed the socket for it (4008); resume if so."""
        if self._closed():
            if self.ws.close_code != 4008:
                raise RuntimeError(f"a stalled reader's socket closed with {self.ws.close_code}, not 4008")
            self.ledger.slow_consumer_closes += 1
            await self._resume()

    # ------------------------------------------------------------ steps' parts

    async def _reply_to_manual_turn(self, deltas: int = 0) -> _Reply:
        """A turn without VAD, answered; returns once the reply has sent ``deltas`` deltas."""
        await self._mode(vad=False)
        pcm = speech(self.rng.randrange(1000, 3000, 20))
        await self._append(pcm)
        await self._send({"type": "input_audio_buffer.commit"})
        await self._send({"type": "response.create"})
        await self._until(lambda: self.active is not None and len(self.active.audio) >= deltas * 1920)
        return self.active  # type: ignore[return-value]

    async def _append(self, pcm: bytes) -> None:
        """``pcm`` in appends of APPEND_MS, at the pace of speech."""
        step = PCM24K.rate * APPEND_MS // 1000 * 2
        start = time.monotonic()
        for offset in range(0, len(pcm), step):
            chunk = pcm[offset : offset + step]
            await self._send_append(wire_audio.b64encode(chunk), len(chunk))
            await asyncio.sleep(max(0.0, start + (offset + len(chunk)) / (2 * PCM24K.rate) - time.monotonic()))

    async def _send_append(self, audio: str, n_bytes: int) -> None:
        """One append; its event_id carries its size, so a refusal tells the ledger what it refused."""
        self.ledger.appended += n_bytes
        self._marks += 1
        append = {"type": "input_audio_buffer.append", "event_id": f"append {n_bytes} {self._marks}", "audio": audio}
        await self._send(append)

    async def _mode(self, vad: bool) -> None:
        if self.vad != vad:
            detection = {"type": "server_vad", "interrupt_response": True} if vad else None
            session = {"type": "realtime", "audio": {"input": {"turn_detection": detection}}}
            await self._send({"type": "session.update", "session": session})
            self.vad = vad
            await self._sync()

    async def _sync(self) -> None:
        """Returns once the server has handled everything sent so far (its mailbox is ordered)."""
        self._marks += 1
        mark = self._marks
        await self._send({"type": "session.update", "session": {"type": "realtime", "instructions": f"sync {mark}"}})
        await self._until(lambda: self._synced >= mark)

    async def _until(self, predicate: Callable[[], bool], timeout: float = PATIENCE_S) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            self._changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"waited {timeout:g} s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, 0.5))

    async def _send(self, message: dict | str) -> None:
        await self.ws.send(message if isinstance(message, str) else json.dumps(message))

    def _closed(self) -> bool:
        """This socket's reader is over: the socket closed."""
        return self._reader is not None and self._reader.done()

    def _violate(self, what: str) -> None:
        self.ledger.violations.append(what)

    # ------------------------------------------------------------ connections

    async def _open(self) -> None:
        self.ws = await connect(self.url)
        created = json.loads(await self.ws.recv())
        self.ledger.session_id, self.token = created["session"]["id"], created["resume_token"]
        self._start_reading()

    async def _drop(self, abort: bool) -> None:
        if abort:
            self.ws.transport.abort()
        else:
            await self.ws.close()
        await self._until(self._closed)

    async def _resume(self) -> None:
        self.ws = await connect(f"{self.url}?session_id={self.ledger.session_id}")
        resume = {
            "type": "session.resume",
            "session_id": self.ledger.session_id,
            "resume_token": self.token,
            "last_server_event_seq": self.last_seq,
        }
        await self._send(resume)
        self.ledger.resumes += 1
        self._start_reading()

    def _start_reading(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read(self.ws))

    async def _read(self, ws: websockets.ClientConnection) -> None:
        try:
            with contextlib.suppress(websockets.ConnectionClosed):
                while True:
                    await self._reading.wait()
                    self._take(json.loads(await ws.recv()))
        finally:
            self._changed.set()

    async def _until_closed(self) -> None:
        if self._reader is None:
            self.ledger.shutdown = "never connected"
            return
        with contextlib.suppress(TimeoutError):
            await self._until(self._closed)
        closed = self.closed_event or {}
        self.ledger.shutdown = f"session.closed {closed.get('reason')}, close {self.ws.close_code}"

    # ------------------------------------------------------------ the ledger

    def _take(self, event: dict) -> None:
        self._changed.set()
        led = self.ledger
        led.events += 1
        seq = event.get("server_event_seq")
        if seq is not None:
            if seq != self.last_seq + 1:
                self._violate(f"event {seq} after {self.last_seq}: {event['type']}")
            self.last_seq = max(self.last_seq, seq)
        kind = event["type"]
        handler = getattr(self, "_on_" + kind.replace(".", "_"), None)
        if handler is not None:
            handler(event)

    def _on_session_resumed(self, event: dict) -> None:
        self.token = event["resume_token"]
        self.ledger.replayed += event["replayed"]

    def _on_session_resync_required(self, event: dict) -> None:
        first, last = event["requested_seq"] + 1, event["oldest_available_seq"] - 1
        self.ledger.lost_events += last - first + 1
        self._violate(f"resync required: events {first}..{last} are lost")
        self.last_seq = event["last_server_event_seq"]

    def _on_session_closed(self, event: dict) -> None:
        self.closed_event = event

    def _on_session_expired(self, event: dict) -> None:
        self._violate(f"session expired: {event['reason']}")

    def _on_session_updated(self, event: dict) -> None:
        mark = event["session"]["instructions"]
        if mark.startswith("sync "):
            self._synced = max(self._synced, int(mark.split()[1]))

    def _on_input_audio_buffer_committed(self, event: dict) -> None:
        self.ledger.committed += event["audio_bytes"]
        self.turn_bytes += event["audio_bytes"]
        self.last_item_id = event["item_id"]

    def _on_input_audio_buffer_cleared(self, event: dict) -> None:
        self.ledger.cleared += event["audio_bytes"]
        self.turn_bytes = 0  # the model forgets everything fed since its last reply began

    def _on_barge_in(self, event: dict) -> None:
        self.ledger.barge_ins += 1

    def _on_response_created(self, event: dict) -> None:
        if self.active is not None:
            self._violate(f"response {event['response']['id']} began while {self.active.id} was running")
        reply = _Reply(event["response"]["id"], tone_reply(self.turn_bytes))
        self.turn_bytes = 0
        self.replies[reply.id] = self.active = reply

    def _on_response_output_audio_delta(self, event: dict) -> None:
        reply = self.active
        if reply is None or reply.id != event["response_id"]:
            self._violate(f"a delta of {event['response_id']}, which is not running")
            return
        if event["audio_offset"] != len(reply.audio) // 2:
            self._violate(f"{reply.id}: delta at {event['audio_offset']}, expected {len(reply.audio) // 2}")
        delta = wire_audio.b64decode(event["delta"])
        reply.audio += delta
        self.ledger.delta_samples += len(delta) // 2

    def _on_response_done(self, event: dict) -> None:
        reply = self.active
        status = event["response"]["status"]
        if reply is None or reply.id != event["response"]["id"]:
            self._violate(f"response.done of {event['response']['id']}, which is not running")
            return
        self.active, reply.status = None, status
        led = self.ledger
        led.responses[status] += 1
        samples = event["playback"]["audio_samples"]
        led.done_samples += samples
        audio = bytes(reply.audio)
        if samples * 2 != len(audio):
            self._violate(f"{reply.id}: response.done says {samples} samples, {len(audio) // 2} arrived")
        if status == "completed" and audio != reply.expected:
            self._violate(f"{reply.id}: completed with {len(audio)} bytes, not the tone's {len(reply.expected)}")
        elif status != "completed" and audio != reply.expected[: len(audio)]:
            self._violate(f"{reply.id}: {status} and its audio is not the tone's beginning")
        if status == "failed":
            self._violate(f"{reply.id} failed: {event['response']['status_details']}")

    def _on_conversation_item_retrieved(self, event: dict) -> None:
        self.ledger.retrieved += 1
        item = event["item"]
        expected = self.item_audio.get(item["id"])
        audio = item["content"][0].get("audio") if item.get("content") else None
        if expected is not None and audio is not None and wire_audio.b64decode(audio) != expected:
            self._violate(f"retrieved {item['id']} with other audio than was committed")

    def _on_error(self, event: dict) -> None:
        error = event["error"]
        code, event_id = error["code"], error.get("event_id") or ""
        led = self.ledger
        led.errors[code] += 1
        if code in ("input_backpressure", "invalid_audio_length") and event_id.startswith("append "):
            led.refused += int(event_id.split()[1])
        if self.expected_errors and code == self.expected_errors[0]:
            self.expected_errors.pop(0)
        elif code == "response_cancel_not_active" and self.cancel_may_race:
            led.cancel_races += 1
        elif code != "input_backpressure":
            self._violate(f"unexpected error {code}: {error['message']}")


async def run_soak(
    base_url: str, sessions: int, seconds: float, seed: int, stop: Callable[[], Awaitable[None]]
) -> list[SessionLedger]:
    """``sessions`` clients walking for ``seconds``; once all have settled, ``stop()`` shuts the
    server down and each reads until its socket closes. Every step kind is taken at least once:
    the kinds are dealt round the sessions as their first steps."""
    settled = 0
    all_settled = asyncio.Event()
    stopped = asyncio.Event()

    async def settle() -> None:
        nonlocal settled
        settled += 1
        if settled == sessions:
            all_settled.set()
            await stop()
            stopped.set()
        await stopped.wait()

    kinds = list(STEPS)
    clients = [SoakClient(base_url, seed * 1000 + i, seconds, kinds[i::sessions]) for i in range(sessions)]
    return list(await asyncio.gather(*(client.run(settle) for client in clients)))


def summarize(ledgers: list[SessionLedger]) -> dict:
    """The run's totals and verdicts."""
    total = Counter()
    for led in ledgers:
        for name in (
            "events",
            "replayed",
            "resumes",
            "lost_events",
            "slow_consumer_closes",
            "appended",
            "refused",
            "committed",
            "cleared",
            "delta_samples",
            "done_samples",
            "barge_ins",
            "retrieved",
            "cancel_races",
        ):
            total[name] += getattr(led, name)
    steps = sum((led.steps for led in ledgers), Counter())
    responses = sum((led.responses for led in ledgers), Counter())
    errors = sum((led.errors for led in ledgers), Counter())
    violations = {led.session_id: led.violations for led in ledgers if led.violations}
    return {
        "totals": dict(total),
        "steps": dict(steps),
        "responses": dict(responses),
        "errors_by_code": dict(errors),
        "input_accounted": all(led.input_accounted for led in ledgers),
        "output_samples_accounted": total["delta_samples"] == total["done_samples"],
        "server_errors": errors.get("server_error", 0),
        "shutdown": dict(Counter(led.shutdown for led in ledgers)),
        "violations": violations,
        "lost_events": total["lost_events"],
    }
