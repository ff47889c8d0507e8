"""The codec: every command decodes to its dataclass, every malformed frame to one typed error,
and events encode to GA JSON (Tier 2 fields only on duplex connections)."""

from __future__ import annotations

import json
import typing

import pytest
from openai.types.realtime import RealtimeServerEvent
from servekit import GA_SCHEMA

from cadence_fx.serve.protocol import ProtocolError, client_commands, decode_command, decode_event, encode_command, encode_event
from cadence_fx.serve.protocol import events as ev


def _error(frame: str | bytes) -> tuple[str, str | None]:
    with pytest.raises(ProtocolError) as info:
        decode_command(frame)
    return info.value.code, info.value.param


def test_every_ga_client_event_decodes_to_its_command():
    frames = {
        '{"type":"session.update","session":{"type":"realtime"}}': client_commands.SessionUpdate(session={"type": "realtime"}),
        '{"type":"input_audio_buffer.append","audio":"AAA=","event_id":"c1"}': client_commands.InputAudioBufferAppend(
            audio="AAA=", event_id="c1"
        ),
        '{"type":"input_audio_buffer.commit"}': client_commands.InputAudioBufferCommit(),
        '{"type":"input_audio_buffer.clear"}': client_commands.InputAudioBufferClear(),
        '{"type":"conversation.item.create","item":{"type":"message","role":"user","content":[]}}': (
            client_commands.ConversationItemCreate(item={"type": "message", "role": "user", "content": []})
        ),
        '{"type":"conversation.item.retrieve","item_id":"i"}': client_commands.ConversationItemRetrieve(item_id="i"),
        '{"type":"conversation.item.truncate","item_id":"i","content_index":0,"audio_end_ms":5}': (
            client_commands.ConversationItemTruncate(item_id="i", content_index=0, audio_end_ms=5)
        ),
        '{"type":"conversation.item.delete","item_id":"i"}': client_commands.ConversationItemDelete(item_id="i"),
        '{"type":"response.create"}': client_commands.ResponseCreate(),
        '{"type":"response.cancel","response_id":"r"}': client_commands.ResponseCancel(response_id="r"),
        '{"type":"output_audio_buffer.clear"}': client_commands.OutputAudioBufferClear(),
    }
    for frame, command in frames.items():
        assert decode_command(frame) == command


def test_tier3_commands_decode():
    resume = '{"type":"session.resume","session_id":"s","resume_token":"t","last_server_event_seq":7}'
    assert decode_command(resume) == client_commands.SessionResume(session_id="s", resume_token="t", last_server_event_seq=7)
    assert decode_command('{"type":"session.event_ack","server_event_seq":3}') == client_commands.SessionEventAck(
        server_event_seq=3
    )
    assert decode_command('{"type":"playback.ack","response_id":"r","audio_end_ms":40}') == client_commands.PlaybackAck(
        response_id="r", audio_end_ms=40
    )
    assert decode_command('{"type":"session.heartbeat"}') == client_commands.SessionHeartbeat()
    assert decode_command('{"type":"session.close"}') == client_commands.SessionClose()


@pytest.mark.parametrize(
    ("frame", "code", "param"),
    [
        ("{nope", "invalid_json", None),
        (b"\xff\xfe", "invalid_json", None),
        ("[1, 2]", "invalid_json", None),
        ("[" * 100_000, "invalid_json", None),
        ("{}", "missing_field", "type"),
        ('{"type": 7}', "invalid_value", "type"),
        ('{"type": "no.such.event"}', "unknown_event_type", "type"),
        ('{"type": "input_audio_buffer.append"}', "missing_field", "audio"),
        ('{"type": "input_audio_buffer.append", "audio": 12}', "invalid_value", "audio"),
        ('{"type": "input_audio_buffer.append", "audio": null}', "invalid_value", "audio"),
        ('{"type": "conversation.item.truncate", "item_id": "i", "content_index": 0}', "missing_field", "audio_end_ms"),
        (
            '{"type": "conversation.item.truncate", "item_id": "i", "content_index": true, "audio_end_ms": 1}',
            "invalid_value",
            "content_index",
        ),
        (
            '{"type": "conversation.item.truncate", "item_id": "i", "content_index": -1, "audio_end_ms": 1}',
            "invalid_value",
            "content_index",
        ),
        ('{"type": "conversation.item.create", "item": {"type": "image"}}', "invalid_value", "item.type"),
        (
            '{"type": "conversation.item.create", "item": {"type": "message", "role": "robot", "content": []}}',
            "invalid_value",
            "item.role",
        ),
        ('{"type": "session.update", "session": "x"}', "invalid_value", "session"),
        ('{"type": "session.resume", "resume_token": "t", "last_server_event_seq": 1}', "missing_field", "session_id"),
    ],
)
def test_malformed_frame_raises_one_typed_error(frame, code, param):
    assert _error(frame) == (code, param)


def test_error_carries_the_client_event_id():
    with pytest.raises(ProtocolError) as info:
        decode_command('{"type": "input_audio_buffer.append", "event_id": "client-9"}')
    assert info.value.event_id == "client-9"


_USER_TEXT = '{"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [%s]}}'


@pytest.mark.parametrize(
    ("frame", "param", "lone", "event_id"),
    [
        (
            '{"type": "session.update", "event_id": "u1", "session": {"instructions": "a\\ud800b"}}',
            "session.instructions",
            "U+D800 at character 1",
            "u1",
        ),
        (
            _USER_TEXT % '{"type": "input_text", "text": "ok"}, {"type": "input_text", "text": "\\udfff"}',
            "item.content[1].text",
            "U+DFFF at character 0",
            None,
        ),
        ('{"type": "session.update", "session": {"\\udc00": 1}}', "session", "U+DC00 at character 0", None),
        # The error never echoes an event_id that holds one.
        ('{"type": "input_audio_buffer.clear", "event_id": "x\\ud83d"}', "event_id", "U+D83D at character 1", None),
        # A binary frame's UTF-8 may encode a surrogate itself (json.loads decodes bytes with surrogatepass).
        (
            b'{"type": "session.update", "session": {"instructions": "\xed\xa0\x80"}}',
            "session.instructions",
            "U+D800 at character 0",
            None,
        ),
    ],
)
def test_a_lone_surrogate_anywhere_in_a_command_is_refused_by_name(frame, param, lone, event_id):
    """Issue 41: a lone UTF-16 surrogate decodes to a Python string that JSON can only write back
    as a ``\\udXXX`` escape, which strict parsers refuse: it is refused on the way in."""
    with pytest.raises(ProtocolError) as info:
        decode_command(frame)
    where = "a key of session" if param == "session" else param
    assert (info.value.code, info.value.param, info.value.event_id, info.value.message) == (
        "invalid_value",
        param,
        event_id,
        f"{where} holds a lone UTF-16 surrogate ({lone}): strings must be valid Unicode, since strict JSON "
        "parsers refuse an unpaired surrogate (RFC 8259, section 8.2); send the text as UTF-8, or pair the "
        "surrogates",
    )


def test_a_paired_surrogate_escape_is_the_character_it_encodes():
    command = decode_command(
        '{"type": "session.update", "event_id": "e\\ud83d\\ude00", "session": {"instructions": "\\ud83d\\ude00"}}'
    )
    assert (command.event_id, command.session["instructions"]) == ("e\U0001f600", "\U0001f600")


def _delta(**extra) -> ev.ResponseOutputAudioDelta:
    return ev.ResponseOutputAudioDelta(
        event_id="event_1",
        response_id="resp_1",
        item_id="item_1",
        output_index=0,
        content_index=0,
        delta="AAA=",
        **extra,
    )


def test_tier1_encoding_has_ga_fields_only():
    event = _delta(epoch=3, turn_id=2, audio_offset=960, server_event_seq=11)
    assert json.loads(encode_event(event, duplex=False)) == {
        "type": "response.output_audio.delta",
        "event_id": "event_1",
        "response_id": "resp_1",
        "item_id": "item_1",
        "output_index": 0,
        "content_index": 0,
        "delta": "AAA=",
    }


def test_tier2_encoding_adds_our_fields_on_duplex_connections():
    event = _delta(epoch=3, turn_id=2, audio_offset=960, server_event_seq=11)
    wire = json.loads(encode_event(event, duplex=True))
    assert {k: wire[k] for k in ("server_event_seq", "epoch", "turn_id", "audio_offset")} == {
        "server_event_seq": 11,
        "epoch": 3,
        "turn_id": 2,
        "audio_offset": 960,
    }
    GA_SCHEMA.validate_python(wire)


def test_unset_tier2_fields_are_left_out_not_null():
    assert "epoch" not in json.loads(encode_event(_delta(), duplex=True))


def test_tier3_events_cannot_reach_a_realtime_connection():
    with pytest.raises(ValueError, match="duplex-only"):
        encode_event(ev.SessionReplaced(session_id="s"), duplex=False)


def test_events_round_trip_through_the_codec():
    event = _delta(epoch=1, turn_id=1, audio_offset=0, server_event_seq=4)
    assert decode_event(encode_event(event, duplex=True)) == event
    resumed = ev.SessionResumed(event_id="e", session_id="s", resume_token="t", generation=2, last_server_event_seq=9, replayed=3)
    assert decode_event(encode_event(resumed, duplex=True)) == resumed


@pytest.mark.parametrize("kind", ['"no.such.event"', "[1]", '{"a": 1}', "null", "3"])
def test_an_event_of_no_known_type_is_refused_by_its_type(kind):
    with pytest.raises(ProtocolError) as refused:
        decode_event(f'{{"type": {kind}}}')
    assert (refused.value.code, refused.value.param) == ("unknown_event_type", "type")
    assert str(refused.value) == f"unknown event type {json.loads(kind)!r}"


def test_commands_round_trip_through_the_codec():
    command = client_commands.SessionResume(session_id="s", resume_token="t", last_server_event_seq=0, generation=1)
    assert decode_command(encode_command(command)) == command


def test_every_tier3_name_is_ours_and_every_other_name_is_ga():
    union = typing.get_args(RealtimeServerEvent)[0]
    ga_types = {typing.get_args(m.model_fields["type"].annotation)[0] for m in typing.get_args(union)}
    for cls in ev.EVENTS.values():
        assert (cls.TYPE in ga_types) == (cls.TIER != 3), cls.TYPE


_ITEM = {
    "id": "item_1",
    "object": "realtime.item",
    "type": "message",
    "role": "assistant",
    "status": "completed",
    "content": [{"type": "output_audio", "transcript": ""}],
}
_RESPONSE = {"id": "resp_1", "object": "realtime.response", "status": "completed", "output": [_ITEM]}
_PART = {"response_id": "resp_1", "item_id": "item_1", "output_index": 0, "content_index": 0}
_SAMPLES = [
    ev.SessionCreated(session={"type": "realtime", "id": "sess_1"}, resume_token="t", generation=1),
    ev.SessionUpdated(session={"type": "realtime"}),
    ev.InputAudioBufferCommitted(item_id="item_0", turn_id=1, audio_bytes=2),
    ev.InputAudioBufferCleared(audio_bytes=0),
    ev.InputAudioBufferSpeechStarted(audio_start_ms=0, item_id="item_0"),
    ev.InputAudioBufferSpeechStopped(audio_end_ms=5, item_id="item_0"),
    ev.ConversationItemAdded(item=_ITEM),
    ev.ConversationItemDone(item=_ITEM, previous_item_id="item_0"),
    ev.ConversationItemRetrieved(item=_ITEM),
    ev.ConversationItemTruncated(item_id="item_1", content_index=0, audio_end_ms=10),
    ev.ConversationItemDeleted(item_id="item_1"),
    ev.ResponseCreated(response={**_RESPONSE, "status": "in_progress", "output": []}, response_id="resp_1", epoch=0, turn_id=1),
    ev.ResponseDone(response=_RESPONSE, response_id="resp_1", epoch=0, turn_id=1, playback={"audio_samples": 960}),
    ev.ResponseOutputItemAdded(response_id="resp_1", output_index=0, item=_ITEM),
    ev.ResponseOutputItemDone(response_id="resp_1", output_index=0, item=_ITEM),
    ev.ResponseContentPartAdded(**_PART, part={"type": "audio", "transcript": ""}),
    ev.ResponseContentPartDone(**_PART, part={"type": "audio", "transcript": ""}),
    ev.ResponseOutputAudioDelta(**_PART, delta="AAA=", epoch=0, turn_id=1, audio_offset=0, format="pcm16", sample_rate_hz=24000),
    ev.ResponseOutputAudioTranscriptDelta(**_PART, delta="hel"),
    ev.ResponseOutputAudioTranscriptDone(**_PART, transcript="hello"),
    ev.ResponseOutputAudioDone(**_PART, epoch=0),
    ev.OutputAudioBufferCleared(response_id="resp_1"),
    ev.RateLimitsUpdated(rate_limits=[{"name": "requests", "limit": 16, "remaining": 15}]),
    ev.Error(error={"type": "invalid_request_error", "code": "invalid_json", "message": "m", "param": None, "event_id": None}),
]


def test_every_tier1_and_tier2_event_class_validates_against_the_ga_schema():
    assert {type(e) for e in _SAMPLES} == {cls for cls in ev.EVENTS.values() if cls.TIER != 3}
    for sample in _SAMPLES:
        sample.event_id, sample.server_event_seq = "event_1", 1
        for duplex in (False, True):
            model = GA_SCHEMA.validate_json(encode_event(sample, duplex=duplex))
            assert duplex or not model.model_extra, sample.TYPE
