"""The differential fuzzer's subjects from cadence-fx's own families at their tiny depths, each
built and streamed as its test does (`test_token2wav_carry.py`, `test_binding_moshi.py`,
`test_binding_freeze_omni.py`), call by call beside a stock copy.

A family whose state lives in its modules (Moshi's streaming states, Token2Wav's carries behind
one transformed flow) streams one stream at a time, a reset (`reset_streaming`, a turn reset)
starting the next. A family of several operators is called as its glue calls them: one Moshi
frame is the main step then the depformer's (sampling, the RNG seeded alike for both), one Mimi
frame an encode then a decode of its codes; `model` and `bound` are then namespaces of the stock
and the bound operators.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
from fuzzkit import Held, Subject

from cadence_fx import transform


def _streaming_states(model: torch.nn.Module) -> dict:
    """Every streaming state of a vendor module tree (Moshi's `StreamingModule`s), by module name."""
    return {name: m._streaming_state for name, m in model.named_modules() if getattr(m, "_streaming_state", None) is not None}


def _moshi(name: str, build, bind, call, around) -> Subject:
    with around():
        stock, model = build(), build()
        stock.streaming_forever(1)
        model.streaming_forever(1)
        stock_ops, bound, report = bind(stock, model)
    bound_ops = SimpleNamespace(model=model, **{k: bound.operators[k] for k in vars(stock_ops) if k != "model"})

    def new_state(m):
        m.model.reset_streaming()
        return m.model

    return Subject(name, stock_ops, bound_ops, report, new_state, call, _streaming_states, units=1, streams=1, around=around)


def moshi_lm() -> Subject:
    """Moshi's LM (`MOSHI_LM_BINDING`): per frame, the main step, its greedy text token, the
    depformer's sampled audio tokens."""
    from cadence_fx.models.moshi import MOSHI_LM_BINDING, contract_for
    from cadence_fx.models.moshi_stream import TINY, LMGen, build_models, no_compile

    def bind(stock, model):
        ops = SimpleNamespace(model=stock, lm_step=stock.lm_model.forward_text, depformer_step=stock.depformer_step)
        return (ops, *transform(model, contract_for(TINY), MOSHI_LM_BINDING))

    def call(m, state, n, generator):
        lm = m.model.lm_model
        frame = torch.cat(
            [
                torch.randint(0, lm.text_card, (1, 1, 1), generator=generator),
                torch.randint(0, lm.card, (1, lm.num_codebooks - 1, 1), generator=generator),
            ],
            dim=1,
        )
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))  # the depformer samples
        out, text_logits = m.lm_step(frame)
        return out, text_logits, m.depformer_step(text_logits[:, 0, 0].argmax(dim=-1), out)

    return _moshi("moshi_lm", lambda: LMGen(build_models(TINY).lm, use_sampling=True), bind, call, no_compile)


def moshi_mimi() -> Subject:
    """Moshi's Mimi (`MIMI_BINDING`): per 1,920-sample frame, encode, then decode of its codes."""
    from moshi.utils.compile import no_cuda_graph

    from cadence_fx.models.moshi import MIMI_BINDING, contract_for
    from cadence_fx.models.moshi_stream import FRAME_SIZE, TINY, build_models, no_compile

    def bind(stock, model):
        ops = SimpleNamespace(model=stock, mimi_encode=stock.encode, mimi_decode=stock.decode)
        return (ops, *transform(model, contract_for(TINY), MIMI_BINDING))

    def call(m, state, n, generator):
        codes = m.mimi_encode(0.1 * torch.randn(1, 1, FRAME_SIZE, generator=generator))
        return codes, m.mimi_decode(codes)

    @contextlib.contextmanager
    def around():
        with no_compile(), no_cuda_graph():  # the vendor's own CUDA graphs off: the pipeline's run
            yield

    return _moshi("moshi_mimi", lambda: build_models(TINY).mimi, bind, call, around)


def freeze_omni() -> Subject:
    """The Freeze-Omni encoder's functional `infer(chunk, buffer, pe_index)`: each call a window of
    the last `chunk_overlap` frames and `chunk_frames` new ones, the buffer list and `pe_index`
    threaded back in (`stream_utterance`'s loop, a call at a time)."""
    from test_binding_freeze_omni import BINDING

    from cadence_fx.models.freeze_omni import freeze_omni_contract
    from cadence_fx.models.freeze_omni_encoder import FreezeOmniEncoderConfig, build_encoder

    config = FreezeOmniEncoderConfig.small()
    stock, encoder = build_encoder(config), build_encoder(config)
    contract = freeze_omni_contract(
        blocks=config.num_blocks,
        d_model=config.attention_dim,
        heads=config.attention_heads,
        chunk_frames=config.chunk_size,
        left_chunks=config.left_chunks,
        lorder=config.lorder,
    )
    bound, report = transform(encoder, contract, BINDING)

    def new_state(m):
        return Held((torch.zeros(1, config.chunk_frames + config.chunk_overlap, 80), m.init_buffers(), m.init_pe_index()))

    def call(m, held, n, generator):
        window, buffer, pe_index = held.value
        new = torch.randn(1, config.chunk_frames, 80, generator=generator)
        window = torch.cat([window[:, -config.chunk_overlap :], new], dim=1)
        ys, buffer, pe_index = m.infer(window, buffer, pe_index)
        held.value = (window, buffer, pe_index)
        return ys

    return Subject(
        "freeze_omni", stock, bound, report, new_state, call, lambda h: h.value, units=config.chunk_size, keep=Held.kept
    )


TOKEN2WAV_CHUNK, TOKEN2WAV_FLUSH = 50, 56  # mel frames of a chunk of 28 tokens, and of a last (flushing) one


def token2wav() -> Subject:
    """Token2Wav's flow at its tiny depth (`transform(flow, contract)`: the family's composer, its
    warm-up turns included): a chunk of 28 tokens a call, a flushing last chunk as the odd call
    (inside a turn it meets no class), a turn reset as a fresh stream. The stock stream's
    estimator caches are its envelopes (every solver step and block slot): the live ones compared."""
    from cadence_fx.models.token2wav_carry import CarryStream, reference_flow
    from cadence_fx.models.token2wav_stream import CHUNK_TOKENS, VOCAB_SIZE, StockStream, random_prompt

    stock, contract, prompt_tokens = reference_flow("tiny")
    prompt = random_prompt(0, n_tokens=prompt_tokens)
    transformed, report = transform(stock, contract)  # the composer binds a copy: `stock` is left as it was
    streams = {id(stock): StockStream(stock, None, prompt), id(transformed): CarryStream(transformed, prompt)}
    depth = len(stock.decoder.estimator.blocks)

    def new_state(m):
        stream = streams[id(m)]
        stream.setup() if stream.stream_cache is None else stream.reset_turn()
        return stream

    def call(m, stream, n, generator):
        tokens = torch.randint(0, VOCAB_SIZE, (1, CHUNK_TOKENS), generator=generator, dtype=torch.int32)
        return stream.flow_chunk(tokens, last_chunk=n == TOKEN2WAV_FLUSH)

    def state_of(stream):
        envelopes = type(stream) is StockStream
        return {
            k: v[: stream.n_timesteps, :depth] if envelopes and k.startswith("estimator") else v
            for k, v in stream.stream_cache.items()
        }

    return Subject(
        "token2wav",
        stock,
        transformed,
        report,
        new_state,
        call,
        state_of,
        units=TOKEN2WAV_CHUNK,
        odd=(TOKEN2WAV_FLUSH,),
        streams=1,
    )


FAMILIES = {"token2wav": token2wav, "moshi_lm": moshi_lm, "moshi_mimi": moshi_mimi, "freeze_omni": freeze_omni}
