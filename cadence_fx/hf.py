"""A contract and a binding derived for a `transformers` model from its config and the cache it builds.

Most `transformers` streaming models keep their state in one of a handful of cache layouts, and
every layout says by itself what a careful user would declare: a sliding-window layer keeps its
last `sliding_window - 1` tokens (the bound is a field of the released config), a full-attention
layer grows with the stream (only the user knows the longest stream: `max_tokens`), a static layer
is a ring of `max_cache_len` tokens, a Mamba layer keeps a convolution window of `conv_kernel`
tokens and a scan state of one fixed shape, and an encoder-decoder cache keeps the encoder's keys
and values beside the decoder's. `derive_transformers(model, ...)` builds that cache the stock way,
runs one call of a twin of the model on the meta device (no weights, no compute, the model itself
untouched) to learn each layer's shapes, and returns the `(Contract, Binding)` pair: the regions
(layers of one kind and shape, reached by a slice of `cache.layers`), the operator (`forward`,
its units the token axis of `input_ids`) and every host value the layers move (their first-call
flags and lengths) as counters. What it cannot derive it refuses by name (`DeriveError`): a cache
class or layer class it does not know, a full-attention layer without `max_tokens`, a model whose
`forward` takes no cache. Mimi, whose streaming step is two methods, is derived apart
(`cadence_fx/hf_mimi.py`).

`transformers` is imported here only, and only when a model is derived: the core does not need it.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .binding import Binding, OperatorBinding, RegionBinding
from .contract import Admission, Clock, ClockKind, Contract, Interactivity, Lifetime, Operator, Rate, Region
from .passes.retention import InPlace, RingCache, SlidingWindow

__all__ = ["DeriveError", "derive_transformers", "derived_caches", "is_transformers_model"]

#: Models whose `input_ids` carry a codebook axis after the time axis (a frame of codes a step):
#: how wide it is, from the config. Their clock is a frame clock, not a token clock.
CODEBOOK_INPUTS = {
    "kyutai_speech_to_text": lambda config: 1 + config.num_codebooks,  # the text token and the audio codebooks
    "csm": lambda config: config.num_codebooks,
}
#: The cache layer classes a layout is derived for (`transformers.cache_utils`), by kind.
LAYER_KINDS = {
    "DynamicLayer": "full",
    "DynamicSlidingWindowLayer": "sliding",
    "StaticLayer": "static",
    "LinearAttentionLayer": "linear",
}
#: The host values each kind of layer moves, bound as the operator's counters.
LAYER_COUNTERS = {
    "full": ("is_initialized",),
    "sliding": ("is_initialized", "cumulative_length"),
    "static": ("is_initialized", "cumulative_length"),
    "linear": ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state", "conv_kernel_size"),
}
OPERATOR = "decoder_step"


class DeriveError(ValueError):
    """A model, cache or layer `derive_transformers` cannot derive a contract for, named with what it expected."""


def is_transformers_model(model: Any) -> bool:
    """Whether `model` is a `transformers.PreTrainedModel`, without importing `transformers`."""
    return any(cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.") for cls in type(model).__mro__)


def derive_transformers(
    model: Any,
    *,
    tokens_per_call: int = 1,
    max_tokens: int | None = None,
    cache: str = "dynamic",
    encoder_frames: int | None = None,
    verify: int = 2,
) -> tuple[Contract, Binding]:
    """The contract and binding of `model`'s decoding step, `tokens_per_call` tokens (or frames of
    codes) a call into the cache `transformers` builds for it: ``DynamicCache(config=model.config)``
    (`cache="dynamic"`), ``StaticCache(config=model.config, max_cache_len=max_tokens)``
    (`cache="static"`), or for an encoder-decoder model ``EncoderDecoderCache`` of two dynamic
    caches, its encoder output `encoder_frames` long (default: the config's `max_source_positions`).

    `max_tokens`: the longest stream, required where a layer has no bound of its own (full
    attention: a call past it is outside the catalog and runs the stock code) and for a static
    cache (its capacity)."""
    if not is_transformers_model(model):
        raise DeriveError(f"derive_transformers needs a transformers.PreTrainedModel, got {type(model).__name__}")
    if not isinstance(tokens_per_call, int) or isinstance(tokens_per_call, bool) or tokens_per_call < 1:
        raise DeriveError(f"tokens_per_call must be an int >= 1, got {tokens_per_call!r}")
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < tokens_per_call
    ):
        raise DeriveError(f"max_tokens must be an int >= tokens_per_call ({tokens_per_call}), got {max_tokens!r}")
    if cache not in ("dynamic", "static"):
        raise DeriveError(f"cache must be 'dynamic' or 'static', got {cache!r}")
    name = type(model).__name__
    if model.config.model_type == "mimi":  # two operators, encode and decode (cadence_fx/hf_mimi.py)
        if (max_tokens, cache, encoder_frames) != (None, "dynamic", None):
            raise DeriveError(f"{name}: Mimi's bounds are its config's; pass tokens_per_call (and verify) only")
        from .hf_mimi import derive_mimi

        return derive_mimi(model, tokens_per_call=tokens_per_call, verify=verify)
    parameters = inspect.signature(model.forward).parameters
    argument = next((a for a in ("cache", "past_key_values") if a in parameters), None)
    if argument is None:
        raise DeriveError(
            f"{name}.forward takes no cache argument (cache or past_key_values): its state is no cache "
            "transformers builds; bind it by hand (README: Bring your own model)"
        )
    config = model.config
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    if encoder_decoder and cache == "static":
        raise DeriveError(
            f"{name}: a static cache is derived for decoder-only models; an encoder-decoder model streams with cache='dynamic'"
        )
    if cache == "static" and max_tokens is None:
        raise DeriveError(f"{name}: a static cache holds max_cache_len tokens; pass max_tokens, its capacity")
    codebooks = CODEBOOK_INPUTS.get(config.model_type)
    clock = "frame" if codebooks else "token"
    kind = ClockKind.FRAMES if codebooks else ClockKind.TOKENS
    units = "decoder_input_ids" if encoder_decoder else "input_ids"
    frames = None  # an encoder-decoder model's encoder output length
    if encoder_decoder:
        frames = encoder_frames if encoder_frames is not None else getattr(config, "max_source_positions", None)
        if not isinstance(frames, int) or frames < 1:
            raise DeriveError(
                f"{name} is an encoder-decoder model whose config gives no encoder length "
                "(max_source_positions): pass encoder_frames, the frames of the encoder output it decodes against"
            )
    probed = _probe(model, argument, units, tokens_per_call, codebooks(config) if codebooks else None, frames)

    layout = _Layout(clock, tokens_per_call, max_tokens, name)
    if frames is not None:
        layout.add_cache(probed.self_attention_cache, f"{argument}.self_attention_cache.layers", "self_kv")
        layout.add_cross(probed.cross_attention_cache, f"{argument}.cross_attention_cache.layers", frames)
        layout.counters += tuple(f"{argument}.is_updated.{i}" for i in probed.is_updated)
    elif cache == "static" and max_tokens is not None:  # (a static cache without max_tokens is refused above)
        # The static layers' shapes are the dynamic ones' with max_cache_len tokens: the probe runs
        # a dynamic cache (a static one reads its length back on the host, which no meta tensor has).
        from transformers import StaticCache

        static = StaticCache(config=config, max_cache_len=max_tokens).layers  # allocated lazily: nothing runs
        layout.add_cache(probed, f"{argument}.layers", "kv", classes=[type(layer) for layer in static])
    else:
        layout.add_cache(probed, f"{argument}.layers", "kv")
    contract = Contract(
        family=config.model_type,
        clocks=(
            Clock(clock, kind),
            *((Clock("frame", ClockKind.FRAMES),) if encoder_decoder else ()),
            Clock("call", ClockKind.CALLS),
        ),
        rates=(Rate(clock, "call", tokens_per_call, name=f"{clock}s_per_call"),),
        regions=tuple(layout.regions),
        operators=(Operator(OPERATOR, layout.operator_region(), steady=tokens_per_call),),
        admission=Admission(clock, max_per_call=tokens_per_call),
        interactivity=Interactivity(stages=("decoder",)),
    )
    binding = Binding(
        regions=tuple(layout.bindings),
        operators=(OperatorBinding(OPERATOR, method="forward", units=(units, 1), counters=layout.counters),),
        verify=verify,
    )
    return contract, binding


def derived_caches(model: Any, binding: Binding, cache: str = "dynamic") -> dict[str, tuple[str, type]]:
    """By operator of `derive_transformers(model, cache=cache)`'s `binding`: the argument its cache
    is passed by (the root of its regions' paths) and the cache class its contract was derived for."""
    from transformers import DynamicCache, EncoderDecoderCache, StaticCache

    if model.config.model_type == "mimi":
        from .hf_mimi import mimi_caches

        return mimi_caches()
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    cls = EncoderDecoderCache if encoder_decoder else StaticCache if cache == "static" else DynamicCache
    return {ob.operator: (binding.regions[0].at[0].split(".")[0], cls) for ob in binding.operators}


def _probe(model: Any, argument: str, units: str, step: int, codebooks: int | None, encoder_frames: int | None) -> Any:
    """One call of `step` tokens of a twin of `model` on the meta device, into a fresh dynamic cache
    (an `EncoderDecoderCache` of two for an encoder-decoder model): the cache, its layers
    allocated at their shapes. The twin is built from a copy of the config, so the model, its
    config and its modules' settings stay as they were."""
    from transformers import DynamicCache, EncoderDecoderCache
    from transformers.modeling_outputs import BaseModelOutput

    config = copy.deepcopy(model.config)
    if getattr(config, "_experts_implementation", None) is not None:
        config._experts_implementation = "eager"  # the shapes are the same; the fused kernels want real dtypes on meta
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    try:
        with torch.device("meta"):
            twin = type(model)(config).to(dtype).eval()
    except Exception as error:  # noqa: BLE001 - any failure to build the twin is reported with its cause
        raise DeriveError(
            f"{type(model).__name__}: its twin on the meta device could not be built from its config "
            f"({type(error).__name__}: {error}); bind it by hand"
        ) from error
    ids = torch.zeros(1, step, *((codebooks,) if codebooks else ()), dtype=torch.long, device="meta")
    kwargs: dict[str, Any] = {units: ids, "use_cache": True}
    cache: DynamicCache | EncoderDecoderCache
    if encoder_frames is not None:
        cache = EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))
        hidden = torch.zeros(1, encoder_frames, config.d_model, dtype=dtype, device="meta")
        kwargs["encoder_outputs"] = BaseModelOutput(last_hidden_state=hidden)
    else:
        cache = DynamicCache(config=config)
    from torch.fx.experimental import _config as fx_config

    try:  # a mixture of experts routes with nonzero: on meta, every expert is taken (the shapes are what counts)
        # `patch` is set on torch's config modules when they are installed: no stub declares it
        patch = fx_config.patch(meta_nonzero_assume_all_nonzero=True)  # type: ignore[attr-defined]
        with torch.no_grad(), patch, _MetaScalars():
            twin(**{argument: cache}, **kwargs)
    except Exception as error:  # noqa: BLE001 - reported with its cause
        # What the call computes after its last cache write (a router reading a value on the host,
        # which no meta tensor has) does not matter here: every layer's state is allocated by then.
        caches = (cache.self_attention_cache, cache.cross_attention_cache) if isinstance(cache, EncoderDecoderCache) else (cache,)
        if not all(_allocated(layer) for c in caches for layer in c.layers):
            raise DeriveError(
                f"{type(model).__name__}: one call of {step} tokens on the meta device failed before every "
                f"cache layer was written ({type(error).__name__}: {error}); bind it by hand"
            ) from error
    return cache


class _MetaScalars(TorchDispatchMode):
    """A meta tensor read on the host (`item()`, `bool()`) reads as 0 (False, 0.0) for the probe's
    one call: such a read (a router's expert index, a mask's all-ones check) chooses a path, not a
    cache's shape. Should a shape depend on one, the pipeline meets the real shape at the first
    call and names the site whose shape differs from the contract's; no output is wrong for it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            tensor = args[0]
            return False if tensor.dtype == torch.bool else 0.0 if tensor.is_floating_point() else 0
        return func(*args, **(kwargs or {}))


def _allocated(layer: Any) -> bool:
    """Whether a cache layer holds its tensors (a layer kind not derived counts as allocated: it is refused later)."""
    if hasattr(layer, "conv_states"):
        return layer.conv_states.get(0) is not None or layer.recurrent_states.get(0) is not None
    return getattr(layer, "keys", True) is not None


def _selection(indices: list[int], count: int, where: str) -> str:
    """The path segment selecting `indices` of a list of `count` layers: `*`, or a slice."""
    if indices == list(range(count)):
        return "*"
    step = indices[1] - indices[0] if len(indices) > 1 else 1
    if indices != list(range(indices[0], indices[-1] + 1, step)):
        raise DeriveError(f"{where}: layers {indices} are of one kind but no slice selects them; bind them by hand")
    stop = "" if indices[-1] + step >= count else str(indices[-1] + 1)
    return f"[{indices[0]}:{stop}]" if step == 1 else f"[{indices[0]}:{stop}:{step}]"


class _Layout:
    """The regions, region bindings and counters derived from the layers of one or more caches."""

    def __init__(self, clock: str, step: int, max_tokens: int | None, model: str):
        self.clock, self.step, self.max_tokens, self.model = clock, step, max_tokens, model
        self.regions: list[Region] = []
        self.bindings: list[RegionBinding] = []
        self.counters: tuple[str, ...] = ()
        self._bounds: dict[str, int] = {}  # region -> the extent it reaches: the operator's is the largest

    def operator_region(self) -> str:
        return max(self._bounds, key=lambda region: self._bounds[region])

    def _region(
        self,
        name: str,
        dims: tuple,
        axis: int | None,
        retention: Any,
        dtype: torch.dtype,
        paths: tuple[str, ...],
        bound: int | None,
    ) -> None:
        names = {r.name for r in self.regions}
        base, n = name, 2
        while name in names:
            name, n = f"{base}_{n}", n + 1
        dtype_name = str(dtype).removeprefix("torch.")
        if isinstance(retention, InPlace):
            region = Region(name, dims=dims, dtype=dtype_name, lifetime=Lifetime.PER_STREAM, retention=retention)
        else:
            region = Region(
                name,
                dims=dims,
                axis=axis,
                clock=self.clock,
                stride=self.step,
                dtype=dtype_name,
                lifetime=Lifetime.PER_STREAM,
                retention=retention,
            )
        self.regions.append(region)
        self.bindings.append(RegionBinding(name, at=paths))
        if bound is not None:
            self._bounds[name] = bound

    def add_cache(self, cache: Any, prefix: str, name: str, classes: list | None = None) -> None:
        """The regions of one cache's layers: layers of one kind and one shape make one region.
        `classes`: the layers' classes where they are not the probed cache's (a static cache's)."""
        layers = cache.layers
        classes = classes or [type(layer) for layer in layers]
        kinds = [LAYER_KINDS.get(cls.__name__) for cls in classes]
        for i, (cls, kind) in enumerate(zip(classes, kinds)):
            if kind is None or not cls.__module__.startswith("transformers."):
                raise DeriveError(
                    f"{self.model}: {prefix}.{i} is a {cls.__module__}.{cls.__name__}; derived are "
                    f"{', '.join(LAYER_KINDS)} from transformers.cache_utils; bind it by hand"
                )
            if kind == "full" and self.max_tokens is None:
                raise DeriveError(
                    f"{self.model}: {prefix}.{i} is a full-attention layer ({cls.__name__}): its cache grows "
                    "with the stream and no config field bounds it; pass max_tokens, the longest stream"
                )
        groups: dict[tuple, list[int]] = {}
        for i, (layer, kind) in enumerate(zip(layers, kinds)):
            if kind == "linear":
                if layer.number_of_states != 1:
                    raise DeriveError(
                        f"{self.model}: {prefix}.{i} keeps {layer.number_of_states} convolution states; "
                        "derived is one; bind it by hand"
                    )
                shapes = tuple(None if s[0] is None else tuple(s[0].shape) for s in (layer.conv_states, layer.recurrent_states))
                key: tuple = (kind, shapes, layer.dtype)
            else:
                window = getattr(layer, "sliding_window", None) if kind == "sliding" else None
                key = (kind, window, tuple(layer.keys.shape), tuple(layer.values.shape), layer.keys.dtype)
            groups.setdefault(key, []).append(i)
        named = len([k for k in groups if k[0] != "linear"]) > 1
        counted: dict[str, list[int]] = {}
        where = f"{self.model}: {prefix}"
        rank = {"full": 0, "static": 1, "sliding": 2, "linear": 3}  # the longest context first: the operator's region
        for key, indices in sorted(groups.items(), key=lambda item: rank[item[0][0]]):
            at = f"{prefix}.{_selection(indices, len(layers), where)}"
            kind = key[0]
            for counter in LAYER_COUNTERS[kind]:
                counted.setdefault(counter, []).extend(indices)
            if kind == "linear":
                self._linear(at, len(indices), *key[1:])
            else:
                self._kv(f"{name}_{kind}" if named else name, at, len(indices), kind, *key[1:])
        for counter, indices in counted.items():
            self.counters += (f"{prefix}.{_selection(sorted(indices), len(layers), where)}.{counter}",)

    def _kv(
        self, name: str, at: str, count: int, kind: str, window: int | None, keys: tuple, values: tuple, dtype: torch.dtype
    ) -> None:
        # a sliding layer keeps its window's last tokens, a full one the longest stream, a static
        # one its capacity (`add_cache` refused a layer that needs max_tokens without it)
        bound = window - 1 if kind == "sliding" and window is not None else self.max_tokens
        if bound is None:
            raise DeriveError(f"{self.model}: {at} is a {kind} layer with no window and no max_tokens; pass max_tokens")
        retention: SlidingWindow | RingCache = SlidingWindow(window=bound)
        if kind == "static":  # written in place at its positions, its extent always the capacity
            retention = RingCache(bound)
            keys, values = (*keys[:-2], 0, keys[-1]), (*values[:-2], 0, values[-1])
        axis = len(keys) - 2  # (batch, heads, tokens, head_dim): the token axis

        def dims(shape: tuple, lead: tuple) -> tuple:
            return (*lead, *shape[:axis], self.clock, *shape[axis + 1 :])

        if keys[:axis] + keys[axis + 1 :] == values[:axis] + values[axis + 1 :]:
            self._region(name, dims(keys, (count, 2)), axis + 2, retention, dtype, (f"{at}.keys", f"{at}.values"), bound)
        else:  # keys and values of different widths (a compressed latent and a rotary key): a region each
            self._region(f"{name}_keys", dims(keys, (count,)), axis + 1, retention, dtype, (f"{at}.keys",), bound)
            self._region(f"{name}_values", dims(values, (count,)), axis + 1, retention, dtype, (f"{at}.values",), bound)

    def _linear(self, at: str, count: int, shapes: tuple, dtype: torch.dtype) -> None:
        conv, scan = shapes
        if conv is not None:
            kernel = conv[-1]
            if kernel >= self.step:  # the last `kernel` tokens, along the token axis: a ring of them
                self._region(
                    "conv", (count, *conv[:-1], self.clock), len(conv), RingCache(kernel), dtype, (f"{at}.conv_states.0",), kernel
                )
            else:
                self._region("conv", (count, *conv), None, InPlace(), dtype, (f"{at}.conv_states.0",), kernel)
        if scan is not None:  # one fixed shape, no time axis
            self._region("scan", (count, *scan), None, InPlace(), dtype, (f"{at}.recurrent_states.0",), None)

    def add_cross(self, cache: Any, prefix: str, frames: int) -> None:
        """The encoder's keys and values an encoder-decoder cache keeps: computed at the first call,
        read by every later one, `frames` long: a ring of the encoder's frames."""
        layers = cache.layers
        for i, layer in enumerate(layers):
            if type(layer).__name__ != "DynamicLayer":
                raise DeriveError(f"{self.model}: {prefix}.{i} is a {type(layer).__name__}; derived is DynamicLayer")
        keys = tuple(layers[0].keys.shape)
        if any(tuple(layer.keys.shape) != keys or tuple(layer.values.shape) != keys for layer in layers):
            raise DeriveError(f"{self.model}: the cross-attention layers of {prefix} differ in shape; bind them by hand")
        region = Region(
            "cross_kv",
            dims=(len(layers), 2, *keys[:2], "frame", keys[3]),
            axis=4,
            clock="frame",
            stride=1,
            dtype=str(layers[0].keys.dtype).removeprefix("torch."),
            lifetime=Lifetime.PER_STREAM,
            retention=RingCache(frames),
        )
        self.regions.append(region)
        self.bindings.append(RegionBinding("cross_kv", at=(f"{prefix}.*.keys", f"{prefix}.*.values")))
        self.counters += (f"{prefix}.*.is_initialized",)
