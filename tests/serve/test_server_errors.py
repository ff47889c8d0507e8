"""Bad input: each frame gets exactly one typed ``error`` event and the session carries on."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket

import httpx
import pytest
import websockets.sync.client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servekit import ROOMY, Server, check_event, run, running

from cadence_fx.serve.app import background_server, frame_ceiling
from cadence_fx.serve.plugins import ToneModel
from cadence_fx.serve.protocol import ERROR_CODES, client_commands
from cadence_fx.serve.session import Limits

MAX_FRAME = 64 * 1024


@pytest.fixture(scope="module")
def strict_server():
    # The fuzz socket sends thousands of resumes of unknown sessions: no closing it for them.
    limits = Limits(max_sessions=64, max_sessions_per_client=64, max_frame_bytes=MAX_FRAME, max_resume_failures=10**9)
    with running(limits) as srv:
        yield srv


async def _answer(sock, frame) -> tuple[dict, dict]:
    """The error for ``frame``, then proof of life: the next command still works."""
    await sock.send(frame)
    error = await sock.recv()
    await sock.send({"type": "session.update", "session": {"type": "realtime", "instructions": "still here"}})
    alive = await sock.recv()
    return error, alive


BAD_FRAMES = [
    ("{oops", "invalid_json", None),
    (b"\x00\x9f binary", "invalid_json", None),
    ("[]", "invalid_json", None),
    ('{"type": "input_audio_buffer.append", "audio": "' + "A" * MAX_FRAME + '"}', "frame_too_large", None),
    ('{"type": "input_audio_buffer.explode"}', "unknown_event_type", "type"),
    ('{"type": "input_audio_buffer.append", "event_id": "c7"}', "missing_field", "audio"),
    ('{"type": "conversation.item.truncate", "item_id": "x", "audio_end_ms": 1}', "missing_field", "content_index"),
    ('{"type": "input_audio_buffer.append", "audio": "not base64!"}', "invalid_base64", "audio"),
    ('{"type": "input_audio_buffer.append", "audio": "AAAA"}', "invalid_audio_length", "audio"),
    (
        json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 8}}}}}),
        "unsupported_audio_format",
        "session.audio.input.format.rate",
    ),
    (
        json.dumps({"type": "session.update", "session": {"audio": {"output": {"format": {"type": "audio/flac"}}}}}),
        "unsupported_audio_format",
        "session.audio.output.format.type",
    ),
    ('{"type": "input_audio_buffer.commit", "session_id": "sess_not_mine"}', "session_mismatch", "session_id"),
    (
        '{"type": "session.resume", "session_id": "sess_unknown", "resume_token": "t", "last_server_event_seq": 0}',
        "session_not_found",
        "session_id",
    ),
    ('{"type": "conversation.item.retrieve", "item_id": "item_nope"}', "item_retrieve_invalid_item_id", "item_id"),
    ('{"type": "input_audio_buffer.commit"}', "input_audio_buffer_commit_empty", None),
    ('{"type": "response.cancel"}', "response_cancel_not_active", "response_id"),
]


@pytest.mark.parametrize(("frame", "code", "param"), BAD_FRAMES, ids=[c for _, c, _ in BAD_FRAMES])
def test_bad_input_gets_a_typed_error_and_the_session_survives(strict_server, frame, code, param):
    async def scenario():
        sock = await strict_server.connect("/v1/duplex")
        answer = await _answer(sock, frame)
        await sock.close()
        return answer

    error, alive = run(scenario())
    assert error["type"] == "error"
    assert (error["error"]["type"], error["error"]["code"], error["error"]["param"]) == (
        "invalid_request_error",
        code,
        param,
    )
    assert alive["type"] == "session.updated" and alive["session"]["instructions"] == "still here"


def test_the_apps_frame_limit_answers_every_frame_uvicorn_lets_through(strict_server):
    ceiling = frame_ceiling(Limits(max_frame_bytes=MAX_FRAME))
    head, tail = '{"type": "input_audio_buffer.append", "audio": "', '"}'
    largest = head + "A" * (ceiling - len(head) - len(tail)) + tail
    accented = head + "\u00e9" * (MAX_FRAME // 2) + tail  # fewer characters than bytes: bytes count

    async def scenario():
        sock = await strict_server.connect("/v1/duplex")
        answers = [await _answer(sock, frame) for frame in (largest, b"\x00" * ceiling, accented)]
        await sock.close()
        return answers

    answers = run(scenario())
    assert ceiling == 4 * MAX_FRAME + 65_536
    assert [error["error"]["message"] for error, _ in answers] == [
        f"frame of {ceiling} bytes exceeds max_frame_bytes={MAX_FRAME}",
        f"frame of {ceiling} bytes exceeds max_frame_bytes={MAX_FRAME}",
        f"frame of {len(accented.encode())} bytes exceeds max_frame_bytes={MAX_FRAME}",
    ]
    assert {error["error"]["code"] for error, _ in answers} == {"frame_too_large"}
    assert [alive["session"]["instructions"] for _, alive in answers] == ["still here"] * 3


def test_a_frame_over_the_ceiling_is_closed_by_uvicorn_with_1009(strict_server):
    ceiling = frame_ceiling(Limits(max_frame_bytes=MAX_FRAME))

    async def scenario():
        sock = await strict_server.connect("/v1/duplex")
        await sock.send(b"\x00" * (ceiling + 1))
        await sock.ws.wait_closed()
        return sock.ws.close_code, sock.ws.close_reason

    assert run(scenario()) == (1009, f"frame with {ceiling + 1} bytes exceeds limit of {ceiling} bytes")


def test_error_echoes_the_client_event_id(strict_server):
    async def scenario():
        sock = await strict_server.connect("/v1/duplex")
        error, _ = await _answer(sock, '{"type": "input_audio_buffer.append", "event_id": "c7"}')
        await sock.close()
        return error

    assert run(scenario())["error"]["event_id"] == "c7"


def test_another_clients_session_cannot_be_taken_with_a_wrong_token(strict_server):
    async def scenario():
        owner = await strict_server.connect("/v1/duplex")
        intruder = await strict_server.connect("/v1/duplex")
        resume = {
            "type": "session.resume",
            "session_id": owner.session_id,
            "resume_token": "guess",
            "last_server_event_seq": 0,
        }
        error, alive = await _answer(intruder, resume)
        owner_alive = await owner.update({"instructions": "mine"})
        named = {"type": "input_audio_buffer.clear", "session_id": owner.session_id}
        mismatch, _ = await _answer(intruder, named)
        quiet = await owner.recv_all()
        await owner.close()
        await intruder.close()
        return error, alive, owner_alive, mismatch, quiet

    error, alive, owner_alive, mismatch, quiet = run(scenario())
    assert (error["error"]["code"], error["error"]["param"]) == ("invalid_resume_token", "resume_token")
    assert alive["type"] == owner_alive["type"] == "session.updated"
    assert mismatch["error"]["code"] == "session_mismatch" and quiet == []


# ---------------------------------------------------------------- fuzz

_JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False), st.text(max_size=8))
_JSON = st.recursive(
    _JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
# Command types whose required fields, when broken, make the frame invalid.
_REQUIRED = {
    t: [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for t, cls in client_commands.COMMANDS.items()
}
_WITH_REQUIRED = sorted(t for t, names in _REQUIRED.items() if names)


def _is_json_object(text: str | bytes) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


@st.composite
def _broken_command(draw) -> str:
    kind = draw(st.sampled_from(_WITH_REQUIRED))
    frame = {"type": kind, **{name: "x" for name in _REQUIRED[kind]}}
    victim = draw(st.sampled_from(_REQUIRED[kind]))
    if draw(st.booleans()):
        del frame[victim]
    else:  # a value of the wrong type for the field (every required field is a str, int or dict)
        frame[victim] = draw(st.one_of(st.none(), st.lists(st.integers(), max_size=2), st.floats(allow_nan=False)))
    return json.dumps(frame)


_MALFORMED = st.one_of(
    st.text(max_size=40).filter(lambda t: not _is_json_object(t)),
    st.binary(max_size=40).filter(lambda b: not _is_json_object(b)),
    _JSON.filter(lambda v: not isinstance(v, dict)).map(json.dumps),
    st.dictionaries(st.text(max_size=6), _JSON, max_size=4)
    .filter(lambda d: not (isinstance(d.get("type"), str) and d["type"] in client_commands.COMMANDS))
    .map(json.dumps),
    st.text(max_size=30)
    .filter(lambda t: t not in client_commands.COMMANDS)
    .map(lambda t: json.dumps({"type": t, "audio": "AAAA"})),
    _broken_command(),
    st.text(alphabet="!@#$%^&*()~ ", min_size=1, max_size=12).map(
        lambda t: json.dumps({"type": "input_audio_buffer.append", "audio": t})
    ),
    st.text(max_size=12).map(lambda s: json.dumps({"type": "input_audio_buffer.clear", "session_id": "sess_x" + s})),
    st.text(max_size=12).map(lambda s: json.dumps({"type": "conversation.item.delete", "item_id": "nope" + s})),
    st.just(json.dumps({"type": "response.cancel"})),
    st.just(json.dumps({"type": "input_audio_buffer.commit"})),
    st.just(json.dumps({"type": "session.resume", "session_id": "sess_x", "resume_token": "t", "last_server_event_seq": 1})),
)


@pytest.fixture(scope="module")
def fuzz_socket(strict_server):
    with websockets.sync.client.connect(strict_server.handle.ws_url + "/v1/duplex", max_size=None) as ws:
        assert [json.loads(ws.recv(timeout=5))["type"] for _ in range(2)] == ["session.created", "rate_limits.updated"]
        ws.counter = ws.frames = 0
        yield ws
        assert ws.frames >= 2_000, ws.frames  # thousands of malformed frames, one session


@settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=st.lists(_MALFORMED, min_size=10, max_size=60))  # ~3,000 frames in all
def test_fuzz_every_malformed_frame_gets_exactly_one_typed_error(fuzz_socket, frames):
    ws = fuzz_socket
    for frame in frames:
        ws.send(frame)
    ws.counter += 1
    ws.frames += len(frames)
    marker = f"alive {ws.counter}"
    ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", "instructions": marker}}))
    answers = []
    while True:
        event = json.loads(ws.recv(timeout=10))
        if event["type"] == "session.updated":
            break
        answers.append(event)
    assert event["session"]["instructions"] == marker
    assert len(answers) == len(frames)
    assert all(a["type"] == "error" for a in answers)
    for answer in answers:
        check_event(answer, duplex=True)
    codes = {a["error"]["code"] for a in answers}
    assert codes <= ERROR_CODES - {"server_error"}, codes


# ---------------------------------------------------------------- found by probing from outside


@pytest.mark.parametrize("encoding", ["audio/pcmu", "audio/pcma"])
def test_an_empty_append_is_nothing_even_when_input_is_resampled(strict_server, encoding):
    async def scenario():
        sock = await strict_server.connect("/v1/duplex")
        await sock.update({"audio": {"input": {"format": {"type": encoding}, "turn_detection": None}}})
        await sock.send({"type": "input_audio_buffer.append", "event_id": "empty", "audio": ""})
        await sock.send({"type": "input_audio_buffer.commit", "event_id": "commit"})
        answer = await sock.recv()
        ledger = strict_server.on_loop(lambda: strict_server.session(sock.session_id).ledgers.input)
        await sock.close()
        return answer, ledger

    answer, ledger = run(scenario())
    # The append took nothing, so the buffer is still empty: the commit's own error, nothing else.
    assert (answer["error"]["code"], answer["error"]["event_id"]) == ("input_audio_buffer_commit_empty", "commit")
    assert (ledger.received_bytes, ledger.rejected_appends, ledger.resampled_samples) == (0, 0, 0)


class _FailingFeed(ToneModel):
    """A model whose every feed raises: a bug the session must report without dying."""

    def open_stream(self):
        stream = super().open_stream()

        def feed(frame):
            raise RuntimeError("the model broke")

        stream.feed = feed
        return stream


def test_an_internal_error_is_typed_and_names_the_command_that_met_it():
    async def scenario(server):
        sock = await server.connect("/v1/duplex")
        await sock.no_vad()
        await sock.send({"type": "input_audio_buffer.append", "event_id": "a1", "audio": "AAAA" * 320})
        error = await sock.recv()
        alive = await sock.update({"instructions": "still here"})
        await sock.close()
        return error, alive

    with background_server(_FailingFeed, ROOMY) as handle:
        error, alive = run(scenario(Server(handle)))
    assert error["error"] == {
        "type": "server_error",
        "code": "server_error",
        "message": "internal error: RuntimeError",
        "param": None,
        "event_id": "a1",
    }
    assert alive["session"]["instructions"] == "still here"


def test_errors_quote_client_strings_cut_short_and_refuse_overlong_ids(strict_server):
    long_id = "i" * 50_000

    async def scenario():
        sock = await strict_server.connect("/v1/duplex")
        answers = []
        for frame in (
            {"type": "conversation.item.retrieve", "item_id": "x" * 200, "event_id": "r1"},
            {"type": "conversation.item.retrieve", "item_id": long_id, "event_id": "r2"},
            {"type": "input_audio_buffer.clear", "event_id": long_id},
            {"type": "session.update", "session": {"audio": {"input": {"format": "f" * 50_000}}}},
        ):
            answers.append((await _answer(sock, frame))[0]["error"])
        await sock.close()
        return answers

    short, long_item, long_event, long_format = run(scenario())
    assert short == {
        "type": "invalid_request_error",
        "code": "item_retrieve_invalid_item_id",
        "message": f"Error retrieving item: the item with id '{'x' * 63}... (202 characters) does not exist.",
        "param": "item_id",
        "event_id": "r1",
    }
    assert (long_item["message"], long_item["event_id"]) == (
        "item_id is 50000 characters long, at most 256 are accepted",
        "r2",
    )
    assert (long_event["message"], long_event["event_id"]) == (
        "event_id is 50000 characters long, at most 256 are accepted",
        None,
    )
    assert long_format["message"] == (
        f"unsupported audio format '{'f' * 63}... (50002 characters); served: pcm16, pcm_f32le, g711_ulaw, g711_alaw"
    )


def test_a_lone_surrogate_is_refused_and_never_echoed(strict_server):
    """Issue 41: an item whose text holds a lone surrogate (valid JSON, not valid Unicode) used to
    be kept and echoed back as ``\\ud800``, which strict JSON parsers refuse. Now it is refused with
    a typed error naming the field, the session goes on, and nothing was added to its history."""
    item = '{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi \\ud800"}]}'

    async def scenario():
        sock = await strict_server.connect("/v1/duplex")
        await sock.send('{"type": "conversation.item.create", "event_id": "c1", "item": ' + item + "}")
        raw = await sock.ws.recv()
        await sock.send({"type": "session.update", "session": {"type": "realtime", "instructions": "still here"}})
        alive = await sock.recv()
        history = strict_server.on_loop(lambda: list(strict_server.session(sock.session_id).history))
        await sock.close()
        return raw, alive, history

    raw, alive, history = run(scenario())
    assert json.loads(raw) == {
        "type": "error",
        "event_id": json.loads(raw)["event_id"],
        "server_event_seq": 1,
        "error": {
            "type": "invalid_request_error",
            "code": "invalid_value",
            "message": "item.content[0].text holds a lone UTF-16 surrogate (U+D800 at character 3): strings must "
            "be valid Unicode, since strict JSON parsers refuse an unpaired surrogate (RFC 8259, section 8.2); "
            "send the text as UTF-8, or pair the surrogates",
            "param": "item.content[0].text",
            "event_id": "c1",
        },
    }
    assert "\\ud" not in raw.lower()  # nothing of the client's text came back
    assert (alive["type"], alive["server_event_seq"], history) == ("session.updated", 2, [])


def _until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends on ``sock`` until it closes it (at most 10 s)."""
    sock.settimeout(10)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_request_that_never_arrives_whole_gets_408_and_is_closed():
    """Issue 41: half-sent requests held their sockets forever, and 300 of them used up the
    process's open files (/health failed). Now a request must arrive whole within
    request_timeout_s of its socket's opening; a WebSocket, once open, is not timed."""
    limits = Limits(max_sessions=64, max_sessions_per_client=64, request_timeout_s=0.5)
    with running(limits) as server:
        address = ("127.0.0.1", server.handle.port)
        half_head, half_line, silent, half_body, pipelined = (socket.create_connection(address) for _ in range(5))
        half_head.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # the head's blank line never comes
        half_line.sendall(b"GET /hea")
        half_body.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\nab")
        pipelined.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGET /hea")  # one whole, one half
        half_head.settimeout(0.2)
        with pytest.raises(socket.timeout):  # not before the timeout
            half_head.recv(1)
        answers = [_until_closed(sock) for sock in (half_head, half_line, silent, half_body, pipelined)]
        for sock in (half_head, half_line, silent, half_body, pipelined):
            sock.close()

        async def session_outlives_the_timeout():
            sock = await server.connect("/v1/duplex")
            await asyncio.sleep(1.0)
            alive = await sock.update({"instructions": "still here"})
            await sock.close()
            return alive

        alive = run(session_outlives_the_timeout())
        health = httpx.get(server.handle.http_url + "/health").status_code
    body = b"the request did not arrive whole within request_timeout_s=0.5 s: send its line, headers and body at once"
    timed_out = {
        "status": b"HTTP/1.1 408 Request Timeout",
        "content-type": b"text/plain; charset=utf-8",
        "content-length": str(len(body)).encode(),
        "connection": b"close",
        "body": body,
    }
    assert [_response(a) for a in answers[:3]] == [timed_out] * 3
    # The body never came whole, but /health answered without reading it: the socket is closed, no 408 after a 200.
    assert _response(answers[3])["status"] == b"HTTP/1.1 200 OK" and answers[3].count(b"HTTP/1.1") == 1
    # The whole request is answered, then the half one after it gets its 408.
    first, second = answers[4].split(b"HTTP/1.1 408", 1)
    assert _response(first)["status"] == b"HTTP/1.1 200 OK" and _response(b"HTTP/1.1 408" + second) == timed_out
    assert (alive["session"]["instructions"], health) == ("still here", 200)


def _response(raw: bytes) -> dict:
    head, _, body = raw.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers = dict(line.split(b": ", 1) for line in lines)
    kept = {name.decode(): headers[name] for name in (b"content-type", b"content-length", b"connection") if name in headers}
    return {"status": status, **kept, "body": body}
