"""Moshi's text tokens as text: what a stream hands the session through ``take_text()``
(``serve/runtime/text.py``).

Moshi samples one text token per 80 ms frame, with that frame's audio (the vendor's
``tokens[:, 0]``). Its ids index a SentencePiece tokenizer: a checkpoint's own
(``tokenizer_spm_32k_3.model``), or, for random weights, ``stand_in_tokenizer``'s, which has a
piece for every id of the LM's text vocabulary (``padded_tokenizer``: the test checkpoints' too).
A piece is detokenized as the vendor's own server does it: ids 0 and 3 (end of padding, padding)
say nothing, and ``▁`` is a space. PersonaPlex's text tokens are Moshi's.
"""

from __future__ import annotations

import io
import struct
from pathlib import Path

import sentencepiece

SILENT_IDS = (0, 3)  # the vendor's server prints no text for these: end of padding and padding
SPACE = "\u2581"  # SentencePiece's word boundary
USER_DEFINED = 4  # SentencePiece.Type: a piece matched as a whole


def padded_tokenizer(model: bytes, card: int) -> bytes:
    """SentencePiece ``model`` with user-defined pieces ``▁w<id>`` appended up to ``card`` ids: the
    ids it has keep their pieces (and its encodings stay the same), and every id an LM with a text
    vocabulary of ``card`` samples has one. A test tokenizer trained on a few lines has tens of
    pieces; the LM samples any of its 32,000 ids. The pieces are appended to the serialized
    ``ModelProto``'s repeated field 1 (``SentencePiece {piece = 1, score = 2, type = 3}``), as the
    protobuf wire format merges a repeated field written later, then read and written again in order."""
    have = sentencepiece.SentencePieceProcessor(model_proto=model).get_piece_size()
    pieces = (
        _field(1, _field(1, f"{SPACE}w{i}".encode()) + b"\x15" + struct.pack("<f", 0.0) + b"\x18" + bytes([USER_DEFINED]))
        for i in range(have, card)
    )
    merged = sentencepiece.SentencePieceProcessor(model_proto=model + b"".join(pieces))
    return merged.serialized_model_proto()  # re-serialized in field order, as a trained model's file is


def stand_in_tokenizer(card: int) -> bytes:
    """A tokenizer for random weights: trained on two lines, padded to ``card`` ids."""
    lines = ["moshi listens and speaks at once", "a duplex model keeps its clock"] * 4
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=40,
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=1,
    )
    return padded_tokenizer(model.getvalue(), card)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


class TextPieces:
    """A tokenizer's pieces for the ids an LM with a text vocabulary of ``card`` samples; refused
    (``ValueError``) when the tokenizer has fewer pieces than that, so no sampled id is unreadable."""

    def __init__(self, model: bytes | Path, card: int, where: str) -> None:
        processor = sentencepiece.SentencePieceProcessor()
        try:
            if isinstance(model, Path):
                processor.Load(str(model))
            else:
                processor.LoadFromSerializedProto(model)
        except (OSError, RuntimeError) as error:
            raise ValueError(f"{where}: its text tokenizer is not a SentencePiece model ({error})") from None
        if processor.get_piece_size() < card:
            raise ValueError(
                f"{where}: its text tokenizer has {processor.get_piece_size()} pieces, fewer than the LM's text "
                f"vocabulary of {card} ids; expected a tokenizer with a piece for every id the LM samples"
            )
        self._processor = processor

    def text(self, token: int) -> str:
        """The text of one sampled id ("" for the silent ids)."""
        if token in SILENT_IDS:
            return ""
        return self._processor.IdToPiece(token).replace(SPACE, " ")
