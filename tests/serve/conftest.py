"""Fixtures for the duplex service tests (helpers live in servekit.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from servekit import AUDIO, PCM24K, read_wav, running, wire_audio


@pytest.fixture(scope="module")
def server():
    with running() as srv:
        yield srv


@pytest.fixture(scope="session")
def question_pcm() -> bytes:
    samples, rate = read_wav(AUDIO / "question_24k.wav")
    assert rate == 24_000
    return wire_audio.encode_samples(samples, PCM24K)


@pytest.fixture(scope="session")
def audio_dir() -> Path:
    assert AUDIO.is_dir(), f"test audio not found at {AUDIO}"
    return AUDIO
