"""livekit-agents' OpenAI realtime model (livekit-plugins-openai) against cadence-fx serve: its
default session (semantic_vad, transcription), a server-VAD turn, generate_reply(), and a barge-in
(speech over a reply, then the truncate and the cancel livekit sends on an interruption)."""

from __future__ import annotations

import asyncio
from importlib.metadata import version

import aiohttp
from common import MODEL, WS, Checks, pcm24k, silence
from livekit import rtc
from livekit.plugins.openai.realtime import RealtimeModel


def frames(pcm: bytes, ms: int = 20):
    step = 48 * ms
    for i in range(0, len(pcm) - step + 1, step):
        yield rtc.AudioFrame(pcm[i : i + step], sample_rate=24_000, num_channels=1, samples_per_channel=step // 2)


async def audio_of(generation, first_frame: asyncio.Event | None = None) -> tuple[str, int]:
    """The message id and the samples of a generation's audio, read to its end."""
    samples, message_id = 0, ""
    async for message in generation.message_stream:
        message_id = message.message_id
        async for frame in message.audio_stream:
            samples += frame.samples_per_channel
            if first_frame is not None:
                first_frame.set()
    return message_id, samples


async def main() -> None:
    checks = Checks("livekit-agents + livekit-plugins-openai", version("livekit-agents"))
    async with aiohttp.ClientSession() as http:
        model = RealtimeModel(base_url=WS.replace("ws", "http", 1) + "/v1", api_key="unused", model=MODEL, http_session=http)
        session = model.session()
        server_events: list[dict] = []
        errors: list = []
        generations: asyncio.Queue = asyncio.Queue()
        speech_started = asyncio.Event()
        session.on("openai_server_event_received", lambda e: server_events.append(e))
        session.on("error", lambda e: errors.append(e))
        session.on("generation_created", lambda g: generations.put_nowait(g))
        session.on("input_speech_started", lambda _: speech_started.set())

        def seen(kind: str) -> list[dict]:
            return [e for e in server_events if e["type"] == kind]

        for _ in range(100):
            if seen("session.updated"):
                break
            await asyncio.sleep(0.05)
        updated = seen("session.updated")
        checks.check(
            "default session.update (semantic_vad, transcription) accepted",
            bool(updated) and not seen("error"),
            f"errors: {seen('error')}",
        )

        for frame in frames(pcm24k("question_24k.wav") + silence(800)):
            session.push_audio(frame)
        try:
            generation = await asyncio.wait_for(generations.get(), 20)
            _, samples = await asyncio.wait_for(audio_of(generation), 30)
            checks.check("server VAD turn answered with audio", samples > 0, "no audio")
        except TimeoutError:
            checks.check("server VAD turn answered with audio", False, "no generation within 20 s")

        try:
            generation = await asyncio.wait_for(session.generate_reply(), 10)
            _, samples = await asyncio.wait_for(audio_of(generation), 30)
            checks.check("generate_reply() resolves (response.metadata echoed)", generation.user_initiated, "not user initiated")
            checks.check("generate_reply() reply has audio", samples > 0, "no audio")
        except Exception as exc:  # a timeout here is the bug this check exists for
            checks.check("generate_reply() resolves (response.metadata echoed)", False, repr(exc))

        # Barge-in: speak over the reply to a new turn as soon as its first audio arrives.
        while not generations.empty():  # generate_reply's generation is announced here too
            generations.get_nowait()
        speech_started.clear()
        for frame in frames(pcm24k("question_24k.wav") + silence(800)):
            session.push_audio(frame)
        generation = await asyncio.wait_for(generations.get(), 20)
        first = asyncio.Event()
        reading = asyncio.create_task(audio_of(generation, first))
        await asyncio.wait_for(first.wait(), 20)
        done_before = len(seen("response.done"))
        for frame in frames(pcm24k("interrupt_24k.wav")[: 48 * 600]):
            session.push_audio(frame)
        await asyncio.wait_for(speech_started.wait(), 10)
        message_id, _ = await asyncio.wait_for(reading, 30)
        cut = seen("response.done")[done_before:]
        checks.check("speech over a reply: input_speech_started", speech_started.is_set())
        checks.check(
            "speech over a reply cancels it (turn_detected)",
            bool(cut)
            and cut[0]["response"]["status"] == "cancelled"
            and cut[0]["response"]["status_details"]["reason"] == "turn_detected",
            f"response.done: {[c['response']['status'] for c in cut]}",
        )
        # What livekit's AgentSession does on an interruption: truncate what was heard, cancel.
        errors_before = len(seen("error"))
        session.truncate(message_id=message_id, modalities=["audio"], audio_end_ms=200)
        session.interrupt()
        for _ in range(40):
            if seen("conversation.item.truncated"):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        late_errors = seen("error")[errors_before:]
        checks.check("truncate of the interrupted reply", bool(seen("conversation.item.truncated")), f"errors: {late_errors}")
        checks.check(
            "cancel with nothing active is not logged as a failure",
            all(e["error"]["message"].startswith("Cancellation failed") for e in late_errors) and not errors,
            f"errors: {late_errors}, emitted: {errors}",
        )
        for frame in frames(silence(1000) + pcm24k("interrupt_24k.wav")[48 * 600 :] + silence(800)):
            session.push_audio(frame)
        await session.aclose()
        await model.aclose()
    checks.report()


if __name__ == "__main__":
    asyncio.run(main())
