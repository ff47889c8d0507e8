"""The input piece of a ``Session``: appends into the buffer and the model, the server VAD's
edges, commits that close a turn, and clear.

While a reply plays, an append's frames go to the model one call each, so the reply's next chunk
is computed between two of them rather than after all. Each VAD edge is handled where it falls in
its append: a speech start during a reply barges in (cancels it through the fence), a speech stop
commits the turn and may start a response.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..protocol import ProtocolError, client_commands
from ..protocol import events as ev
from .base import new_id
from .fence import ResponseFence


class InputTurns(ResponseFence):
    async def _on_vad_edge(self, edge: Any, after: int = 0) -> None:
        """``after``: the bytes of the append that came after the edge (for a stop, `_commit`'s)."""
        td = self.config.turn_detection
        if td is None:
            return
        if edge.kind == "started":
            self._vad_item_id = new_id("item")
            self.emit(ev.InputAudioBufferSpeechStarted(audio_start_ms=edge.ms, item_id=self._vad_item_id))
            listen_only = self.settings.overlap_policy == "listen_only"
            if self.active is not None and td.interrupt_response and not listen_only:
                if self.duplex:
                    self.emit(ev.BargeIn(response_id=self.active.id, audio_start_ms=edge.ms, epoch=self.epoch + 1))
                await self._cancel("turn_detected")
        else:
            item_id = self._vad_item_id or new_id("item")
            self._vad_item_id = item_id
            self.emit(ev.InputAudioBufferSpeechStopped(audio_end_ms=edge.ms, item_id=item_id))
            await self._commit(flush=False, after=after)
            if td.create_response and self.active is None:
                await self._response_create(flush=False)

    async def _append(self, cmd: client_commands.InputAudioBufferAppend) -> None:
        loop = asyncio.get_running_loop()
        try:
            if cmd.video_frames:
                raise ProtocolError(
                    "unsupported_feature",
                    f"video_frames are not served: {self.plugin.info.name} hears audio only",
                    "video_frames",
                )
            fmt = self.input.declared(cmd)
            data, frames, edges, resampled = await loop.run_in_executor(self.executor, self.input.ingest, cmd, fmt, self._vad)
        except ProtocolError as err:
            self.ledgers.input.rejected_appends += 1
            self.ledgers.input.rejected_bytes += err.audio_bytes
            raise
        led = self.ledgers.input
        led.received_bytes += len(data)
        led.resampled_samples += resampled
        self._buffer += data
        self._kept()
        # Each VAD edge is handled where it falls in the append: a turn ends at its stop, with the
        # bytes and frames before it; those after go on into the next turn (and while a reply is in
        # progress, a duplex model's frames after the stop are the reply's next ones).
        fed = 0
        for edge, at_byte, at_frame in edges:
            await self._feed(frames[fed:at_frame])
            fed = at_frame
            await self._on_vad_edge(edge, after=len(data) - at_byte)
        await self._feed(frames[fed:])
        led.pending_samples = len(self.input.frame)

    async def _commit(
        self, cmd: client_commands.InputAudioBufferCommit | None = None, *, flush: bool = True, after: int = 0
    ) -> str:
        """``flush``: close the turn on a whole native frame (a commit of the client's, which says no
        more audio of the turn is coming). A turn the server VAD ended does not: the audio after its
        end keeps coming, and the partial frame goes on into the next one. ``after``: the bytes at
        the buffer's end that came after the turn's end (the rest of the append its VAD stop fell
        in): they stay in the buffer, for the next turn."""
        turn = len(self._buffer) - after
        if turn <= 0:
            raise ProtocolError("input_audio_buffer_commit_empty", "the input audio buffer is empty")
        if flush:
            await self._flush_frame()
        item_id = self._vad_item_id or new_id("item")
        self._vad_item_id = None
        self.turn_id += 1
        data = bytes(self._buffer[:turn])
        del self._buffer[:turn]
        self.ledgers.input.committed_bytes += len(data)
        previous = self.history[-1]["id"] if self.history else None
        item = {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_audio", "transcript": None}],
        }
        self._user_audio[item_id] = data
        self._user_audio_bytes += len(data)
        self.emit(
            ev.InputAudioBufferCommitted(item_id=item_id, previous_item_id=previous, turn_id=self.turn_id, audio_bytes=len(data))
        )
        self._add_item(item, previous)
        return item_id

    async def _client_commit(self, cmd: client_commands.InputAudioBufferCommit) -> None:
        """The client's commit. ``final`` (the default) closes the turn on a whole frame; a non-final
        one leaves the partial frame for the rest of the turn. A response follows when
        ``response_create`` asks for one, or, without it, after a final commit in a session with
        ``extra_body.auto_response`` on (unless one is in progress: an asked-for one is then refused)."""
        final = cmd.final is not False
        respond = cmd.response_create if cmd.response_create is not None else final and self.settings.auto_response
        await self._commit(cmd, flush=final)
        if not respond:
            return
        if self.active is not None and cmd.response_create is None:
            return
        await self._response_create(flush=False)

    async def _clear(self, cmd: client_commands.InputAudioBufferClear | client_commands.InputCancel) -> None:
        cleared = len(self._buffer)
        self._buffer.clear()
        led = self.ledgers.input
        led.cleared_bytes += cleared
        led.discarded_samples += self.input.discard()
        led.pending_samples = 0
        await self.port.call(self.stream.clear_input)
        if self._vad is not None:
            self._vad = self._new_vad(self._vad.samples)
        self._vad_item_id = None
        self.emit(ev.InputAudioBufferCleared(audio_bytes=cleared))
