"""The in-process API (serve/inprocess.py): the documented example as written, the same session
as over a socket event for event, typed errors, and a detached handle resumed."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from servekit import COMMIT, RESPONSE_HEAD, RESPONSE_TAIL, ROOMY, run, running, tone_reply_pcm, types_of

from cadence_fx.serve import inprocess
from cadence_fx.serve.inprocess import DuplexService, SessionClosedError
from cadence_fx.serve.plugins import ToneModel, tone
from cadence_fx.serve.protocol import audio as wire_audio
from cadence_fx.serve.protocol import client_commands, event_to_dict
from cadence_fx.serve.protocol import events as ev
from cadence_fx.serve.session import Limits

QUESTION_CHUNKS = 56


def test_the_documented_example_runs_as_written():
    code = re.search(r"::\n\n(.*?)\n\nA handle", inprocess.__doc__, re.S).group(1)
    lines = code.splitlines()
    namespace: dict = {}
    exec("\n".join(line[4:] for line in lines if not line.startswith("    asyncio.run")), namespace)
    assert len(lines) <= 20
    reply = asyncio.run(namespace["main"]())
    assert reply == tone_reply_pcm(tone.reply_chunks(16_000))  # 1 s heard at the model's 16 kHz


def _turn(question_pcm: bytes) -> list[client_commands.ClientCommand]:
    return [
        client_commands.SessionUpdate(session={"audio": {"input": {"turn_detection": None}}}),
        *(
            client_commands.InputAudioBufferAppend(audio=wire_audio.b64encode(question_pcm[i : i + 9600]))
            for i in range(0, len(question_pcm), 9600)
        ),
        client_commands.InputAudioBufferCommit(),
        client_commands.ResponseCreate(),
    ]


_IDS = re.compile(r'"(sess|item|resp|conv|event)_[A-Za-z0-9_-]+"')


def _comparable(event: dict) -> str:
    """An event with what differs by chance left out: its ids (each shape kept), its token and
    the session's expiry time."""
    event = {k: v for k, v in event.items() if k != "resume_token"}
    if isinstance(event.get("session"), dict):
        event["session"] = {k: v for k, v in event["session"].items() if k != "expires_at"}
    return _IDS.sub(lambda m: f'"{m.group(1)}_"', json.dumps(event, sort_keys=True))


def test_the_same_session_as_over_a_socket(question_pcm):
    async def in_process() -> list[dict]:
        async with DuplexService(ToneModel(), ROOMY) as service:
            session = await service.open_session()
            for command in _turn(question_pcm):
                await session.submit(command)
            events = []
            async for event in session.events():
                assert isinstance(event, ev.ServerEvent)
                events.append(event_to_dict(event, duplex=True))
                if isinstance(event, ev.ResponseDone):
                    await session.close()
            return events

    async def over_socket(server) -> list[dict]:
        sock = await server.connect("/v1/duplex", created=False)
        for command in _turn(question_pcm):
            await sock.send(command)
        events = await sock.recv_until("response.done")
        await sock.send(client_commands.SessionClose())
        events += await sock.recv_until("session.closed")
        await sock.close()
        return events

    local = asyncio.run(in_process())
    with running() as server:
        remote = run(over_socket(server))
    assert [_comparable(e) for e in local] == [_comparable(e) for e in remote]
    assert types_of(local)[:3] == ["session.created", "rate_limits.updated", "session.updated"]
    assert types_of(local)[3:] == COMMIT + RESPONSE_HEAD + RESPONSE_TAIL + ["session.closed"]


def test_refusals_are_typed_error_events():
    async def scenario():
        async with DuplexService(ToneModel()) as service:
            session = await service.open_session()
            await session.next_event(5), await session.next_event(5)
            await session.submit(client_commands.InputAudioBufferAppend(audio="not base64!", event_id="a1"))
            await session.submit(client_commands.InputAudioBufferCommit(event_id="c1"))
            errors = [await session.next_event(5), await session.next_event(5)]
            plain = await service.open_session(duplex=False)
            await plain.next_event(5), await plain.next_event(5)
            await plain.submit(client_commands.SessionHeartbeat(event_id="h1"))
            errors.append(await plain.next_event(5))
            await session.close()
            plain.detach()
            return errors

    errors = asyncio.run(scenario())
    assert all(isinstance(e, ev.Error) for e in errors)
    assert [(e.error["code"], e.error["event_id"]) for e in errors] == [
        ("invalid_base64", "a1"),
        ("input_audio_buffer_commit_empty", "c1"),
        ("unsupported_in_realtime_mode", "h1"),
    ]


def test_admission_refusal_raises():
    async def scenario():
        async with DuplexService(ToneModel(), Limits(max_sessions=1)) as service:
            first = await service.open_session()
            with pytest.raises(SessionClosedError) as refused:
                await service.open_session()
            await first.close()
            return refused.value

    refused = asyncio.run(scenario())
    assert (refused.code, refused.reason) == (1013, "resource exhausted")


def test_a_detached_handle_resumes_and_misses_nothing(question_pcm):
    async def scenario():
        async with DuplexService(ToneModel(step_delay_s=0.01)) as service:
            session = await service.open_session()
            for command in _turn(question_pcm):
                await session.submit(command)
            before = []
            while not isinstance(event := await session.next_event(10), ev.ResponseOutputAudioDelta):
                before.append(event)
            before.append(event)
            session.detach()
            await asyncio.sleep(0.2)  # the reply goes on while no one holds the session
            back = await service.resume_session(session.session_id, session.resume_token, session.last_server_event_seq)
            resumed = await back.next_event(10)
            after = []
            while not isinstance(event := await back.next_event(10), ev.ResponseDone):
                after.append(event)
            after.append(event)
            stale = await service.resume_session(session.session_id, session.resume_token, 0)
            refused = await stale.next_event(10)
            await back.close()
            stale.detach()
            return before, resumed, after, refused, back.session_id == session.session_id

    before, resumed, after, refused, same = asyncio.run(scenario())
    assert same and isinstance(resumed, ev.SessionResumed) and resumed.replayed > 0
    journaled = [e for e in before + after if e.server_event_seq is not None]
    assert [e.server_event_seq for e in journaled] == list(range(1, len(journaled) + 1))
    deltas = [e for e in journaled if isinstance(e, ev.ResponseOutputAudioDelta)]
    assert b"".join(wire_audio.b64decode(d.delta) for d in deltas) == tone_reply_pcm(QUESTION_CHUNKS)
    assert isinstance(refused, ev.Error) and refused.error["code"] == "invalid_resume_token"
