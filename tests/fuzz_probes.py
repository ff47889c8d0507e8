"""The differential fuzzer's subjects from the tests' own bindings: the README's example
(`byom_example.py`), every probe of `test_byom_probe.py` and the in-place padding cache of
`test_binding_in_place.py`, each built by its test module's own builder (a probe's `*_streams`
called with `streams=0` binds the model without streaming it) and streamed call by call.

Four shapes of state, one helper each:

- a cache object passed in and mutated (`transformers`' `DynamicCache`, `EncoderDecoderCache`):
  `_cache_subject`, the positions passed where the probe passes them;
- a state the step returns and the caller threads back in (`Held`): `_held_subject`;
- a state in the model's own modules (a list attribute, a registered buffer): one stream at a
  time, a stock copy made before the first call (`_module_subject`);
- transformers' Mimi, two operators (encode, decode) over three caches: `hf_mimi`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import test_byom_probe as probes
import torch
import transformers
from fuzzkit import Held, Positioned, Subject
from transformers import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput

from cadence_fx import transform

STEP = probes.STEP
LIMIT = 48  # tokens a stream may reach: inside every tiny config's positions (GPT-2's 64 the fewest)


def _tokens(vocab: int = 64, codes: int = 0) -> Callable[[int, torch.Generator], torch.Tensor]:
    """Random input ids of n units: (1, n) tokens, or (1, n, codes) codebook indices."""
    if codes:
        return lambda n, g: torch.randint(0, vocab, (1, n, codes), generator=g)
    return lambda n, g: torch.randint(0, vocab, (1, n), generator=g)


def _cache_subject(
    name: str,
    model,
    bound,
    report,
    *,
    new_cache: Callable[[], Any] | None = None,
    draw=_tokens(),
    positions: str | None = "position_ids",
    inputs: str = "input_ids",
    units: int = STEP,
    odd=(3, 1),
    limit: int = LIMIT,
    extra: dict | None = None,
) -> Subject:
    """A decoder streamed into a cache object it mutates (`cache=`), `units` tokens a call."""
    config = model.config
    new_cache = new_cache or (lambda: DynamicCache(config=config))

    def call(m, state, n, generator):
        at = 0 if state is None else state.seen
        kwargs = {positions: torch.arange(at, at + n)[None]} if positions else {}
        out = m(
            **{inputs: draw(n, generator)},
            cache=None if state is None else state.cache,
            use_cache=True,
            **kwargs,
            **(extra or {}),
        )
        if state is not None:
            state.seen += n
        return out.logits

    return Subject(
        name,
        model,
        bound,
        report,
        lambda m: Positioned(new_cache()),
        call,
        lambda s: s.cache,
        units=units,
        odd=odd,
        takes_none=True,
        limit=limit,
    )


def _bound(model, contract, binding):
    """A stock copy of `model`, and `model` bound."""
    stock = copy.deepcopy(model)
    return (stock, *transform(model, contract, binding))


def _streams_bound(streams) -> tuple[Any, Any, Any]:
    """A probe's `*_streams` result (streamed zero times): a stock copy, the bound model, its report."""
    bound, report = streams
    return copy.deepcopy(bound.model), bound, report


def mistral() -> Subject:
    """The README's example: a `transformers` Mistral decoder with its sliding-window DynamicCache,
    positions left to the cache (as the README streams it)."""
    from byom_example import TOKENS_PER_CALL, binding, build_model, contract

    model, _ = build_model()
    return _cache_subject("mistral", *_bound(model, contract(), binding()), positions=None, units=TOKENS_PER_CALL, limit=500)


def qwen3() -> Subject:
    model, _ = probes.qwen3()
    return _cache_subject("qwen3", *_bound(model, probes.kv_contract("qwen3_full", 2, 2, tokens=12), probes.DYNAMIC_CACHE))


def gpt2() -> Subject:
    model, _ = probes.gpt2()
    return _cache_subject("gpt2", *_bound(model, probes.kv_contract("gpt2", 2, 4, tokens=8), probes.DYNAMIC_CACHE))


def more_decoder(family: str) -> Callable[[], Subject]:
    def build() -> Subject:
        config_class, model_class, kv_heads, kwargs = probes.MORE_DECODERS[family]
        torch.manual_seed(0)
        config = getattr(transformers, config_class)(**kwargs, attn_implementation="eager" if family == "bloom" else "sdpa")
        model = getattr(transformers, model_class)(config).eval()
        return _cache_subject(family, *_bound(model, probes.kv_contract(family, 2, kv_heads, tokens=12), probes.DYNAMIC_CACHE))

    return build


def gemma3() -> Subject:
    return _cache_subject("gemma3", *_streams_bound(probes.gemma3_streams("cpu", streams=0)))


def mamba() -> Subject:
    return _cache_subject("mamba", *_streams_bound(probes.mamba_streams("cpu", streams=0)), positions=None)


def jamba() -> Subject:
    return _cache_subject("jamba", *_streams_bound(probes.jamba_streams(streams=0)), positions=None)


def deepseek_v3() -> Subject:
    model, _, contract, binding = probes.deepseek_v3()
    return _cache_subject("deepseek_v3", *_bound(model, contract, binding))


def moshi_text() -> Subject:
    model, _, contract, binding = probes.moshi_text()
    return _cache_subject("moshi_text", *_bound(model, contract, binding))


def kyutai() -> Subject:
    """One frame a call: a text token and 2 codebooks' codes (codes < 16, tokens < 64)."""
    model, config = probes.kyutai()

    def draw(n, generator):
        return torch.cat(
            [torch.randint(0, 64, (1, n, 1), generator=generator), torch.randint(0, 16, (1, n, 2), generator=generator)], dim=-1
        )

    return _cache_subject(
        "kyutai", *_bound(model, probes.kyutai_contract(config), probes.KYUTAI_BINDING), draw=draw, units=1, odd=(2, 3)
    )


def csm() -> Subject:
    model, _, contract = probes.csm()
    return _cache_subject("csm", *_bound(model, contract, probes.DYNAMIC_CACHE), draw=_tokens(16, codes=2), units=1, odd=(2, 3))


def _encoder_decoder(name: str, model, bound, report, **call) -> Subject:
    """A decoder over a fixed encoding, streamed into an `EncoderDecoderCache`."""
    config = model.config
    encoded = BaseModelOutput(
        last_hidden_state=torch.randn(
            1, probes.ENCODER_FRAMES, 32, generator=torch.Generator(device=torch.get_default_device()).manual_seed(2)
        )
    )
    return _cache_subject(
        name,
        model,
        bound,
        report,
        inputs="decoder_input_ids",
        extra={"encoder_outputs": encoded},
        new_cache=lambda: EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config)),
        **call,
    )


def whisper() -> Subject:
    return _encoder_decoder(
        "whisper", *_streams_bound(probes.whisper_streams("cpu", streams=0)), positions="decoder_position_ids", limit=24
    )  # 32 target positions


def seq2seq(family: str) -> Callable[[], Subject]:
    def build() -> Subject:
        torch.manual_seed(0)
        model = probes.SEQ2SEQ[family]().eval()
        return _encoder_decoder(family, *_bound(model, *probes.encoder_decoder(family)), positions=None)

    return build


def _held_subject(
    name: str, stock, bound, report, step: Callable, first: Callable[[], Any], *, units: int = STEP, odd=(3, 1), takes_none: bool
) -> Subject:
    """A functional step: `step(m, state, x_units, generator) -> (output, new state)`, the new state
    threaded back in; `first()` is a fresh stream's state."""

    def call(m, held, n, generator):
        out, state = step(m, None if held is None else held.value, n, generator)
        if held is not None:
            held.value = state
        return out

    return Subject(
        name,
        stock,
        bound,
        report,
        lambda m: Held(first()),
        call,
        lambda h: h.value,
        units=units,
        odd=odd,
        takes_none=takes_none,
        keep=Held.kept,
    )


def conformer() -> Subject:
    def step(m, state, n, generator):
        conv, kv = state
        y, conv, kv = m(torch.randn(1, n, probes.CONF_DIM, generator=generator), conv, kv)
        return y, (conv, kv)

    return _held_subject(
        "conformer",
        *_streams_bound(probes.conformer_streams("cpu", streams=0)),
        step,
        lambda: (torch.zeros(1, probes.CONF_DIM, probes.CONF_KERNEL - 1), None),
        takes_none=False,
    )


def lstm() -> Subject:
    def step(m, state, n, generator):
        return m(torch.randn(1, n, probes.LSTM_INPUT, generator=generator), state)

    return _held_subject("lstm", *_streams_bound(probes.lstm_streams("cpu", streams=0)), step, lambda: None, takes_none=True)


def legacy() -> Subject:
    def step(m, past, n, generator):
        return m(torch.randint(0, 64, (1, n), generator=generator), past_key_values=past)

    return _held_subject("legacy", *_streams_bound(probes.legacy_streams("cpu", streams=0)), step, lambda: None, takes_none=True)


def rwkv() -> Subject:
    def step(m, state, n, generator):
        out = m(input_ids=torch.randint(0, 64, (1, n), generator=generator), state=state, use_cache=True)
        return out.logits, out.state

    return _held_subject("rwkv", *_streams_bound(probes.rwkv_streams("cpu", streams=0)), step, lambda: None, takes_none=True)


def codec() -> Subject:
    def step(m, context, n, generator):
        out = m.decode_step(frames=torch.randn(1, probes.CODEC_CHANNELS, n, generator=generator), context=context, gain=0.5)
        return out.audio, out.context

    return _held_subject(
        "codec",
        *_streams_bound(probes.codec_streams("cpu", streams=0)),
        step,
        lambda: torch.zeros(1, probes.CODEC_CHANNELS, probes.KERNEL - 1),
        takes_none=False,
    )


def _module_subject(
    name: str,
    stock,
    bound,
    report,
    fresh: Callable[[Any], None],
    state_of: Callable[[Any], Any],
    draw: Callable[[int, torch.Generator], torch.Tensor],
    *,
    units: int,
    odd,
) -> Subject:
    """A model whose state lives in its own modules: one stream at a time, `fresh(m)` starting it."""

    def new_state(m):
        fresh(m)
        return m

    return Subject(
        name, stock, bound, report, new_state, lambda m, state, n, g: m(draw(n, g)), state_of, units=units, odd=odd, streams=1
    )


def conv_stack() -> Subject:
    """The causal conv stack, its left contexts in a list attribute (`start()` a fresh stream)."""
    return _module_subject(
        "conv_stack",
        *_streams_bound(probes.conv_stack_streams("cpu", streams=0)),
        lambda m: m.start(),
        lambda m: m.contexts,
        lambda n, g: torch.randn(1, probes.CHANNELS, n, generator=g),
        units=STEP,
        odd=(3, 1),
    )


def padded_conv() -> Subject:
    """`test_binding_in_place.py`'s padding cache, a registered buffer overwritten with `copy_`
    (an `InPlace` region), zeroed in place for a fresh stream."""
    import test_binding_in_place as in_place

    stock = in_place.PaddedConvStack().eval()
    bound, report = transform(in_place.PaddedConvStack().eval(), in_place.contract(), in_place.BINDING)
    return _module_subject(
        "padded_conv",
        stock,
        bound,
        report,
        lambda m: m.pads.zero_(),
        lambda m: m.pads,
        lambda n, g: torch.randn(1, in_place.CHANNELS, n, generator=g),
        units=in_place.STEP,
        odd=(2, 3),
    )


def hf_mimi() -> Subject:
    """transformers' Mimi: a frame of audio through `encode` (its transformer's cache and its
    convolutions' padding cache) and its codes through `decode` (another cache), positions passed."""
    model, config = probes.mimi()
    stock, bound, report = _bound(model, probes.mimi_contract(config), probes.mimi_binding(verify=1))
    frame = config.frame_size

    class MimiState:
        def __init__(self):
            self.encoder, self.decoder = DynamicCache(config=config), DynamicCache(config=config)
            self.padding, self.seen = probes.mimi_padding_cache(stock), 0

    def call(m, state, n, generator):
        at = dict(position_ids=torch.arange(state.seen, state.seen + n)[None])
        audio = torch.randn(1, 1, frame * n // STEP, generator=generator)
        encoded = m.encode(
            audio, encoder_cache=state.encoder, padding_cache=state.padding, use_streaming=True, return_dict=True, **at
        )
        state.padding = encoded.padding_cache
        decoded = m.decode(encoded.audio_codes, decoder_cache=state.decoder, return_dict=True, **at)
        state.seen += n
        return encoded.audio_codes, decoded.audio_values

    return Subject("hf_mimi", stock, bound, report, lambda m: MimiState(), call, lambda s: s, units=STEP, limit=LIMIT)


PROBES: dict[str, Callable[[], Subject]] = {
    "mistral": mistral,
    "qwen3": qwen3,
    "gpt2": gpt2,
    **{family: more_decoder(family) for family in sorted(probes.MORE_DECODERS)},
    "gemma3": gemma3,
    "mamba": mamba,
    "jamba": jamba,
    "deepseek_v3": deepseek_v3,
    "moshi_text": moshi_text,
    "kyutai": kyutai,
    "csm": csm,
    "whisper": whisper,
    "bart": seq2seq("bart"),
    "t5": seq2seq("t5"),
    "conformer": conformer,
    "lstm": lstm,
    "legacy": legacy,
    "rwkv": rwkv,
    "codec": codec,
    "conv_stack": conv_stack,
    "padded_conv": padded_conv,
    "hf_mimi": hf_mimi,
}
