"""What PersonaPlex's tests share: a role prompt tokenized as the vendor tokenizes it, and
speech-like audio.

The role prompt is wrapped by the vendor's `wrap_with_system_tags` and tokenized by a SentencePiece
model trained here on that text: the vendor's tokenizer (`tokenizer_spm_32k_3.model`) is on the gated
hub with the weights, and the steps only need ids below the text card. The audio is synthetic (a
voiced tone with a syllable-rate envelope over noise), so no test reads anything from shared/.
"""

from __future__ import annotations

import io
import math
import tarfile
from pathlib import Path

import torch

from cadence_fx.models import personaplex, personaplex_stream
from cadence_fx.models.personaplex import FRAME_SIZE, SAMPLE_RATE

ROLE = (
    "You work for a bicycle repair shop and your name is Ada. Information: the shop opens at nine, "
    "a tune-up costs forty dollars and takes two days."
)
VOICE_SECONDS = 1.0
VOICE_FRAMES = math.ceil(VOICE_SECONDS * SAMPLE_RATE / FRAME_SIZE)  # the vendor pads the last frame: 13
SILENCE_FRAMES = 6  # `audio_silence_frame_cnt`, int(0.5 * 12.5), after each prompt


def speechlike(seconds: float, seed: int) -> torch.Tensor:
    """`(1, samples)` float32: a 140 Hz voiced tone with five harmonics, a 4 Hz syllable envelope, and noise."""
    generator = torch.Generator().manual_seed(seed)
    t = torch.arange(int(seconds * SAMPLE_RATE), dtype=torch.float64) / SAMPLE_RATE
    voiced = sum(torch.sin(2 * math.pi * 140 * k * t + k) / k for k in range(1, 6))
    envelope = 0.5 * (1 - torch.cos(2 * math.pi * 4 * t))
    noise = 0.02 * torch.randn(t.shape, generator=generator, dtype=torch.float64)
    return (0.1 * envelope * voiced + noise).to(torch.float32)[None]


def role_prompt_tokens(role: str = ROLE) -> tuple[list[int], str]:
    """`role` as `offline.py` makes it, wrapped in `<system>` tags, then tokenized; and the tokens
    decoded back."""
    import sentencepiece
    from personaplex_moshi.offline import wrap_with_system_tags

    text = wrap_with_system_tags(role)
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([text]),
        model_writer=model,
        vocab_size=200,
        model_type="bpe",
        hard_vocab_limit=False,
        minloglevel=2,
    )
    processor = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    tokens = processor.encode(text)
    return tokens, processor.decode(tokens)


def write_checkpoint(folder: Path, models: personaplex_stream.PersonaPlexModels) -> None:
    """`models` in the released layout of `nvidia/personaplex-7b-v1`: the LM in bfloat16 in
    `model.safetensors`, Mimi in `tokenizer-e351c8d8-checkpoint125.safetensors`, a SentencePiece
    model trained on the role prompt (padded to the LM's text vocabulary) in `tokenizer_spm_32k_3.model`, and `voices.tgz` holding
    `voices/ADA.pt`, the embeddings the vendor saves from a WAV."""
    import sentencepiece
    import sphn
    from safetensors.torch import save_file

    from cadence_fx.models.moshi_tokenizer import padded_tokenizer
    from cadence_fx.models.personaplex_prompt import prime

    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in models.lm.state_dict().items()}, str(folder / "model.safetensors")
    )
    save_file(
        {k: v.contiguous() for k, v in models.mimi.state_dict().items()},
        str(folder / "tokenizer-e351c8d8-checkpoint125.safetensors"),
    )
    text = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([personaplex_stream.role_prompt(ROLE)] * 4),
        model_writer=text,
        vocab_size=120,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    (folder / "tokenizer_spm_32k_3.model").write_bytes(padded_tokenizer(text.getvalue(), models.lm.text_card))
    # The vendor saves a WAV's embeddings next to it while it primes (`save_voice_prompt_embeddings`).
    wav = folder / "ADA.wav"
    sphn.write_wav(str(wav), speechlike(1.0, seed=1).numpy(), 24_000)
    gen = personaplex_stream.lm_gen(models.lm, sampling=False)
    gen.save_voice_prompt_embeddings = True
    with personaplex._vendor("utils.compile").no_compile(), models.mimi.streaming(1), gen.streaming(1):
        prime(models.mimi, gen, text_prompt_tokens=[], voice_prompt=str(wav))
    with tarfile.open(folder / "voices.tgz", "w:gz") as tar:
        tar.add(folder / "ADA.pt", arcname="voices/ADA.pt")
    wav.unlink()
    (folder / "ADA.pt").unlink()
