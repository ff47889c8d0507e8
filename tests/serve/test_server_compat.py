"""What the clients people use rely on: response.create's ``response`` object honoured or refused
per field, metadata echoed, semantic_vad served, VAD state kept across unrelated updates, GA item
shapes, ``previous_item_id: "root"``, and OpenAI's error wording. Every event received is checked
against the GA schema by CheckedSocket."""

from __future__ import annotations

import pytest
from servekit import COMMIT, RESPONSE_HEAD, RESPONSE_TAIL, deltas_of, run, silence, tone_reply_pcm, types_of, wav_pcm

from cadence_fx.serve.protocol import PCM24K, PCMU, StreamResampler
from cadence_fx.serve.protocol import audio as wire_audio

QUESTION_REPLY_CHUNKS = 56


async def _turn(server, question_pcm, response: dict, path: str = "/v1/duplex") -> list[dict]:
    sock = await server.connect(path)
    await sock.no_vad()
    await sock.append(question_pcm)
    await sock.send({"type": "input_audio_buffer.commit"})
    await sock.recv_until("conversation.item.done")
    await sock.send({"type": "response.create", "event_id": "rc_1", "response": response})
    events = await sock.recv_until("response.done")
    sock.history = server.on_loop(lambda: [item["id"] for item in server.session(sock.session_id).history])
    await sock.close()
    return events, sock


def test_response_metadata_is_echoed_in_created_and_done(server, question_pcm):
    events, _ = run(_turn(server, question_pcm, {"metadata": {"client_event_id": "rc_1"}}, "/v1/realtime"))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.done"
    assert events[0]["response"]["metadata"] == events[-1]["response"]["metadata"] == {"client_event_id": "rc_1"}


def test_response_output_format_and_voice_apply_to_that_response_only(server, question_pcm):
    response = {"audio": {"output": {"format": {"type": "audio/pcmu"}, "voice": "cedar"}}, "output_modalities": ["audio"]}
    events, _ = run(_turn(server, question_pcm, response))
    done = events[-1]
    assert done["response"]["audio"]["output"] == {"format": {"type": "audio/pcmu"}, "voice": "cedar"}
    assert done["playback"]["format"] == {"type": "audio/pcmu"}
    tone = wire_audio.decode_samples(tone_reply_pcm(QUESTION_REPLY_CHUNKS), PCM24K)
    expected = wire_audio.encode_samples(StreamResampler(24_000, 8_000).process(tone), PCMU)
    assert deltas_of(events) == expected and len(expected) == QUESTION_REPLY_CHUNKS * 320


def test_conversation_none_keeps_the_reply_out_of_the_history(server, question_pcm):
    events, sock = run(_turn(server, question_pcm, {"conversation": "none"}))
    assert types_of(events) == [
        "response.created",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_audio.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.done",
    ]
    assert events[0]["response"]["conversation_id"] is None and len(sock.history) == 1


def test_response_instructions_are_stored_and_reported_on_duplex_connections(server, question_pcm):
    events, _ = run(_turn(server, question_pcm, {"instructions": "answer in French", "tool_choice": "auto"}))
    assert events[0]["instructions"] == "answer in French"


@pytest.mark.parametrize(
    ("response", "code", "param"),
    [
        ({"input": []}, "invalid_value", "response.input"),
        ({"prompt": {"id": "pmpt_1"}}, "invalid_value", "response.prompt"),
        ({"tool_choice": "required"}, "invalid_value", "response.tool_choice"),
        ({"output_modalities": ["text"]}, "invalid_value", "response.output_modalities"),
        ({"max_output_tokens": 100}, "invalid_value", "response.max_output_tokens"),
        ({"conversation": "conv_other"}, "invalid_value", "response.conversation"),
        ({"metadata": {"k": 1}}, "invalid_value", "response.metadata.k"),
        (
            {"audio": {"output": {"format": {"type": "audio/opus"}}}},
            "unsupported_audio_format",
            "response.audio.output.format.type",
        ),
        ({"temperature": 0.8}, "unknown_parameter", "response.temperature"),
    ],
)
def test_a_response_field_that_cannot_be_honoured_is_refused_by_name(server, response, code, param):
    async def scenario():
        sock = await server.connect("/v1/realtime")
        await sock.send({"type": "response.create", "event_id": "rc_9", "response": response})
        error = await sock.recv()
        await sock.close()
        return error

    error = run(scenario())["error"]
    assert (error["type"], error["code"], error["param"], error["event_id"]) == ("invalid_request_error", code, param, "rc_9")


def test_response_cancel_with_nothing_active_uses_openais_wording(server):
    async def scenario():
        sock = await server.connect("/v1/realtime")
        await sock.send({"type": "response.cancel", "event_id": "cancel_1"})
        error = await sock.recv()
        await sock.close()
        return error

    assert run(scenario())["error"] == {
        "type": "invalid_request_error",
        "code": "response_cancel_not_active",
        "message": "Cancellation failed: no active response found",
        "param": "response_id",
        "event_id": "cancel_1",
    }


def test_missing_and_duplicate_items_get_openais_codes(server):
    item = {"id": "item_x", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}

    async def scenario():
        sock = await server.connect("/v1/realtime")
        await sock.send({"type": "conversation.item.create", "item": item})
        await sock.recv_until("conversation.item.done")
        answers = []
        for frame in (
            {"type": "conversation.item.create", "item": item},
            {"type": "conversation.item.retrieve", "item_id": "item_gone"},
            {"type": "conversation.item.truncate", "item_id": "item_gone", "content_index": 0, "audio_end_ms": 0},
        ):
            await sock.send(frame)
            answers.append((await sock.recv())["error"])
        await sock.close()
        return answers

    assert [(e["code"], e["message"]) for e in run(scenario())] == [
        ("item_create_duplicate_item_id", "Item with id 'item_x' already exists."),
        ("item_retrieve_invalid_item_id", "Error retrieving item: the item with id 'item_gone' does not exist."),
        ("item_truncate_invalid_item_id", "Error truncating item: the item with id 'item_gone' does not exist."),
    ]


def test_semantic_vad_turns_are_cut_by_the_server_vad(server):
    turns = wav_pcm("turns_24k.wav")
    split = 6_600 * 48  # the first turn ends (VAD, 500 ms of silence) at 6,050 ms

    async def scenario():
        sock = await server.connect("/v1/realtime")
        updated = await sock.update({"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "medium"}}}})
        await sock.append(turns[:split])
        first = await sock.recv_until("response.done")
        await sock.close()
        return updated, first

    updated, first = run(scenario())
    assert updated["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    assert types_of(first) == [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        *COMMIT,
        *RESPONSE_HEAD,
        *RESPONSE_TAIL,
    ]
    assert (first[0]["audio_start_ms"], first[1]["audio_end_ms"]) == (1210, 6050)


def test_an_update_that_leaves_turn_detection_alone_keeps_a_turn_in_progress(server, question_pcm):
    async def scenario():
        sock = await server.connect("/v1/realtime")
        await sock.append(question_pcm[:96_000])  # 2 s: speech has started, not stopped
        started = await sock.recv_until("input_audio_buffer.speech_started")
        updated = await sock.update({"tracing": "auto", "instructions": "be brief"})
        await sock.append(question_pcm[96_000:] + silence(600))
        rest = await sock.recv_until("response.done")
        await sock.close()
        return started, updated, rest

    started, updated, rest = run(scenario())
    assert updated["session"]["tracing"] == "auto" and updated["session"]["instructions"] == "be brief"
    assert types_of(rest) == ["input_audio_buffer.speech_stopped", *COMMIT, *RESPONSE_HEAD, *RESPONSE_TAIL]
    assert rest[0]["item_id"] == rest[1]["item_id"] == started[-1]["item_id"]


def test_function_call_items_are_echoed_in_their_ga_shape(server):
    call = {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Paris"}'}
    output = {"type": "function_call_output", "call_id": "call_1", "output": '{"sky": "clear"}'}

    async def scenario():
        sock = await server.connect("/v1/realtime")
        await sock.send({"type": "conversation.item.create", "item": call})
        first = await sock.recv_until("conversation.item.done")
        await sock.send({"type": "conversation.item.create", "item": output})
        second = await sock.recv_until("conversation.item.done")
        await sock.close()
        return first, second

    first, second = run(scenario())
    echoed = first[0]["item"]
    assert {k: echoed[k] for k in call} == call
    assert (echoed["object"], echoed["status"]) == ("realtime.item", "completed")
    assert second[0]["item"]["output"] == output["output"] and second[0]["previous_item_id"] == echoed["id"]


@pytest.mark.parametrize(
    ("item", "code", "param"),
    [
        ({"type": "function_call", "arguments": "{}"}, "missing_field", "item.name"),
        ({"type": "function_call_output", "call_id": "c", "output": 5}, "invalid_value", "item.output"),
        ({"type": "message", "role": "system", "content": [{"type": "input_audio"}]}, "invalid_value", "item.content[0].type"),
        (
            {"type": "message", "role": "assistant", "content": [{"type": "text", "text": "hi"}]},
            "invalid_value",
            "item.content[0].type",
        ),
        (
            {"type": "message", "role": "user", "content": [{"type": "input_text", "txt": "hi"}]},
            "unknown_parameter",
            "item.content[0].txt",
        ),
        ({"type": "message", "role": "user", "content": [], "name": "x"}, "unknown_parameter", "item.name"),
        ({"type": "message", "role": "user", "content": [], "status": "done"}, "invalid_value", "item.status"),
    ],
)
def test_an_item_off_the_ga_shape_is_refused_by_name(server, item, code, param):
    async def scenario():
        sock = await server.connect("/v1/realtime")
        await sock.send({"type": "conversation.item.create", "item": item})
        error = await sock.recv()
        await sock.close()
        return error

    error = run(scenario())["error"]
    assert (error["code"], error["param"]) == (code, param)


def test_previous_item_id_root_inserts_at_the_start(server):
    def text(words: str) -> dict:
        return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": words}]}

    async def scenario():
        sock = await server.connect("/v1/realtime")
        await sock.send({"type": "conversation.item.create", "item": {**text("second"), "id": "item_b"}})
        await sock.recv_until("conversation.item.done")
        await sock.send(
            {"type": "conversation.item.create", "previous_item_id": "root", "item": {**text("first"), "id": "item_a"}}
        )
        added = (await sock.recv_until("conversation.item.done"))[0]
        history = server.on_loop(lambda: [item["id"] for item in server.session(sock.session_id).history])
        await sock.close()
        return added, history

    added, history = run(scenario())
    assert (added["item"]["id"], added["previous_item_id"], history) == ("item_a", None, ["item_a", "item_b"])
