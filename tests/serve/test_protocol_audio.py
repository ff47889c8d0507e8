"""Wire audio: strict base64, exact PCM round trips, G.711 per the reference codec, and a
streaming resampler whose output does not depend on how the input was chunked."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from cadence_fx.serve.protocol import PCM24K, PCMA, PCMU, ProtocolError, StreamResampler
from cadence_fx.serve.protocol import audio as wire_audio


def test_pcm16_round_trips_every_sample_value_exactly():
    pcm = np.arange(-32768, 32768, dtype="<i2").tobytes()
    assert wire_audio.encode_samples(wire_audio.decode_samples(pcm, PCM24K), PCM24K) == pcm


@pytest.mark.parametrize("fmt", [PCMU, PCMA])
def test_g711_round_trips_every_code_exactly(fmt):
    codes = bytes(range(256))
    decoded = wire_audio.decode_samples(codes, fmt)
    reencoded = wire_audio.encode_samples(decoded, fmt)
    # 0x7F/0xFF (u-law) are both zero: everything else maps back to itself.
    assert sum(a != b for a, b in zip(codes, reencoded, strict=True)) == (1 if fmt is PCMU else 0)


def test_g711_matches_the_reference_codec():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import audioop  # the standard library's before 3.13, the audioop-lts package after
    pcm = np.arange(-32768, 32768, dtype="<i2").tobytes()
    codes = bytes(range(256))
    floats = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768
    assert wire_audio.encode_samples(floats, PCMU) == audioop.lin2ulaw(pcm, 2)
    assert wire_audio.encode_samples(floats, PCMA) == audioop.lin2alaw(pcm, 2)
    assert wire_audio.encode_samples(wire_audio.decode_samples(codes, PCMU), PCM24K) == audioop.ulaw2lin(codes, 2)
    assert wire_audio.encode_samples(wire_audio.decode_samples(codes, PCMA), PCM24K) == audioop.alaw2lin(codes, 2)


@pytest.mark.parametrize("text", ["A", "AAA", "AA=A", "AA A", "A@==", "\u00e9\u00e9=="])
def test_bad_base64_is_a_typed_error(text):
    with pytest.raises(ProtocolError) as info:
        wire_audio.b64decode(text)
    assert (info.value.code, info.value.param) == ("invalid_base64", "audio")


def test_odd_pcm_length_is_a_typed_error():
    with pytest.raises(ProtocolError) as info:
        wire_audio.decode_samples(b"\x00\x01\x02", PCM24K)
    assert info.value.code == "invalid_audio_length"


@pytest.mark.parametrize(
    ("value", "fmt"),
    [
        ({"type": "audio/pcm", "rate": 24000}, PCM24K),
        ({"type": "audio/pcm"}, PCM24K),
        ({"type": "audio/pcmu"}, PCMU),
        ({"type": "audio/pcma"}, PCMA),
        ("pcm16", PCM24K),
        ("g711_ulaw", PCMU),
        ("g711_alaw", PCMA),
    ],
)
def test_ga_and_beta_format_spellings(value, fmt):
    assert wire_audio.parse_format(value, "f") == fmt


@pytest.mark.parametrize(("src", "dst"), [(24000, 16000), (16000, 24000), (8000, 16000), (24000, 8000), (24000, 24000)])
def test_resampler_is_chunking_invariant_and_counts_exactly(src, dst):
    rng = np.random.default_rng(7)
    x = (0.1 * rng.standard_normal(9_973)).astype(np.float32)
    whole = StreamResampler(src, dst)
    expected = whole.process(x)
    chunked = StreamResampler(src, dst)
    cuts = [0, 1, 8, 480, 481, 3000, 7000, len(x)]
    parts = [chunked.process(x[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    assert np.array_equal(np.concatenate(parts), expected)
    assert len(expected) == whole.expected_out(len(x)) == -(-len(x) * dst // src)


def test_resampler_passes_a_tone_below_both_nyquists():
    t = np.arange(24_000) / 24_000
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    out = StreamResampler(24_000, 16_000).process(tone)
    ref = 0.5 * np.sin(2 * np.pi * 440 * np.arange(16_000) / 16_000)
    delay = 10  # the filter's group delay at 16 kHz: half of 2*10*3+1 taps, divided by 3
    assert np.max(np.abs(out[delay + 100 : -100] - ref[100 : -100 - delay])) < 1e-2
