"""pipecat-ai's OpenAIRealtimeLLMService in a pipeline against cadence-fx serve: its session
update, a server-VAD turn answered with audio, and speech over the reply (pipecat truncates the
reply and the server cancels it)."""

from __future__ import annotations

import asyncio
from importlib.metadata import version

from common import MODEL, WS, Checks, pcm24k, silence
from pipecat.frames.frames import EndFrame, ErrorFrame, InputAudioRawFrame, TTSAudioRawFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.workers.runner import WorkerRunner


class Tap(FrameProcessor):
    """Counts the reply's audio frames and keeps every error frame, in either direction."""

    def __init__(self) -> None:
        super().__init__()
        self.audio_frames = 0
        self.first_audio = asyncio.Event()
        self.errors: list[str] = []

    async def process_frame(self, frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.audio_frames += 1
            self.first_audio.set()
        elif isinstance(frame, ErrorFrame):
            self.errors.append(frame.error)
        await self.push_frame(frame, direction)


async def main() -> None:
    checks = Checks("pipecat-ai", version("pipecat-ai"))
    llm = OpenAIRealtimeLLMService(
        api_key="unused", base_url=WS + "/v1/realtime", settings=OpenAIRealtimeLLMService.Settings(model=MODEL)
    )
    upstream, downstream = Tap(), Tap()
    task = PipelineWorker(
        Pipeline([upstream, llm, downstream]), params=PipelineParams(audio_in_sample_rate=24_000, audio_out_sample_rate=24_000)
    )
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(task)
    running = asyncio.create_task(runner.run())

    async def speak(pcm: bytes) -> None:
        for i in range(0, len(pcm), 960):  # 20 ms frames, in real time
            await task.queue_frame(InputAudioRawFrame(audio=pcm[i : i + 960], sample_rate=24_000, num_channels=1))
            await asyncio.sleep(0.02)

    await asyncio.sleep(1.0)  # connect, session.created, pipecat's session.update
    await speak(pcm24k("question_24k.wav") + silence(800))
    try:
        await asyncio.wait_for(downstream.first_audio.wait(), 20)
    except TimeoutError:
        pass
    checks.check("server VAD turn answered with audio", downstream.first_audio.is_set(), "no audio within 20 s")
    await asyncio.sleep(0.3)
    before = downstream.audio_frames
    await speak(pcm24k("interrupt_24k.wav") + silence(800))
    await asyncio.sleep(2.0)
    checks.check(
        "speech over the reply handled without an error frame",
        not upstream.errors and not downstream.errors,
        f"{upstream.errors + downstream.errors}",
    )
    checks.check(
        "the interruption is answered too",
        downstream.audio_frames > before,
        f"{downstream.audio_frames - before} audio frames after the interruption",
    )
    await task.queue_frame(EndFrame())
    await asyncio.wait_for(running, 20)
    checks.report()


asyncio.run(main())
