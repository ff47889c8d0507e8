"""Moshi's text tokens as the session's transcript: what ``take_text`` hands out is the text of
the token the vendor's batched loop sampled with each reply frame, detokenized (``models/moshi_tokenizer.py``),
in the server process and in a worker; over the OpenAI GA route, the transcript deltas, their
``.done`` and the reply item's transcript are that text (vLLM-Omni's client on the duplex route:
``test_vllm_omni_interop.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import sentencepiece
import torch
from servekit import Server, deltas_of, run, same

from cadence_fx.models.moshi_slots import Tick, vendor_slots
from cadence_fx.models.moshi_stream import build_models, random_pcm
from cadence_fx.models.moshi_tokenizer import TextPieces, padded_tokenizer, stand_in_tokenizer
from cadence_fx.serve.app import background_server
from cadence_fx.serve.client import read_wav
from cadence_fx.serve.plugins.moshi import FRAME_SAMPLES, MoshiPlugin
from cadence_fx.serve.protocol import audio as wire_audio
from cadence_fx.serve.protocol.audio import PCM24K
from cadence_fx.serve.session import Limits

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the reference and the runtime on one thread

CARD = 32_000  # Moshi's text vocabulary, at every size


def pieces_of(model: bytes) -> sentencepiece.SentencePieceProcessor:
    return sentencepiece.SentencePieceProcessor(model_proto=model)


def vendor_slot(plugin, slot: int = 0) -> tuple[list[np.ndarray], list[np.ndarray | None], list[int | None]]:
    """What slot ``slot``'s one session sent, and the vendor's batched loop's PCM and text token
    for it at each of its ticks (None before the acoustic delay)."""
    history = plugin.history(0)
    ticks = [Tick({s: torch.from_numpy(f) for s, f in r.frames.items()}, r.joins) for r in history]
    outputs = vendor_slots(build_models(plugin.config), plugin.slots, ticks, sampling=plugin.sampling, seed=plugin.seed)
    sent, pcm, text = [], [], []
    for record, out in zip(history, outputs, strict=True):
        if slot in record.frames:
            sent.append(record.frames[slot])
            row = out.slot(slot)
            pcm.append(None if row is None else row[1].numpy())
            text.append(None if row is None else int(row[0][0]))
    return sent, pcm, text


def spoken(tokens: list[int]) -> list[str]:
    """The vendor server's own detokenizing, on the stand-in tokenizer read here."""
    processor = pieces_of(stand_in_tokenizer(CARD))
    return ["" if t in (0, 3) else processor.id_to_piece(t).replace("\u2581", " ") for t in tokens]


def test_the_stand_in_tokenizer_has_a_piece_for_every_id_and_padding_keeps_the_trained_ones():
    trained = pieces_of(stand_in_tokenizer(CARD))
    assert trained.get_piece_size() == CARD
    assert [trained.id_to_piece(i) for i in (CARD - 2, CARD - 1)] == ["\u2581w31998", "\u2581w31999"]
    small = stand_in_tokenizer(0)  # nothing appended: the trained model alone
    padded = pieces_of(padded_tokenizer(small, 100))
    assert [pieces_of(small).id_to_piece(i) for i in range(pieces_of(small).get_piece_size())] == [
        padded.id_to_piece(i) for i in range(pieces_of(small).get_piece_size())
    ]
    for line in ("moshi listens and speaks at once", "a clock keeps its duplex model"):
        assert padded.encode(line) == pieces_of(small).encode(line)
    text = TextPieces(stand_in_tokenizer(CARD), CARD, "here")
    assert [text.text(i) for i in (0, 3, CARD - 1)] == ["", "", " w31999"]


def test_a_tokenizer_without_a_piece_for_every_id_is_refused_by_name():
    small = stand_in_tokenizer(0)
    have = pieces_of(small).get_piece_size()
    with pytest.raises(ValueError) as refused:
        TextPieces(small, CARD, "moshi-tiny checkpoint 'x'")
    assert str(refused.value) == (
        f"moshi-tiny checkpoint 'x': its text tokenizer has {have} pieces, fewer than the LM's text vocabulary "
        f"of {CARD} ids; expected a tokenizer with a piece for every id the LM samples"
    )
    with pytest.raises(ValueError, match=r"^here: its text tokenizer is not a SentencePiece model \("):
        TextPieces(b"not a model", CARD, "here")


@pytest.mark.parametrize("processes", [0, 1], ids=["in-process", "worker"])
def test_take_text_is_the_text_of_the_token_sampled_with_each_reply_frame(processes):
    plugin = MoshiPlugin(slots=2, record=True, processes=processes)
    try:
        stream = plugin.open_stream()
        turn = list(random_pcm(6, seed=3).reshape(6, FRAME_SAMPLES).numpy())
        for frame in turn:
            stream.feed(frame)
        stream.begin_response()
        pcm, said = [], []
        while (chunk := stream.step()) is not None:
            pcm.append(chunk)
            said.append(stream.take_text())
        assert stream.step() is None and stream.take_text() == ""  # no frame: no text
        stream.close()
        sent, want_pcm, tokens = vendor_slot(plugin)
    finally:
        plugin.close()
    assert len(pcm) == 6 and same(pcm, want_pcm[5:])  # the reply opens with the turn's last frame
    assert said == spoken(tokens[5:])
    assert sum(bool(text) for text in said) >= 3  # random weights sample ids far from the silent ones


def test_the_ga_route_sends_the_text_as_transcript_deltas_its_done_and_the_items_transcript():
    samples, _ = read_wav("tests/serve/audio/question_24k.wav")
    fed, reply_frames = -(-len(samples) // FRAME_SAMPLES), 8

    async def scenario(server: Server):
        sock = await server.connect("/v1/realtime")
        events = await sock.reply_to(wire_audio.encode_samples(samples, PCM24K), timeout=50)
        await sock.close()
        return events

    served = MoshiPlugin(max_reply_frames=reply_frames, record=True)
    with background_server(lambda: served, Limits(max_sessions=2)) as handle:
        events = run(scenario(Server(handle)))
    _, want_pcm, tokens = vendor_slot(served)
    texts = spoken(tokens[fed - 1 :])
    assert deltas_of(events) == wire_audio.encode_samples(np.concatenate(want_pcm[fed - 1 :]), PCM24K)
    reply = events[next(i for i, e in enumerate(events) if e["type"] == "response.created") :]
    kinds = [e["type"] for e in reply]
    audio_at = [i for i, k in enumerate(kinds) if k == "response.output_audio.delta"]
    # After each chunk's audio, its text (a frame whose token is silent sends none).
    expected = []
    for text in texts:
        expected += ["response.output_audio.delta"] + (["response.output_audio_transcript.delta"] if text else [])
    assert kinds[audio_at[0] : audio_at[-1] + 1 + bool(texts[-1])] == expected
    assert [e["delta"] for e in reply if e["type"] == "response.output_audio_transcript.delta"] == [t for t in texts if t]
    transcript = "".join(texts)
    assert kinds[audio_at[-1] + 1 + bool(texts[-1]) :] == [
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    done = {e["type"]: e for e in reply}
    assert done["response.output_audio_transcript.done"]["transcript"] == transcript
    assert done["response.content_part.done"]["part"] == {"type": "audio", "transcript": transcript}
    assert done["response.output_item.done"]["item"]["content"][0]["transcript"] == transcript
    assert done["response.done"]["response"]["output"][0]["content"][0]["transcript"] == transcript
