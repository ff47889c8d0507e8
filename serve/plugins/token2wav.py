"""``token2wav-full`` and ``token2wav``: MiniCPM-o 4.5's speech back end as the reply voice.

What runs. Token2Wav (the flow: conformer encoder and a 10-step CFM over a DiT; then the HiFT
vocoder) from minicpmo-utils 1.0.6, transformed by cadence-fx
(``transform((flow, hift), contract)``, ``models/token2wav_carry.py``): carries at the derived
bounds and, on a GPU, the CFM loop, the conformer encoder and HiFT replayed as CUDA graphs (the
SRc arm of ``bench/token2wav.py``). ``token2wav-full`` is the MiniCPM-o 4.5 configuration on a
CUDA device; ``token2wav`` is the reduced depth (1 + 1 conformer blocks, 2 DiT blocks) on the CPU,
for tests and for trying the mapping without a GPU. It does not keep real time there.

Weights. By default the weights are random (the reduced or the full configuration) and so is the
prompt state. ``weights`` (``--weights``) loads a published checkpoint instead, from a folder or
a hub id (``models/token2wav_checkpoint.py``), at the size its flow.yaml describes: the full
MiniCPM-o 4.5 flow on ``token2wav-full``; on the CPU (``token2wav``) whatever size it is.
``prompt`` (``--prompt``) is the speaker prompt: a prompt file written by ``cadence-fx prompt``,
or a WAV prepared at start-up by the vendor's own code (needs the prompt packages and CUDA); with
weights and no prompt, the model's reference voice (``assets/system_ref_audio.wav``) is prepared.
The contract follows the loaded flow's depth and the prompt's length.

What it says. In MiniCPM-o the LLM writes the speech tokens (25 a second) that Token2Wav turns
into 24 kHz speech. The LLM is not part of this plugin (no weights can be downloaded here), so a
reply's tokens come from a stand-in: a seeded pseudo-random token stream, one per stream and turn
(``token_seed``). The user's audio only sets the reply's length: as many 1-second chunks as the
turn has whole seconds, at least ``MIN_REPLY_CHUNKS`` and at most ``max_reply_chunks``. The
minimum comes from the contract: its catalog has the flushing last chunk only at the full cache
extent (``56@402``), which a reply's third chunk reaches. Each chunk is the vendor's streaming
step (``Token2wav.stream``): 28 tokens (25 + 3 look-ahead) to 50 mel frames to 24,000 samples; the
reply's last chunk flushes the tail (``last_chunk=True``). Every reply starts from the prompt state
(``reset_turn``), as a new utterance does in the vendor.

Sessions. One set of bindings (weights, captured graphs, prompt state) serves every stream. Each
stream owns a ``SessionState`` (its carries' contents and extents and its RNG state, seeded with
``rng_seed``) and a ``CarryStream`` (its cache dict and HiFT cache); a chunk swaps its state in,
runs, and swaps it out, under one lock (``TransformedFlow.swap_in`` / ``swap_out``). A stream's
audio is the stock vendor stream of its tokens from its seed, bit for bit.
``bench/results/token2wav_capacity.json`` measured 12 such streams in real time on an H200.

Construction builds the flow, sets up the prompt state and runs one warm-up reply of
``WARM_UP_CHUNKS`` chunks, which certifies and captures every catalog class, so no session's
chunk pays for a capture.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cadence_fx import transform
from cadence_fx.determinism import pin_deterministic
from cadence_fx.models import token2wav_checkpoint as checkpoint
from cadence_fx.models.token2wav_carry import (
    CarryStream,
    TransformedFlow,
    contract_for_flow,
    reference_flow,
)
from cadence_fx.models.token2wav_stream import Prompt, build_hift, random_chunks, random_prompt
from cadence_fx.transformed import SessionState

from .base import ModelPlugin, ModelStream, PluginInfo

INPUT_RATE = 24_000
FRAME_SAMPLES = 1_920  # 80 ms; the plugin only counts the user's samples
OUTPUT_RATE = 24_000
CHUNK_SAMPLES = 24_000  # one chunk: 25 tokens, 50 mel frames, 1 s
MIN_REPLY_CHUNKS = 3
WARM_UP_CHUNKS = 4  # extents 302, 352, 402, then the flush at 402: every class of the catalog
WARM_UP_SEED = 999_999  # tokens and RNG of the warm-up reply, which no session hears
DEPTHS = {"full": "cuda", "reduced": "cpu"}


def token_seed(stream: int, turn: int) -> int:
    """The seed of the stand-in token stream of a stream's turn (both counted from 0)."""
    return 1_000 * stream + turn


def rng_seed(seed: int, stream: int) -> int:
    """The seed of a stream's RNG state (HiFT draws noise every call)."""
    return seed + stream


def reply_chunks(turn_samples: int, max_reply_chunks: int) -> int:
    """Chunks in the reply to a turn of ``turn_samples`` input samples."""
    return min(max_reply_chunks, max(MIN_REPLY_CHUNKS, turn_samples // INPUT_RATE))


class Token2WavStream(ModelStream):
    def __init__(self, plugin: Token2WavPlugin, index: int) -> None:
        self._plugin = plugin
        self.index = index
        self.turn = 0
        self.turn_samples = 0
        self._stream = CarryStream(plugin.transformed, plugin.prompt)
        self._state: SessionState | None = None
        self._tokens: list[torch.Tensor] = []
        self._next = 0
        self._closed = False

    def feed(self, frame: np.ndarray) -> None:
        if frame.shape != (FRAME_SAMPLES,) or frame.dtype != np.float32:
            raise ValueError(f"a frame is float32 of shape ({FRAME_SAMPLES},), got {frame.dtype} of shape {frame.shape}")
        self.turn_samples += FRAME_SAMPLES

    def clear_input(self) -> None:
        self.turn_samples = 0

    def begin_response(self) -> None:
        n = reply_chunks(self.turn_samples, self._plugin.max_reply_chunks)
        self.turn_samples = 0
        plugin = self._plugin
        self._tokens = random_chunks(token_seed(self.index, self.turn), n, device=plugin.device)
        self._next = 0
        self.turn += 1
        with plugin.lock, torch.no_grad():
            if self._state is None:
                self._state = plugin.transformed.session_state(rng_seed(plugin.seed, self.index))
            plugin.transformed.swap_in(self._state)
            self._stream.reset_turn()  # the prompt state, written into the carries in place
            plugin.transformed.swap_out(self._state)

    def step(self) -> np.ndarray | None:
        if self._next >= len(self._tokens):
            self._tokens = []
            return None
        plugin, i = self._plugin, self._next
        self._next += 1
        with plugin.lock, torch.no_grad():
            plugin.transformed.swap_in(self._state)
            out = self._stream.step(self._tokens[i], last_chunk=i == len(self._tokens) - 1)
            plugin.transformed.swap_out(self._state)
            plugin.chunks += 1
            return out.speech.float().reshape(-1).cpu().numpy()

    def cancel(self) -> None:
        self._tokens = []

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._state, self._tokens = None, []
            self._plugin.open_streams -= 1


def _is_wav(prompt: str | Path | None) -> bool:
    """A prompt given as audio, to prepare, rather than as a saved prompt file."""
    return prompt is not None and Path(prompt).suffix.lower() == ".wav"


class Token2WavPlugin(ModelPlugin):
    def __init__(
        self,
        depth: str = "full",
        *,
        seed: int = 0,
        max_reply_chunks: int = 8,
        weights: str | Path | None = None,
        prompt: str | Path | None = None,
    ) -> None:
        if depth not in DEPTHS:
            raise ValueError(f"depth must be one of {sorted(DEPTHS)}, got {depth!r}")
        if max_reply_chunks < MIN_REPLY_CHUNKS:
            raise ValueError(f"max_reply_chunks must be at least {MIN_REPLY_CHUNKS} (the catalog's first flush), "
                             f"got {max_reply_chunks}")
        name = "token2wav-full" if depth == "full" else "token2wav"
        self.device = torch.device(DEPTHS[depth])
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"{name} runs MiniCPM-o 4.5's Token2Wav at full size on a CUDA device, and "
                               "torch.cuda.is_available() is False here; `token2wav` is the reduced depth on the CPU")
        if self.device.type == "cuda":
            pin_deterministic()  # for the process's life: a stream is bit-exact against deterministic eager
        self.depth, self.seed, self.max_reply_chunks = depth, seed, max_reply_chunks
        self.weights = None if weights is None else str(weights)
        if weights is None:
            flow, hift, self.prompt = self._random(prompt)
            what = f"{depth} depth, random weights"
        else:
            flow, hift, self.prompt = self._loaded(weights, prompt)
            what = f"weights from {weights}"
        checkpoint.prompt_frames_fit(self.prompt, flow.up_rate, str(prompt or "the prompt"))
        contract = contract_for_flow(flow, self.prompt.mels.shape[1])
        self.info = PluginInfo(
            name=name, input_rate=INPUT_RATE, output_rate=OUTPUT_RATE, frame_samples=FRAME_SAMPLES,
            description=f"MiniCPM-o 4.5 Token2Wav ({what}) transformed by cadence-fx, on stand-in speech tokens",
        )
        self.lock = threading.Lock()
        self.open_streams = self.streams = self.chunks = 0
        with torch.no_grad():
            self.transformed: TransformedFlow
            self.transformed, self.report = transform((flow, hift), contract, capture=False)
            del flow
            warm = CarryStream(self.transformed, self.prompt)
            warm.setup()  # the prompt state every reply starts from
            self.transformed.swap_in(self.transformed.session_state(WARM_UP_SEED))
            tokens = random_chunks(WARM_UP_SEED, WARM_UP_CHUNKS, device=self.device)
            for i, chunk in enumerate(tokens):
                warm.step(chunk, last_chunk=i == WARM_UP_CHUNKS - 1)

    def _random(self, prompt: str | Path | None) -> tuple[torch.nn.Module, torch.nn.Module, Prompt]:
        """The reference flow at this depth with random weights; a random prompt unless a prompt
        file is given (a WAV needs the checkpoint's speech tokenizer and speaker model)."""
        if _is_wav(prompt):
            raise ValueError(f"--prompt {prompt} is a WAV; preparing it needs the checkpoint's speech tokenizer "
                             "and speaker model: pass --weights too, or a prompt file written by `cadence-fx prompt`")
        loaded = None if prompt is None else checkpoint.load_prompt(prompt, device=self.device)
        tokens = None if loaded is None else loaded.tokens.shape[1]
        flow, _, tokens = reference_flow(self.depth, prompt_tokens=tokens)
        if loaded is None:
            loaded = random_prompt(self.seed, n_tokens=tokens, device=self.device)
        return flow.to(self.device), build_hift(device=self.device), loaded

    def _loaded(self, weights: str | Path, prompt: str | Path | None) -> tuple[torch.nn.Module, torch.nn.Module, Prompt]:
        """A published checkpoint's flow and HiFT; the prompt from its file, or prepared from a WAV
        (the model's reference voice when none is given)."""
        from_audio = prompt is None or _is_wav(prompt)
        files = checkpoint.STREAM_FILES + (checkpoint.PROMPT_FILES if from_audio else ())
        found = checkpoint.locate_checkpoint(weights, files, reference_voice=prompt is None)
        if not from_audio:
            loaded = checkpoint.load_prompt(prompt, device=self.device)
        else:
            loaded = checkpoint.prepare_prompt(found, prompt or found.reference_voice).to(self.device)
        flow = checkpoint.load_flow(found, seed=self.seed, device=self.device)
        return flow, checkpoint.load_hift(found, device=self.device), loaded

    def open_stream(self) -> Token2WavStream:
        stream = Token2WavStream(self, self.streams)
        self.streams += 1
        self.open_streams += 1
        return stream

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.info.name,
            "depth": self.depth,
            "weights": self.weights or "random",
            "device": str(self.device),
            "streams": self.streams,
            "streams_open": self.open_streams,
            "chunks": self.chunks,
            "stamps": list(self.report.stamps),
            "replays": {name: engine.counters.as_dict() for name, engine in self.report.replays.items()},
        }
