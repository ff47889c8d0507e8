"""The openai Python SDK's realtime client against cadence-fx serve: a manual turn and a cancel,
every event parsed by the SDK's own types, over ws:// and over wss://."""

from __future__ import annotations

import asyncio
import base64
import ssl
from importlib.metadata import version

import openai
from common import MODEL, WS, WSS, Checks, pcm24k


async def turn(checks: Checks, base: str, label: str, options: dict) -> None:
    client = openai.AsyncOpenAI(api_key="unused", websocket_base_url=base + "/v1")
    async with client.realtime.connect(model=MODEL, websocket_connection_options=options) as connection:
        await connection.session.update(
            session={"type": "realtime", "model": MODEL, "audio": {"input": {"turn_detection": None}}}
        )
        await connection.input_audio_buffer.append(audio=base64.b64encode(pcm24k("question_24k.wav")).decode())
        await connection.input_audio_buffer.commit()
        await connection.response.create(response={"metadata": {"turn": label}})
        deltas, created, done = 0, None, None
        async for event in connection:  # every event parsed by the SDK's pydantic types
            if event.type == "response.created":
                created = event
            elif event.type == "response.output_audio.delta":
                deltas += 1
                if deltas == 3:
                    await connection.response.cancel(response_id=event.response_id)
            elif event.type == "error":
                checks.check(f"{label}: no error events", False, event.error.message)
            elif event.type == "response.done":
                done = event
                break
    checks.check(f"{label}: manual turn answered with audio", deltas >= 3, f"{deltas} deltas")
    checks.check(f"{label}: response.metadata echoed", created.response.metadata == {"turn": label})
    checks.check(f"{label}: response.cancel", done.response.status == "cancelled", done.response.status)


async def main() -> None:
    checks = Checks("openai (Python)", version("openai"))
    await turn(checks, WS, "ws", {})
    if WSS:
        await turn(checks, WSS, "wss", {"ssl": ssl.create_default_context()})  # trusts SSL_CERT_FILE
    checks.report()


asyncio.run(main())
