"""What every Python interop scenario shares: the server it talks to (from the environment that
bench/interop.py sets), the test speech, and the one JSON line a scenario prints."""

from __future__ import annotations

import json
import os
import sys
import wave
from pathlib import Path

AUDIO = Path(__file__).resolve().parents[2] / "tests" / "serve" / "audio"
WS = os.environ.get("INTEROP_WS", "ws://127.0.0.1:8000")  # the plain server
WSS = os.environ.get("INTEROP_WSS", "")  # the TLS one
MODEL = os.environ.get("INTEROP_MODEL", "moshi-tiny")


def pcm24k(name: str) -> bytes:
    """16-bit mono 24 kHz PCM of a test WAV."""
    with wave.open(str(AUDIO / name)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24_000), name
        return wav.readframes(wav.getnframes())


def silence(ms: int) -> bytes:
    return bytes(48 * ms)


class Checks:
    """Named checks of one client: each passes or fails with the reason."""

    def __init__(self, client: str, version: str) -> None:
        self.client, self.version = client, version
        self.passed: list[str] = []
        self.failed: dict[str, str] = {}

    def check(self, name: str, ok: bool, why: str = "") -> bool:
        if ok:
            self.passed.append(name)
        else:
            self.failed[name] = why or "failed"
        return ok

    def report(self) -> None:
        print(
            json.dumps({"client": self.client, "version": self.version, "passed": self.passed, "failed": self.failed}), flush=True
        )
        sys.exit(0 if not self.failed else 1)
