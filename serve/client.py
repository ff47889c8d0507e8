"""A client for the service: a thin Realtime socket, and a WAV streamer (``cadence-fx client``).

``run_client(url, wav_in, wav_out)`` streams a WAV file through a duplex session in real time,
lets server VAD cut it into turns, and writes every reply, in order, to ``wav_out``. A refused
connection, a wrong URL or an unreadable WAV raises ``ClientError`` with one sentence.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
import time
import urllib.parse
import wave
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import websockets

from .protocol import PCM24K, StreamResampler, client_commands, encode_command
from .protocol import audio as wire_audio


class RealtimeSocket:
    """JSON events over one WebSocket; ``recv`` returns raw dicts so callers see the exact wire."""

    def __init__(self, ws: websockets.ClientConnection) -> None:
        self.ws = ws

    @classmethod
    async def connect(cls, url: str, open_timeout: float = 5.0) -> RealtimeSocket:
        ws = await websockets.connect(url, max_size=None, open_timeout=open_timeout, ping_interval=None)
        return cls(ws)

    async def send(self, message: client_commands.ClientCommand | dict | str | bytes) -> None:
        if isinstance(message, client_commands.ClientCommand):
            message = encode_command(message)
        elif isinstance(message, dict):
            message = json.dumps(message)
        await self.ws.send(message)

    async def recv(self, timeout: float = 5.0) -> dict:
        return json.loads(await asyncio.wait_for(self.ws.recv(), timeout))

    async def recv_until(self, event_type: str, timeout: float = 10.0) -> list[dict]:
        """Every event up to and including the first ``event_type``."""
        deadline = time.monotonic() + timeout
        seen = []
        while True:
            event = await self.recv(max(0.001, deadline - time.monotonic()))
            seen.append(event)
            if event["type"] == event_type:
                return seen

    async def close(self) -> None:
        await self.ws.close()


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """Mono float32 samples and the rate of a 16-bit PCM WAV (channels are averaged)."""
    with wave.open(str(path), "rb") as wav:
        if wav.getsampwidth() != 2:
            raise ValueError(f"{path}: only 16-bit PCM WAV is supported")
        rate, channels = wav.getframerate(), wav.getnchannels()
        pcm = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2").astype(np.float32) / 32768.0
    return pcm.reshape(-1, channels).mean(axis=1).astype(np.float32), rate


def write_wav(path: str | Path, pcm16: bytes, rate: int) -> None:
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(pcm16)


class ClientError(Exception):
    """A client failure told in one sentence (no traceback): a refused connection, a wrong URL,
    an unreadable WAV."""


@dataclass
class ClientReport:
    session_id: str = ""
    sent_s: float = 0.0
    turns: int = 0
    responses_done: int = 0
    reply_s: float = 0.0
    first_audio_latency_s: list[float] = field(default_factory=list)  # speech_stopped -> first delta
    errors: list[dict] = field(default_factory=list)
    failure: str | None = None  # why the session ended early (what was received is still written)

    def summary(self, wav_out: str | Path) -> str:
        """One line: what was written, how much reply audio, how fast it came."""
        line = f"wrote {wav_out}: {self.responses_done} replies, {self.reply_s:.2f} s of reply audio"
        if self.first_audio_latency_s:
            latencies = sorted(self.first_audio_latency_s)
            line += (
                f"; first audio {1000 * latencies[len(latencies) // 2]:.0f} ms after the turn ended (median of {len(latencies)})"
            )
        if self.errors:
            line += f"; {len(self.errors)} error events (first: {self.errors[0].get('message')})"
        if self.failure:
            line += f"; ended early: {self.failure}"
        return line


def route_url(url: str) -> tuple[str, bool]:
    """The WebSocket URL for ``url`` (a server's base, or either route, over ws/wss or http/https)
    and whether it speaks the duplex extensions; a ClientError for anything else."""
    parts = urllib.parse.urlsplit(url)
    scheme = {"ws": "ws", "wss": "wss", "http": "ws", "https": "wss"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise ClientError(f"{url!r} is not a server URL: expected ws://HOST:PORT (or wss://, http://, https://)")
    path = parts.path.rstrip("/")
    if path == "":
        path = "/v1/duplex"
    elif path not in ("/v1/realtime", "/v1/duplex"):
        raise ClientError(
            f"{url!r} names no realtime route: expected the server's base URL, or one ending in /v1/realtime or /v1/duplex"
        )
    query = urllib.parse.parse_qs(parts.query)
    duplex = path == "/v1/duplex" or query.get("duplex", ["0"])[0].lower() in ("1", "true", "yes", "on")
    return urllib.parse.urlunsplit((scheme, parts.netloc, path, parts.query, "")), duplex


async def _connect(url: str) -> RealtimeSocket:
    """The socket, or a ClientError that says in one sentence why there is none."""
    try:
        return await RealtimeSocket.connect(url)
    except websockets.InvalidStatus as exc:
        status = exc.response.status_code
        hint = " (no such route: is a cadence-fx serve listening there?)" if status == 404 else ""
        raise ClientError(f"{url} refused the WebSocket handshake with HTTP {status}{hint}") from None
    except ssl.SSLCertVerificationError as exc:
        raise ClientError(
            f"the certificate of {url} is not trusted ({exc.verify_message}); SSL_CERT_FILE=cert.pem trusts a self-signed one"
        ) from None
    except ssl.SSLError as exc:
        raise ClientError(f"TLS with {url} failed ({exc.reason}): is the server serving wss:// there?") from None
    except (websockets.InvalidHandshake, EOFError) as exc:
        raise ClientError(f"{url} did not answer as a WebSocket server ({exc}): ws:// against a TLS server?") from None
    except ConnectionRefusedError:
        raise ClientError(f"could not connect to {url}: connection refused (is `cadence-fx serve` running there?)") from None
    except TimeoutError:
        raise ClientError(f"could not connect to {url}: no answer within 5 s") from None
    except OSError as exc:
        raise ClientError(f"could not connect to {url}: {exc.strerror or exc}") from None


def _print_progress(report: ClientReport, total_s: float) -> None:
    sys.stderr.write(
        f"\rsent {report.sent_s:5.1f}/{total_s:.1f} s | turns {report.turns} | "
        f"replies {report.responses_done} | reply audio {report.reply_s:5.2f} s"
    )
    sys.stderr.flush()


async def stream_wav(
    url: str,
    wav_in: str | Path,
    wav_out: str | Path,
    *,
    chunk_ms: int = 100,
    realtime: bool = True,
    tail_silence_s: float = 1.0,
    progress: Callable[[ClientReport, float], None] | None = _print_progress,
) -> ClientReport:
    """Streams ``wav_in`` to ``url`` (a route's WebSocket URL) and writes every reply, in order,
    to ``wav_out``; whatever arrived is written even when the session ends early."""
    url, duplex = route_url(url)
    try:
        samples, rate = read_wav(wav_in)
    except (OSError, ValueError, EOFError, wave.Error) as exc:
        raise ClientError(f"cannot read {wav_in} as a 16-bit PCM WAV: {exc}") from None
    audio = StreamResampler(rate, PCM24K.rate).process(samples)
    audio = np.concatenate([audio, np.zeros(int(tail_silence_s * PCM24K.rate), dtype=np.float32)])
    pcm = wire_audio.encode_samples(audio, PCM24K)
    total_s = len(audio) / PCM24K.rate
    step = PCM24K.rate * chunk_ms // 1000 * 2
    report = ClientReport()
    replies: dict[str, bytearray] = {}
    order: list[str] = []
    stopped_at: list[float] = []
    sending_done = asyncio.Event()
    last_shown = 0.0

    def show(final: bool = False) -> None:
        nonlocal last_shown
        if progress is not None and (final or time.monotonic() - last_shown >= 0.1):
            last_shown = time.monotonic()
            progress(report, total_s)

    sock = await _connect(url)

    async def send() -> None:
        start = time.monotonic()
        for offset in range(0, len(pcm), step):
            await sock.send(client_commands.InputAudioBufferAppend(audio=wire_audio.b64encode(pcm[offset : offset + step])))
            report.sent_s = min(total_s, (offset + step) / 2 / PCM24K.rate)
            show()
            if realtime:
                await asyncio.sleep(max(0.0, start + report.sent_s - time.monotonic()))
        sending_done.set()

    async def receive() -> None:
        active = 0
        while True:
            try:
                event = await sock.recv(timeout=2.0)
            except TimeoutError:
                if sending_done.is_set() and active == 0:
                    return
                continue
            kind = event["type"]
            if kind == "input_audio_buffer.speech_stopped":
                stopped_at.append(time.monotonic())
                report.turns += 1
            elif kind == "response.created":
                active += 1
                order.append(event["response"]["id"])
                replies[event["response"]["id"]] = bytearray()
            elif kind == "response.output_audio.delta":
                buf = replies[event["response_id"]]
                if not buf and stopped_at:
                    report.first_audio_latency_s.append(time.monotonic() - stopped_at[-1])
                buf += wire_audio.b64decode(event["delta"])
                report.reply_s += len(wire_audio.b64decode(event["delta"])) / 2 / PCM24K.rate
            elif kind == "response.done":
                active -= 1
                report.responses_done += 1
            elif kind == "error":
                report.errors.append(event["error"])
            show()

    try:
        created = await sock.recv()
        if created["type"] != "session.created":
            raise ClientError(f"expected session.created first, got {created['type']}: {created.get('error', created)}")
        report.session_id = created["session"]["id"]
        await asyncio.gather(send(), receive())
        if duplex:
            await sock.send(client_commands.SessionClose())
            await sock.recv_until("session.closed", timeout=5.0)
    except websockets.ConnectionClosed as exc:
        report.failure = f"the server closed the connection ({exc.rcvd.code if exc.rcvd else 'no close frame'})"
    except (TimeoutError, OSError) as exc:
        report.failure = f"the connection failed ({type(exc).__name__})"
    finally:
        await sock.close()
        show(final=True)
        if progress is _print_progress:
            sys.stderr.write("\n")
        write_wav(wav_out, b"".join(bytes(replies[r]) for r in order), PCM24K.rate)
    return report


def run_client(url: str, wav_in: str | Path, wav_out: str | Path) -> ClientReport:
    """Stream ``wav_in`` through a session in real time and write the reply to ``wav_out``
    (``cadence-fx client``). ``url`` is the server's base (``ws://host:port``, a duplex session)
    or either route's full URL."""
    return asyncio.run(stream_wav(url, wav_in, wav_out))
