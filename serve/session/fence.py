"""The response fence of a ``Session``: a response's lifecycle from ``response.create`` to its
terminal events, and the epoch that keeps a cancelled reply's late audio off the wire.

Every response belongs to the epoch in force when it was created. Cancel and barge-in advance the
epoch and emit the response's terminal events at once; chunks of an older epoch that arrive later
are dropped and counted, never emitted.

A reply's audio is the one thing not emitted by the owner: its task emits each chunk as the model
hands it over (on the event loop, through the fence), so a command that waits for the model (an
append's frames riding ticks of a batch) never holds a playing reply's audio back. A reply is
computed as fast as the model goes, or, with ``Limits.reply_lead_s``, at most that far ahead of its
playback (a model that ticks sessions together then ticks no faster than their clients play).
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..protocol import ProtocolError, ResponseParams, StreamResampler, client_commands, quoted
from ..protocol import audio as wire_audio
from ..protocol import events as ev
from .base import Response, new_id
from .conversation import Conversation
from .messages import Chunk, ReplyEnd
from .playback import ack_played_ms

log = logging.getLogger("cadence_fx.serve")


def assistant_item(item_id: str, status: str, content: list) -> dict:
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


class ResponseFence(Conversation):
    async def _response_create(self, cmd: client_commands.ResponseCreate | None = None, *, flush: bool = True) -> None:
        params = ResponseParams.parse(None if cmd is None else cmd.response, self.config, self.duplex)
        if self.active is not None:
            raise ProtocolError(
                "conversation_already_has_active_response",
                f"Conversation already has an active response in progress: {self.active.id}. "
                "Wait until the response is finished before creating a new one.",
            )
        if flush:
            await self._flush_frame()
        await self.port.call(self.stream.begin_response)
        response_id = new_id("resp")
        item_id = f"item_{response_id}"  # the reply's item, named as vLLM-Omni's clients expect
        previous = self.history[-1]["id"] if self.history else None
        resp = Response(
            id=response_id,
            item_id=item_id,
            epoch=self.epoch,
            turn_id=self.turn_id,
            params=params,
            previous_item_id=previous,
        )
        self.active = resp
        self.responses[resp.id] = resp
        self.last_response_id = resp.id
        self.ledgers.responses.created += 1
        self.emit(
            ev.ResponseCreated(
                response=self._response_wire(resp, "in_progress", []),
                response_id=resp.id,
                epoch=resp.epoch,
                turn_id=resp.turn_id,
                instructions=params.instructions,
            )
        )
        item = assistant_item(item_id, "in_progress", [])
        self.emit(ev.ResponseOutputItemAdded(response_id=resp.id, output_index=0, item=item))
        if params.in_conversation:
            self._add_item(item, previous, done=False)
        self.emit(
            ev.ResponseContentPartAdded(
                response_id=resp.id,
                item_id=item_id,
                output_index=0,
                content_index=0,
                part={"type": "audio", "transcript": ""},
            )
        )
        self._runner = asyncio.get_running_loop().create_task(self._run_reply(resp), name=f"reply {resp.id}")

    async def _response_cancel(self, cmd: client_commands.ResponseCancel) -> None:
        if self.active is None or (cmd.response_id is not None and cmd.response_id != self.active.id):
            # OpenAI's wording: clients match on its prefix ("Cancellation failed").
            raise ProtocolError("response_cancel_not_active", "Cancellation failed: no active response found", "response_id")
        await self._cancel("client_cancelled")

    async def _output_clear(self, cmd: client_commands.OutputAudioBufferClear) -> None:
        if self.active is not None:
            response_id = self.active.id
            await self._cancel("client_cancelled")
        elif self.last_response_id is not None:
            response_id = self.last_response_id
        else:
            raise ProtocolError("response_cancel_not_active", "no response has produced audio")
        self.emit(ev.OutputAudioBufferCleared(response_id=response_id))

    async def _playback_ack(self, cmd: client_commands.PlaybackAck) -> None:
        response_id = cmd.response_id or (self.active.id if self.active is not None else self.last_response_id)
        response = self.responses.get(response_id) if response_id is not None else None
        if response is None:
            why = f"no response {quoted(cmd.response_id)}" if cmd.response_id else "no response has been created"
            raise ProtocolError("invalid_value", why, "response_id")
        delivered_ms = response.output_format.ms(response.out_samples)
        played = ack_played_ms(cmd, response.id, response.item_id, delivered_ms)
        if played > response.acked_ms:
            self.ledgers.playback.acked_ms += played - response.acked_ms
            response.acked_ms = played

    async def _barge_in(self, cmd: client_commands.BargeInCommand) -> None:
        """The client's barge-in: as the VAD's, the reply is cancelled and ``barge_in`` announces it,
        at the input received so far."""
        if self.active is None:
            raise ProtocolError("response_cancel_not_active", "Barge-in failed: no active response found", "type")
        received = self.ledgers.input.received_bytes // self.config.input_format.bytes_per_sample
        self.emit(
            ev.BargeIn(response_id=self.active.id, audio_start_ms=self.config.input_format.ms(received), epoch=self.epoch + 1)
        )
        await self._cancel("client_barge_in")

    async def _run_reply(self, resp: Response) -> None:
        resampler = StreamResampler(self.plugin.info.output_rate, resp.output_format.rate)

        def current() -> bool:
            return self.epoch == resp.epoch and not self.closed

        # Pacing (Limits.reply_lead_s): the reply's playback clock starts at its first chunk; a
        # chunk is computed only once the audio handed out is at most ``lead`` ahead of it.
        lead, rate = self.limits.reply_lead_s, self.plugin.info.output_rate
        clock: float | None = None
        handed_s = last_s = 0.0
        try:
            while True:
                ahead = 0.0 if clock is None else handed_s - (time.monotonic() - clock)
                if lead and ahead > lead:
                    self._reply_paused = True
                    try:
                        await asyncio.sleep(ahead - lead)
                    finally:
                        self._reply_paused = False
                    ahead = lead
                # The next call follows this one at once unless the chunk it brings puts the reply past its lead.
                follows = not lead or ahead + last_s <= lead
                rendered = await self.port.call(self._render, resampler, resp.output_format, guard=current, follows=follows)
                if rendered is None:
                    break
                self._on_chunk(Chunk(resp.epoch, resp.id, *rendered))
                clock = time.monotonic() if clock is None else clock
                last_s = rendered[0] / rate
                handed_s += last_s
            self.mailbox.put_nowait(ReplyEnd(resp.epoch, resp.id, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("model failed in response %s", resp.id)
            self.mailbox.put_nowait(ReplyEnd(resp.epoch, resp.id, f"{type(exc).__name__}: {exc}"))

    def _render(self, resampler: StreamResampler, fmt: wire_audio.AudioFormat) -> tuple[int, bytes, str] | None:
        """Worker thread: one native chunk, converted to the output format, and its text."""
        chunk = self.stream.step()
        if chunk is None:
            return None
        text = self._take_text() if self._take_text is not None else ""
        return len(chunk), wire_audio.encode_samples(resampler.process(chunk), fmt), text

    def _on_chunk(self, msg: Chunk) -> None:
        playback = self.ledgers.playback
        playback.generated_samples += msg.model_samples
        resp = self.active
        if resp is None or msg.epoch != self.epoch or resp.id != msg.response_id:
            playback.dropped_samples += msg.model_samples
            return
        playback.delivered_samples += msg.model_samples
        playback.delivered_bytes += len(msg.data)
        if self.duplex and not resp.spoke:
            resp.spoke = True
            self.emit(ev.ResponseSpeak(response_id=resp.id, item_id=resp.item_id))
        offset = resp.out_samples
        resp.out_samples += resp.output_format.samples(len(msg.data))
        self.emit(
            ev.ResponseOutputAudioDelta(
                response_id=resp.id,
                item_id=resp.item_id,
                output_index=0,
                content_index=0,
                delta=wire_audio.b64encode(msg.data),
                epoch=resp.epoch,
                turn_id=resp.turn_id,
                audio_offset=offset,
                format=wire_audio.BETA_NAME[resp.output_format.encoding],
                sample_rate_hz=resp.output_format.rate,
            )
        )
        if msg.text:
            resp.transcript += msg.text
            self.emit(
                ev.ResponseOutputAudioTranscriptDelta(
                    response_id=resp.id, item_id=resp.item_id, output_index=0, content_index=0, delta=msg.text
                )
            )

    def _on_reply_end(self, msg: ReplyEnd) -> None:
        resp = self.active
        if resp is None or msg.epoch != self.epoch or resp.id != msg.response_id:
            return
        self.active = None
        if msg.error is None:
            self._finish(resp, "completed", None)
        else:
            details = {
                "type": "failed",
                "error": {"type": "server_error", "code": "server_error", "message": msg.error},
            }
            self._finish(resp, "failed", details)

    async def _cancel(self, reason: str) -> None:
        resp = self.active
        assert resp is not None
        self.active = None
        self.epoch += 1
        self._finish(resp, "cancelled", {"type": "cancelled", "reason": reason})
        await self.port.call(self.stream.cancel)

    def _finish(self, resp: Response, status: str, details: dict | None) -> None:
        """The terminal events of ``resp``; after these nothing of its epoch is emitted."""
        counts = self.ledgers.responses
        setattr(counts, status, getattr(counts, status) + 1)
        item_status = "completed" if status == "completed" else "incomplete"
        item = assistant_item(resp.item_id, item_status, [{"type": "output_audio", "transcript": resp.transcript}])
        stored = self._find(resp.item_id)
        if stored is not None:
            stored.update(item)
            self._measure(stored)
        if self.duplex and not resp.spoke:  # not a sample of audio: the model listened
            listening = {"object": "realtime.response", "id": resp.id, "status": "listening", "metadata": None}
            self.emit(ev.ResponseListen(response_id=resp.id, response=listening))
        rid, iid = resp.id, resp.item_id
        self.emit(ev.ResponseOutputAudioDone(response_id=rid, item_id=iid, output_index=0, content_index=0, epoch=resp.epoch))
        if self._take_text is not None:
            self.emit(
                ev.ResponseOutputAudioTranscriptDone(
                    response_id=rid, item_id=iid, output_index=0, content_index=0, transcript=resp.transcript
                )
            )
        part = {"type": "audio", "transcript": resp.transcript}
        self.emit(ev.ResponseContentPartDone(response_id=rid, item_id=iid, output_index=0, content_index=0, part=part))
        self.emit(ev.ResponseOutputItemDone(response_id=resp.id, output_index=0, item=item))
        if resp.params.in_conversation:
            self.emit(ev.ConversationItemDone(item=item, previous_item_id=resp.previous_item_id))
        playback = {
            "audio_samples": resp.out_samples,
            "audio_ms": resp.output_format.ms(resp.out_samples),
            "format": resp.output_format.to_wire(),
        }
        self.emit(
            ev.ResponseDone(
                response=self._response_wire(resp, status, [item], details),
                response_id=resp.id,
                epoch=resp.epoch,
                turn_id=resp.turn_id,
                playback=playback,
            )
        )

    def _response_wire(self, resp: Response, status: str, output: list, details: dict | None = None) -> dict:
        return {
            "id": resp.id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": output,
            "conversation_id": self.conversation_id if resp.params.in_conversation else None,
            "output_modalities": ["audio"],
            "max_output_tokens": "inf",
            "audio": {"output": {"format": resp.output_format.to_wire(), "voice": resp.params.voice}},
            "usage": None,
            "metadata": resp.params.metadata,
        }
