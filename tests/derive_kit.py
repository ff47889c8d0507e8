"""Helpers of the derived-contract tests (`test_derive_transformers*.py`): the hand-written contract
and binding of each `transformers` model in `tests/test_byom_probe.py` (and the static cache and
README examples), taken with the very model they were written for, and what differs between two
contract-and-binding pairs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import test_binding_static_cache as static_cache
import test_byom_probe as probe
import torch
from transformers import DynamicCache

from cadence_fx import Binding, Contract, derive
from cadence_fx.hf_mimi import PADDINGS


class _Captured(Exception):
    pass


def hand_written(build: Callable, *args) -> tuple[Any, Contract, Binding]:
    """(model, contract, binding) as a probe of test_byom_probe.py passes them to `transform`: the
    probe's builder runs until it transforms, and stops there (nothing is streamed)."""
    saved = probe.streamed, probe.streamed_returning, probe.transform

    def captured(model, contract, binding, *rest, **keywords):
        raise _Captured(model, contract, binding)

    probe.streamed = probe.streamed_returning = probe.transform = captured
    try:
        build(*args)
    except _Captured as got:
        return got.args
    finally:
        probe.streamed, probe.streamed_returning, probe.transform = saved
    raise AssertionError(f"{build.__name__} never called transform")


def _decoder(family: str) -> tuple[Any, Contract, Binding]:
    config_class, model_class, kv_heads, kwargs = probe.MORE_DECODERS[family]
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**kwargs, attn_implementation="eager" if family == "bloom" else "sdpa")
    model = getattr(transformers, model_class)(config).eval()
    return model, probe.kv_contract(family, 2, kv_heads, tokens=12), probe.DYNAMIC_CACHE


def _seq2seq(family: str) -> tuple[Any, Contract, Binding]:
    torch.manual_seed(0)
    return (probe.SEQ2SEQ[family]().eval(), *probe.encoder_decoder(family))


def _kyutai() -> tuple[Any, Contract, Binding]:
    model, config = probe.kyutai()
    return model, probe.kyutai_contract(config), probe.KYUTAI_BINDING


def _static() -> tuple[Any, Contract, Binding]:
    model, _ = static_cache.build_model("cpu")
    return model, static_cache.CONTRACT, static_cache.BINDING


def _mimi() -> tuple[Any, Contract, Binding]:
    model, config = probe.mimi()
    return model, probe.mimi_contract(config), probe.mimi_binding(verify=1)


def _mistral() -> tuple[Any, Contract, Binding]:
    import byom_example

    model, _ = byom_example.build_model()
    return model, byom_example.contract(), byom_example.binding()


@dataclass(frozen=True)
class Case:
    """A hand-written pair and what derives the same: `derive` the keywords of `derive_transformers`,
    `stream` how the fuzzer streams it (`decoder`, `encoder_decoder`, `static`; `mimi`: a frame of
    audio through `encode`, its codes through `decode`), `ids` the width of a frame of codes (None:
    one token a position) and the id range."""

    build: Callable[[], tuple[Any, Contract, Binding]]
    derive: dict
    stream: str = "decoder"
    codebooks: tuple[int, ...] = ()
    vocab: int = 64
    positions: str | None = "position_ids"  # the keyword the probe passes positions by (None: left to the cache)


STEP = probe.STEP
CASES: dict[str, Case] = {
    "mistral": Case(_mistral, dict(tokens_per_call=2), positions=None),
    "qwen3": Case(lambda: hand_written(probe.qwen3_streams, "cpu", 2), dict(tokens_per_call=STEP, max_tokens=12)),
    "gpt2": Case(lambda: hand_written(probe.gpt2_streams, "cpu", 2), dict(tokens_per_call=STEP, max_tokens=8)),
    **{
        family: Case(lambda family=family: _decoder(family), dict(tokens_per_call=STEP, max_tokens=12))
        for family in sorted(probe.MORE_DECODERS)
    },
    "gemma3": Case(lambda: hand_written(probe.gemma3_streams, "cpu", 2), dict(tokens_per_call=STEP, max_tokens=12)),
    "whisper": Case(
        lambda: hand_written(probe.whisper_streams, "cpu", 2),
        dict(tokens_per_call=STEP, max_tokens=8),
        stream="encoder_decoder",
        positions="decoder_position_ids",
    ),
    "bart": Case(
        lambda: _seq2seq("bart"),
        dict(tokens_per_call=STEP, max_tokens=8, encoder_frames=probe.ENCODER_FRAMES),
        stream="encoder_decoder",
        positions=None,
    ),
    "t5": Case(
        lambda: _seq2seq("t5"),
        dict(tokens_per_call=STEP, max_tokens=8, encoder_frames=probe.ENCODER_FRAMES),
        stream="encoder_decoder",
        positions=None,
    ),
    "mamba": Case(lambda: hand_written(probe.mamba_streams, "cpu", 2), dict(tokens_per_call=STEP), positions=None),
    "jamba": Case(lambda: hand_written(probe.jamba_streams), dict(tokens_per_call=STEP, max_tokens=12), positions=None),
    "deepseek_v3": Case(
        lambda: hand_written(probe.test_deepseek_v3_latent_attention_binds_its_two_cache_widths_as_two_regions),
        dict(tokens_per_call=STEP, max_tokens=12),
    ),
    "kyutai_stt": Case(lambda: _kyutai(), dict(tokens_per_call=1), codebooks=(3,), vocab=16),
    "moshi": Case(
        lambda: hand_written(
            probe.test_moshi_text_transformer_refuses_its_first_call_and_streams_its_sliding_cache_on_the_exported_steps
        ),
        dict(tokens_per_call=STEP),
    ),
    "csm": Case(
        lambda: hand_written(
            probe.test_csm_backbone_refuses_every_class_and_streams_one_frame_of_codes_a_call_exact_on_the_stock_code
        ),
        dict(tokens_per_call=1, max_tokens=probe.CSM_CALLS),
        codebooks=(2,),
        vocab=16,
    ),
    "mimi": Case(_mimi, dict(tokens_per_call=STEP), stream="mimi"),
    "llama_static": Case(
        _static, dict(tokens_per_call=static_cache.STEP, max_tokens=static_cache.CAPACITY, cache="static"), stream="static"
    ),
}


def _expand(path: str, counts: dict[str, int]) -> set[str]:
    """A binding path's concrete paths, `*` and slices expanded over the list lengths `counts` gives
    (by the path up to the pattern)."""
    segments = path.split(".")
    for i, segment in enumerate(segments):
        if segment == "*" or segment.startswith("["):
            prefix = ".".join(segments[:i])
            count = counts[prefix]
            if segment == "*":
                chosen = range(count)
            else:
                start, stop, *step = (int(x) if x else None for x in segment[1:-1].split(":"))
                chosen = range(count)[slice(start, stop, step[0] if step else None)]
            rest = ".".join(segments[i + 1 :])
            return set().union(*(_expand(f"{prefix}.{j}" + (f".{rest}" if rest else ""), counts) for j in chosen))
    return {path}


def _layer_counts(model: Any, binding: Binding) -> dict[str, int]:
    config = model.config
    layers = len(DynamicCache(config=config).layers)
    counts = {}
    for path in [p for b in binding.regions for p in b.at] + [p for ob in binding.operators for p in ob.counters]:
        head = path.split(".layers.")[0] + ".layers" if ".layers." in path else None
        if head is not None:
            counts[head] = layers
    if hasattr(model, "encoder") and hasattr(model.encoder, "encoder_seanet"):
        # Mimi's padding cache: an entry for each convolution of its encoder, and one for its downsampling
        counts[PADDINGS] = len(model.encoder.encoder_seanet._conv1d_layer_names) + 1
    return counts


def comparable(model: Any, contract: Contract, binding: Binding) -> dict[str, Any]:
    """What a contract and binding declare, names left out (the family, the regions', clocks' and
    quantities' names, the stages: labels a person picks): each region by the concrete paths that
    hold it, with its derived shape, bound, retention, stride and dtype; each operator, by the method
    it is bound on, with its units, catalog classes, regimes and modes; the concrete counters of them
    all; the verification depth."""
    catalog = derive(contract)
    counts = _layer_counts(model, binding)
    regions = {}
    for rb in binding.regions:
        region, derived = contract.region(rb.region), catalog.region(rb.region)
        paths = frozenset().union(*(_expand(p, counts) for p in rb.at))
        regions[paths] = dict(
            shape=derived.shape,
            lower=derived.lower,
            bound=derived.bound,
            retention=region.retention,
            stride=region.stride,
            dtype=region.dtype,
            axis=region.axis,
            holds_call=region.holds_call,
            clock_kind=None if region.clock is None else next(c.kind for c in contract.clocks if c.name == region.clock),
        )
    operators, counters = {}, frozenset()
    for ob in binding.operators:
        op = next(o for o in contract.operators if o.name == ob.operator)
        operators[ob.method] = dict(
            units=ob.units,
            steady=op.steady,
            flush=op.flush,
            admission=contract.admission.max_per_call,
            classes=tuple((c.call, c.extent, c.flush) for c in catalog.operator(op.name).classes),
            region=frozenset().union(*(_expand(p, counts) for p in binding.region(op.region).at)),
            regimes=ob.regimes,
            modes=ob.modes,
        )
        counters |= frozenset().union(*(_expand(p, counts) for p in ob.counters)) if ob.counters else frozenset()
    return dict(regions=regions, operators=operators, counters=counters, verify=binding.verify)


def differences(hand: dict[str, Any], derived: dict[str, Any]) -> list[str]:
    """Where the derived pair differs from the hand-written one, each as one line."""
    lines = []
    for paths in sorted(set(hand["regions"]) | set(derived["regions"]), key=sorted):
        h, d = hand["regions"].get(paths), derived["regions"].get(paths)
        name = min(paths)
        if h is None or d is None:
            lines.append(f"{name}: {'only derived' if h is None else 'only hand-written'}")
            continue
        lines += [f"{name}.{key}: {h[key]!r} -> {d[key]!r}" for key in h if h[key] != d[key]]
    for method in sorted(hand["operators"].keys() | derived["operators"].keys()):
        h, d = hand["operators"].get(method), derived["operators"].get(method)
        if h is None or d is None:
            lines.append(f"operator {method}: {'only derived' if h is None else 'only hand-written'}")
            continue
        lines += [f"operator {method}.{key}: {h[key]!r} -> {d[key]!r}" for key in h if h[key] != d[key]]
    lines += [f"counter only hand-written: {p}" for p in sorted(hand["counters"] - derived["counters"])]
    lines += [f"counter only derived: {p}" for p in sorted(derived["counters"] - hand["counters"])]
    if hand["verify"] != derived["verify"]:
        lines.append(f"verify: {hand['verify']!r} -> {derived['verify']!r}")
    return lines
