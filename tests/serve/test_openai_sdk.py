"""The official ``openai`` SDK's realtime client runs a whole session against the service."""

from __future__ import annotations

import openai
from servekit import GA_SCHEMA, RESPONSE_HEAD, RESPONSE_TAIL, run, running

from cadence_fx.serve.protocol import audio as wire_audio


def test_openai_sdk_runs_update_append_commit_deltas_cancel_close(question_pcm):
    async def scenario(server):
        client = openai.AsyncOpenAI(api_key="unused-locally", websocket_base_url=server.handle.ws_url + "/v1")
        seen = []

        async def next_event():
            raw = await connection.recv_bytes()
            GA_SCHEMA.validate_json(raw)  # the GA schema, strictly, on the raw frame
            event = connection.parse_event(raw)  # and the SDK's own parsing
            seen.append(event.type)
            return event

        async with client.realtime.connect(model="tone") as connection:
            created = await next_event()
            limits = await next_event()
            await connection.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            updated = await next_event()
            await connection.input_audio_buffer.append(audio=wire_audio.b64encode(question_pcm))
            await connection.input_audio_buffer.commit()
            committed = await next_event()
            [await next_event() for _ in range(2)]
            await connection.response.create()
            audio = b""
            while (event := await next_event()).type != "response.output_audio.delta":
                pass
            audio += wire_audio.b64decode(event.delta)
            await connection.response.cancel(response_id=event.response_id)
            while (event := await next_event()).type != "response.done":
                if event.type == "response.output_audio.delta":
                    audio += wire_audio.b64decode(event.delta)
            done = event
        return created, limits, updated, committed, audio, done, seen

    with running(step_delay_s=0.05) as server:
        created, limits, updated, committed, audio, done, seen = run(scenario(server))
        ended = server.eventually(lambda: not server.handle.manager.sessions)
    assert created.type == "session.created" and created.session.model == "tone"
    assert [(r.name, r.limit, r.remaining) for r in limits.rate_limits] == [
        ("requests", 64, 63),
        ("tokens", 1 << 20, 1 << 20),
    ]
    assert updated.session.audio.input.turn_detection is None
    assert committed.type == "input_audio_buffer.committed"
    events = [t for t in seen if t != "response.output_audio.delta"]
    assert events == [
        "session.created",
        "rate_limits.updated",
        "session.updated",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
        *RESPONSE_HEAD,
        *RESPONSE_TAIL,
    ]
    assert done.response.status == "cancelled" and done.response.status_details.reason == "client_cancelled"
    assert 0 < len(audio) < 56 * 1920 and len(audio) == seen.count("response.output_audio.delta") * 1920
    assert ended  # a Realtime (non-duplex) session ends with its socket
