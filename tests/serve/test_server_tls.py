"""``wss://`` with uvicorn's TLS (``cadence-fx serve --ssl-keyfile --ssl-certfile``), and the
subprotocols OpenAI's browser clients offer in the WebSocket handshake."""

from __future__ import annotations

import ssl

import httpx
import openai
import websockets
from servekit import GA_SCHEMA, CheckedSocket, run
from tlskit import self_signed

from cadence_fx.serve.app import background_server
from cadence_fx.serve.plugins import ToneModel
from cadence_fx.serve.protocol import audio as wire_audio
from cadence_fx.serve.session import Limits


def test_the_realtime_subprotocol_is_echoed_and_the_key_entry_tolerated(server):
    offer = ["realtime", "openai-insecure-api-key.sk-test", "openai-beta.realtime-v1"]

    async def scenario():
        async with websockets.connect(server.handle.ws_url + "/v1/realtime", subprotocols=offer) as ws:
            sock = CheckedSocket(ws, duplex=False)
            return ws.subprotocol, (await sock.recv())["type"]

    assert run(scenario()) == ("realtime", "session.created")


def test_a_handshake_without_subprotocols_selects_none(server):
    async def scenario():
        async with websockets.connect(server.handle.ws_url + "/v1/realtime") as ws:
            return ws.subprotocol, ws.response.headers.get("Sec-WebSocket-Protocol")

    assert run(scenario()) == (None, None)


def test_openai_sdk_runs_a_turn_over_wss_with_a_self_signed_certificate(tmp_path, question_pcm):
    tls = self_signed(tmp_path)
    trust = ssl.create_default_context(cafile=tls.certfile)

    async def scenario(handle):
        client = openai.AsyncOpenAI(api_key="unused-locally", websocket_base_url=handle.ws_url + "/v1")
        types = []
        async with client.realtime.connect(model="tone", websocket_connection_options={"ssl": trust}) as connection:
            await connection.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            await connection.input_audio_buffer.append(audio=wire_audio.b64encode(question_pcm))
            await connection.input_audio_buffer.commit()
            await connection.response.create()
            while True:
                raw = await connection.recv_bytes()
                GA_SCHEMA.validate_json(raw)
                event = connection.parse_event(raw)
                types.append(event.type)
                if event.type == "response.done":
                    return event.response.status, types

    with background_server(lambda: ToneModel(), Limits(max_sessions=4), tls=tls) as handle:
        assert handle.ws_url.startswith("wss://")
        status, types = run(scenario(handle))
        health = httpx.get(handle.http_url + "/health", verify=trust).json()
    assert status == "completed" and types.count("response.output_audio.delta") == 56
    assert health["model"] == "tone"
