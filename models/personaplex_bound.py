"""One PersonaPlex session at a time (batch 1) on the one pipeline: `transform_personaplex`.

Mimi and a streaming `LMGen` are each transformed from their binding (`models/personaplex.py`:
`MIMI_BINDING`, `LM_BINDING`) on a copy of the modules around the caller's weights; the vendor's
glue then calls the bound LM steps where it calls its own CUDA-graph wrappers (`graphed_main`,
`graphed_depth`). `BoundPersonaPlex` runs the vendor's session (`vendor_loop`) on them, steps a
prompt once into a prompt state, and starts a session from one.

What the pipeline does not do yet for Mimi's None-until-first-call state (tests/test_personaplex.py):
a counter is taken as a tensor (state at one address) or a host value once, at the operator's first
call, so `transform_personaplex` primes Mimi first (`_prime_mimi`). A reset's Nones change the
module settings' paths; each set of paths keeps its version, so each stage has three programs (the
priming frame, a reset's first frame, the steady frame) and every frame runs its graph.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from cadence_fx.contract import Contract

from .personaplex import FRAME_SIZE, LM_BINDING, MIMI_BINDING, _vendor, check_models
from .personaplex_stream import PersonaPlexModels, StreamOutput, lm_gen, user_phase, vendor_loop

__all__ = ["BoundPersonaPlex", "transform_personaplex", "used_codebooks"]


@dataclass
class BoundPersonaPlex:
    """Mimi and the LM at batch 1, their four operators bound (`bound["mimi"]`, `bound["lm"]`):
    `stream(...)` runs `vendor_loop` on them, the vendor's glue calling the bound operators."""

    models: PersonaPlexModels
    lm_gen: Any
    bound: dict[str, Any]
    reports: dict[str, Any]
    streaming: ExitStack

    def stream(
        self, pcm: torch.Tensor, *, sampling: bool, seed: int, text_prompt_tokens: Sequence[int], voice_prompt: str | None = None
    ) -> StreamOutput:
        """As `stream_reference` computes it, on the bound operators."""
        compile_ = _vendor("utils.compile")
        gen = self.lm_gen
        gen.use_sampling = sampling
        # The vendor's own CUDA-graph wrappers off (its flag, read on every call): the bound operators
        # replay instead, the glue between them runs eagerly, as the vendor's does.
        with compile_.no_compile(), compile_.no_cuda_graph():
            return vendor_loop(
                self.bound["mimi"], gen, pcm, seed=seed, text_prompt_tokens=text_prompt_tokens, voice_prompt=voice_prompt
            )

    def prompt_state(
        self,
        *,
        voice: str,
        text_prompt_tokens: Sequence[int],
        voice_prompt: str | None = None,
        voice_prompt_embeddings: str | None = None,
    ) -> Any:
        """The vendor's priming stepped once on the bound operators (`personaplex_prompt.prime`),
        its state captured (`personaplex_prompt.capture`, keyed by `voice` and the role's tokens).
        The caller's generators are left as they were (priming draws, and throws its draws away)."""
        from .personaplex_prompt import capture, prime

        compile_ = _vendor("utils.compile")
        device = self.models.lm.device
        with (
            torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []),
            compile_.no_compile(),
            compile_.no_cuda_graph(),
        ):
            prime(
                self.bound["mimi"],
                self.lm_gen,
                text_prompt_tokens=text_prompt_tokens,
                voice_prompt=voice_prompt,
                voice_prompt_embeddings=voice_prompt_embeddings,
            )
        return capture(self.lm_gen, voice=voice, role=text_prompt_tokens)

    def stream_primed(self, state: Any, pcm: torch.Tensor, *, sampling: bool, generator: torch.Tensor) -> StreamOutput:
        """A session that starts from a prompt state instead of stepping its prompts: Mimi reset,
        `state` copied into the `LMGen` (`personaplex_prompt.restore`), the device's generator set to
        `generator` (the session's draws start there), then `user_phase` on the bound operators."""
        from cadence_fx.multiplex import rng_set

        from .personaplex_prompt import restore

        compile_ = _vendor("utils.compile")
        self.lm_gen.use_sampling = sampling
        with compile_.no_compile(), compile_.no_cuda_graph(), torch.no_grad():
            self.bound["mimi"].reset_streaming()
            restore(self.lm_gen, state)
            rng_set(self.models.lm.device, generator)
            return user_phase(self.bound["mimi"], self.lm_gen, pcm)

    @property
    def report(self) -> Any:
        from cadence_fx.transform import TransformReport

        return TransformReport.merged(list(self.reports.values()))

    def close(self) -> None:
        self.streaming.close()


def transform_personaplex(models: PersonaPlexModels, contract: Contract, **options: Any) -> BoundPersonaPlex:
    """`models` for one session at a time at batch 1, each transformed from its binding on the one
    pipeline (`options` are `transform`'s): the modules deep-copied around the caller's weights
    (shared, not copied), an `LMGen` on the copy, both streaming for good; Mimi from `MIMI_BINDING`,
    the `LMGen` from `LM_BINDING`, whose bound steps then stand where the vendor's glue calls its own
    CUDA-graph wrappers (`graphed_main`, `graphed_depth`). The lazily derived codebook caches the
    calls read are filled first, as the vendor's first call would."""
    from cadence_fx.transform import transform

    check_models(models, contract)
    with torch.no_grad():
        for codebook in used_codebooks(models.mimi):
            if codebook._embedding is None:
                codebook.embedding  # noqa: B018 - fills the vendor's lazily derived codebook cache
    shared = {id(t): t for module in (models.mimi, models.lm) for t in itertools.chain(module.parameters(), module.buffers())}
    models = copy.deepcopy(models, shared)
    gen = lm_gen(models.lm, sampling=True)
    streaming = ExitStack()
    try:
        streaming.enter_context(models.mimi.streaming(1))
        streaming.enter_context(gen.streaming(1))
        bound, reports = {}, {}
        bound["mimi"], reports["mimi"] = transform(models.mimi, contract, MIMI_BINDING, **options)
        bound["lm"], reports["lm"] = transform(gen, contract, LM_BINDING, **options)
        state = gen._streaming_state
        state.graphed_main = bound["lm"].operators["lm_step"]
        state.graphed_depth = bound["lm"].operators["depformer_step"]
        _prime_mimi(models.mimi, bound["mimi"])
    except BaseException:
        streaming.close()
        raise
    return BoundPersonaPlex(models, gen, bound, reports, streaming)


def used_codebooks(mimi: Any) -> list[torch.nn.Module]:
    """The codebooks Mimi's calls read: the first `n_q` levels of each residual quantizer (Mimi
    ships 32 levels and streams 8). A transform fills their lazily derived caches first, as the
    vendor's first call would; filling the others would hold caches the vendor never makes."""
    ResidualVectorQuantizer = _vendor("quantization.vq").ResidualVectorQuantizer
    return [
        layer._codebook
        for module in mimi.quantizer.modules()
        if isinstance(module, ResidualVectorQuantizer)
        for layer in module.vq.layers[: module.n_q]
    ]


def _prime_mimi(mimi: Any, bound: Any) -> None:
    """One frame of silence through stock Mimi, then one through the bound operators, then the
    vendor's reset. A bound operator takes the counters it finds at its first call as what they are
    then (a tensor: state kept at one address; anything else: a host value), and Mimi's streaming
    convolutions make their tensors (`previous`, `partial`, `previous_x`, `previous_y`) only at
    their first call: so the bound operators' first call comes after a stock one. The caller's
    generators are left as they were (Mimi draws none)."""
    no_compile = _vendor("utils.compile").no_compile
    silence = torch.zeros(1, mimi.channels, FRAME_SIZE, device=next(mimi.parameters()).device)
    with no_compile(), torch.no_grad():
        mimi.decode(mimi.encode(silence))
        bound.operators["mimi_decode"](bound.operators["mimi_encode"](silence))
        mimi.reset_streaming()
