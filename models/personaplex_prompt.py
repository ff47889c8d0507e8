"""PersonaPlex's prompt phase as a snapshot: the state the vendor's own priming leaves, taken once
per (voice, role) and copied into a session instead of stepping the prompt again.

The vendor primes every session by stepping the LM over its prompts (`LMGen.step_system_prompts`,
`models/personaplex_stream.py`'s `vendor_loop`): the voice prompt's frames (Mimi-encoded from a WAV, or
replayed from saved embeddings), half a second of silence, the role prompt token by token, half a
second of silence. Every token of those steps is provided (the text, the agent's 8 codebooks and
the user's 8): what the LM samples at each step is replaced by the provided token before it is
kept, so the state priming leaves depends on the prompts alone, not on the session's generator
(`tests/test_personaplex_prompt.py` checks it with two seeds). Mimi is reset after priming, so the
LM's streaming state is all of it:

- `LMGen`'s delayed-token cache and its `provided` flags, its host-int `offset`;
- each layer's KV ring and end offset, the attention's and the transformer's device-side offsets,
  and their host-side call counts (`offset_cpu`, read by nothing here: see `_CALL_COUNT`).

`capture(gen)` takes that state from an `LMGen` the vendor has just primed: every tensor cloned,
every ring only up to its end offset (the positions it has written: an `RingKVCache` reads a
position at or past its end offset as empty, and writes it before it reads it), every host value
as it is. The result, a `PromptState`, is never written after: `restore(gen, state)` copies it
into a streaming `LMGen` of the same sizes at batch 1, in place (every tensor stays where the
vendor allocated it, so graphs captured on them keep replaying). After `restore`, the `LMGen`'s
state is the primed vendor's on every position the vendor's code can read, and bit-for-bit
everywhere when both started fresh (`tests/test_personaplex_prompt.py`); every later output is
the primed vendor stream's (with the generator where the vendor's was after priming: a session's
draws are the session's, not the prompt's).

Cost: one copy of the written positions per session, instead of re-running the transformer and
the depformer over every prompt step (a voice prompt of n seconds is 12.5 n steps, a role prompt
one step per token, plus 12 steps of silence).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PromptState", "capture", "prime", "restore", "state_of"]

#: The fields of the vendor's streaming states that are state. Everything else they hold is glue:
#: `_LMGenState`'s CUDA-graph wrappers (`graphed_main`, `graphed_embeddings`, `graphed_depth`),
#: which hold no stream's values.
_GLUE = frozenset({"graphed_main", "graphed_embeddings", "graphed_depth"})

#: The main transformer's host-side call counts (each layer's and attention's `offset_cpu`), read
#: only by weights per step, which its layers have none of (`check_models` refuses them): the bound
#: main step never moves them (`LM_BINDING` declares them Unread), so a prompt state does not take
#: them from the `LMGen` it captures. `restore` writes the one value the vendor's priming leaves:
#: one transformer call per step but the first (at offset 0 the vendor only fills its cache).
_CALL_COUNT = "offset_cpu"


def _fields(state: Any) -> Iterator[tuple[str, Any]]:
    """`(path, value)` of one module's streaming state: its dataclass fields, an `RingKVCache`'s
    `asdict()` (its ring and end offset) walked into, the glue left out."""
    for item in dataclasses.fields(state):
        if item.name in _GLUE:
            continue
        value = getattr(state, item.name)
        if hasattr(value, "asdict"):
            for name, inner in value.asdict().items():
                yield f"{item.name}.{name}", inner
        else:
            yield item.name, value


def state_of(gen: Any) -> dict[str, Any]:
    """Every value of a streaming `LMGen`'s state, by `module:field` path (the module's name as
    `get_streaming_state` gives it, `""` for the `LMGen`): the live tensors themselves (not
    copies) and host values. A module that is not streaming is refused by name."""
    found: dict[str, Any] = {}
    for module, state in gen.get_streaming_state().items():
        if state is None:
            raise ValueError(f"LMGen module {module!r} is not streaming: a prompt state is taken and restored while streaming")
        for name, value in _fields(state):
            found[f"{module}:{name}"] = value
    return found


def _ring_end(values: dict[str, Any], path: str) -> int | None:
    """A ring's written extent: its end offset (one element at batch 1), capped at its capacity."""
    if not path.endswith("kv_cache.cache"):
        return None
    end = values[path.removesuffix("cache") + "end_offset"]
    return min(int(end.item()), values[path].shape[-2])


@dataclass(frozen=True)
class PromptState:
    """What the vendor's priming left in an `LMGen`, for one (voice, role): see the module
    docstring. `tensors` holds private copies (each ring cut at its end offset), `host` the host
    values; `key` names what primed it (the caller's voice key and the role's tokens), `digest`
    the bytes (SHA-256 over every tensor and host value, in path order), so a test can tell that
    nothing wrote into it."""

    key: tuple[str, tuple[int, ...]]
    tensors: dict[str, torch.Tensor]
    host: dict[str, Any]
    digest: str

    @property
    def steps(self) -> int:
        """The steps priming took: the `LMGen`'s delayed-token offset."""
        return self.host[":offset"]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _digest(tensors: dict[str, torch.Tensor], host: dict[str, Any]) -> str:
    sha = hashlib.sha256()
    for path in sorted(tensors):
        sha.update(path.encode())
        sha.update(tensors[path].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    sha.update(repr(sorted(host.items())).encode())
    return sha.hexdigest()


def capture(gen: Any, *, voice: str, role: Sequence[int]) -> PromptState:
    """The `PromptState` of a streaming `LMGen` at batch 1 that has just been primed
    (`prime`, or the vendor's `step_system_prompts` after its resets); `voice` names the voice
    prompt (a content hash, a file name: the caller's key), `role` is the role prompt's tokens."""
    values = state_of(gen)
    batch = values[":cache"].shape[0]
    if batch != 1:
        raise ValueError(f"a prompt state is taken at batch 1 (one session's priming), the LMGen streams at batch {batch}")
    tensors, host = {}, {}
    for path, value in values.items():
        if isinstance(value, torch.Tensor):
            end = _ring_end(values, path)
            tensors[path] = (value if end is None else value[..., :end, :]).detach().clone()
        elif path.endswith(f":{_CALL_COUNT}"):
            continue
        elif value is None or isinstance(value, (bool, int, float)):
            host[path] = value
        else:
            raise TypeError(f"LMGen state {path!r} is a {type(value).__name__}: a prompt state holds tensors and host values")
    key = (str(voice), tuple(int(t) for t in role))
    return PromptState(key, tensors, host, _digest(tensors, host))


@torch.no_grad()
def restore(gen: Any, state: PromptState) -> None:
    """Copy `state` into a streaming `LMGen` at batch 1 of the same sizes, in place: every tensor
    copied into the one the vendor allocated (each ring's written positions; its other positions
    are read as empty), every host value set. Refused by path where the shapes or paths differ."""
    values = state_of(gen)
    counts = {path for path in values if path.endswith(f":{_CALL_COUNT}")}
    expected = set(state.tensors) | set(state.host) | counts
    if set(values) != expected:
        missing, extra = sorted(expected - set(values)), sorted(set(values) - expected)
        raise ValueError(f"this LMGen's state is not the prompt state's: missing {missing}, not in the prompt state {extra}")
    for path, saved in state.tensors.items():
        live = values[path]
        if not isinstance(live, torch.Tensor):
            raise ValueError(f"LMGen state {path!r} is a {type(live).__name__}, the prompt state holds a tensor")
        target = live if _ring_end(values, path) is None else live[..., : saved.shape[-2], :]
        if target.shape != saved.shape or live.dtype != saved.dtype:
            raise ValueError(
                f"LMGen state {path!r} is {live.dtype} {tuple(live.shape)}; the prompt state holds "
                f"{saved.dtype} {tuple(saved.shape)} (another model size or batch)"
            )
    for path, saved in state.tensors.items():
        live = values[path]
        target = live if _ring_end(values, path) is None else live[..., : saved.shape[-2], :]
        target.copy_(saved)
    owners = {module: s for module, s in gen.get_streaming_state().items()}
    calls = {path: max(state.steps - 1, 0) for path in counts}
    for path, value in {**state.host, **calls}.items():
        module, name = path.split(":")
        setattr(owners[module], name, value)


@torch.no_grad()
def prime(
    mimi: Any,
    gen: Any,
    *,
    text_prompt_tokens: Sequence[int],
    voice_prompt: str | None = None,
    voice_prompt_embeddings: str | None = None,
    checkpoint: Callable[[], None] | None = None,
) -> None:
    """The vendor's priming, as `vendor_loop` runs it (`offline.py`): the voice prompt loaded where
    given (a WAV: `load_voice_prompt`; saved embeddings: `load_voice_prompt_embeddings`), the role
    tokens set, Mimi and the `LMGen` reset, `step_system_prompts`, Mimi reset. Both stream at batch 1.

    `checkpoint`, where given, is called before each prompt step: the vendor's step generators
    (the `_core`s its `step_system_prompts` and `step_system_prompts_async` both drive, the latter
    pausing at each to ask whether its client is alive) are driven here, in its order, and paused
    at each for `checkpoint` (a thread that gives way to another between steps). The steps are
    the same either way."""
    if voice_prompt is not None and voice_prompt_embeddings is not None:
        raise ValueError("a voice prompt is a WAV (voice_prompt) or saved embeddings (voice_prompt_embeddings), not both")
    gen.voice_prompt = gen.voice_prompt_audio = gen.voice_prompt_cache = gen.voice_prompt_embeddings = None
    if voice_prompt is not None:
        gen.load_voice_prompt(voice_prompt)
    if voice_prompt_embeddings is not None:
        gen.load_voice_prompt_embeddings(voice_prompt_embeddings)
    gen.text_prompt_tokens = list(text_prompt_tokens)
    mimi.reset_streaming()
    gen.reset_streaming()
    if checkpoint is None:
        gen.step_system_prompts(mimi)
    else:
        for core in (
            gen._step_voice_prompt_core(mimi),
            gen._step_audio_silence_core(),
            gen._step_text_prompt_core(),
            gen._step_audio_silence_core(),
        ):
            for _ in core:
                checkpoint()
    mimi.reset_streaming()
