"""PersonaPlex sessions as the slots of one batch: the LM steps every slot in one batched call,
each slot with its own voice and role, priming while the others keep their real-time ticks.

The reference, precisely (docs/families/personaplex.md): `PersonaPlexSlots` is the masked batched
loop, run eagerly on PersonaPlex's own modules. Per LM call it is `LMGen.step`'s glue
(`prepare_step_input`, `process_transformer_output`) with an offset per row and an exec mask, as
Kyutai's 0.2.13 `LMGen` has them, around PersonaPlex's `LMModel.forward_codes` (its main
transformer masked per row: `models/personaplex_masked.py`) and PersonaPlex's
`LMGen.depformer_step`, unchanged. At batch 1 it is bit-identical to PersonaPlex's own loop
(`vendor_loop`), prompt phase included; `tests/test_personaplex_slots.py` checks both.

- **Mimi runs batched, a streaming state per row** (`models/personaplex_mimi.py`: Kyutai's 0.2.13
  Mimi on PersonaPlex's weights, the exec and reset masks Moshi's slots use): one encode per tick
  for the slots with a user frame (the others masked), one decode for the slots that speak. At
  batch 1 a slot's audio is PersonaPlex's own Mimi's; at B > 1 it is its row's, which the other
  rows do not change, and not bit-exact to batch 1 (as the LM's is not; that module says by how much).
- **A join** resets the slot's rows (`reset_rows`: offsets, ring ends, `provided` flags, as the
  vendor's `reset_streaming` does for the whole batch), resets its Mimi row, and then either copies a
  `PromptState` into its rows (`personaplex_prompt`: the state the vendor's priming leaves, the
  fast way) or queues the prompt's steps (`prompt_steps`: a voice's frames, half a second of
  silence, the role's tokens, half a second of silence, as `step_system_prompts` steps them).
- **A tick** takes one user frame from each slot past its prompt (`frames`), and steps each
  priming slot up to `prompt_rate` prompt steps: the first LM call of the tick executes the user
  slots and the priming slots, the next calls the priming slots alone (the others masked). At
  12.5 frames a second, `prompt_rate` = 4 primes at 50 steps a second, 4 times real time.
- **A masked row** is computed and thrown away: its offsets, its cache and flags stay (written
  through `torch.where`); its ring is written only at and past its end offset (empty positions).
- **Sampling** is the batch's, as in Kyutai's batched loop: one generator (seeded with `seed`,
  swapped in for each tick) draws for all rows in one call, so a sampled slot's draws depend on
  the batch and its history; greedy (`sampling=False`) draws nothing.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cadence_fx.multiplex import rng_get, rng_seeded, rng_set

from .personaplex import AGENT, FRAME_SIZE, _vendor
from .personaplex_masked import mask_transformer, reset_rows, row_states, set_exec
from .personaplex_mimi import batched_mimi
from .personaplex_prompt import PromptState, _digest
from .personaplex_stream import PersonaPlexModels, lm_gen

__all__ = ["PersonaPlexSlots", "PromptStep", "SlotOutput", "prompt_steps", "voice_codes"]

#: The user stream's codebooks in the LM's input (after the text and the agent's 8).
_USER = slice(9, 17)


@dataclass(frozen=True)
class PromptStep:
    """One step of the prompt phase: the agent's 8 codes and the text token the vendor provides
    (the user's stream is the vendor's sine frame at every prompt step)."""

    agent: tuple[int, ...]
    text: int


@dataclass(frozen=True)
class SlotOutput:
    """A user frame's answer: `tokens` `(17,)` (text, the agent's 8, the user's 8, as `LMGen.step`
    returns them) and the agent's `pcm` `(1920,)`."""

    tokens: torch.Tensor
    pcm: torch.Tensor


def prompt_steps(gen: Any, *, voice: torch.Tensor | None, role: Sequence[int]) -> tuple[PromptStep, ...]:
    """The steps `step_system_prompts` takes, in its order, with `gen`'s constants (a vendor
    `LMGen`): each voice frame (`voice`, `(8, frames)`, from `voice_codes`) with the zero text
    code, `audio_silence_frame_cnt` silence frames, each role token over a silence frame, and the
    silence frames again."""
    silence = tuple(int(c) for c in gen._encode_zero_frame().flatten())
    zero = int(gen.zero_text_code)
    quiet = (PromptStep(silence, zero),) * gen.audio_silence_frame_cnt
    voiced = () if voice is None else tuple(PromptStep(tuple(int(c) for c in voice[:, i]), zero) for i in range(voice.shape[1]))
    return (*voiced, *quiet, *(PromptStep(silence, int(token)) for token in role), *quiet)


@torch.no_grad()
def voice_codes(models: PersonaPlexModels, wav: str) -> torch.Tensor:
    """A voice prompt WAV as the vendor steps it: read, resampled and loudness-normalized
    (`load_voice_prompt`), then Mimi-encoded frame by frame on a fresh stream
    (`_encode_voice_prompt_frames`, the last frame padded). `(8, frames)` int64."""
    no_compile = _vendor("utils.compile").no_compile
    gen = lm_gen(models.lm, sampling=False)
    gen.load_voice_prompt(wav)
    mimi = copy.deepcopy(models.mimi, {id(t): t for t in itertools.chain(models.mimi.parameters(), models.mimi.buffers())})
    with no_compile(), mimi.streaming(1):
        return torch.cat([codes[0] for codes in gen._encode_voice_prompt_frames(mimi)], dim=-1)


def _eager_mimi() -> contextlib.AbstractContextManager:
    """Kyutai's Mimi eager: its `CUDAGraphed` encoder and decoder wrappers and its lazily compiled
    functions off, as the rest of this loop runs."""
    from moshi.utils.compile import no_compile, no_cuda_graph

    stack = contextlib.ExitStack()
    stack.enter_context(no_cuda_graph())
    stack.enter_context(no_compile())
    return stack


class PersonaPlexSlots:
    """`slots` sessions over one batched LM (see the module docstring). `join(slot, ...)`,
    `leave(slot)`, `tick(frames)`; `priming(slot)` says how many prompt steps a slot has left."""

    def __init__(self, models: PersonaPlexModels, slots: int, *, sampling: bool, seed: int, prompt_rate: int = 4) -> None:
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise ValueError(f"slots must be a positive batch size, got {slots!r}")
        if not isinstance(prompt_rate, int) or isinstance(prompt_rate, bool) or prompt_rate < 1:
            raise ValueError(f"prompt_rate must be a positive number of prompt steps per tick, got {prompt_rate!r}")
        weights = {id(t): t for m in (models.mimi, models.lm) for t in itertools.chain(m.parameters(), m.buffers())}
        self.models = copy.deepcopy(models, weights)
        self.slots, self.prompt_rate = slots, prompt_rate
        lm, mimi = self.models.lm, self.models.mimi
        self.device = lm.device
        self.gen = lm_gen(lm, sampling=sampling)  # its depformer step, its sampling settings and prompt constants
        self.exec = mask_transformer(lm.transformer, slots)
        self.rows = row_states(lm.transformer)
        self.delays = torch.tensor(lm.delays, dtype=torch.long, device=self.device)
        self.max_delay = int(max(lm.delays))
        K, CT = lm.num_codebooks, self.max_delay + 3
        self.cache = torch.full((slots, K, CT), lm.ungenerated_token_id, dtype=torch.long, device=self.device)
        self.provided = torch.zeros((slots, K, CT), dtype=torch.bool, device=self.device)
        self.offsets = torch.zeros(slots, dtype=torch.long, device=self.device)
        self.initial = lm._get_initial_token()  # (1, K, 1)
        self.sine = self.gen._encode_sine_frame()[0]  # (8, 1)
        self.mimi = batched_mimi(mimi, self.models.config, slots)
        self.queues: list[list[PromptStep] | None] = [None] * slots  # None: no session in the slot
        self.rng = rng_seeded(self.device, seed)
        self.ticks = 0
        self.calls = 0  # batched LM calls

    # -- sessions ---------------------------------------------------------------------------------

    def _check_slot(self, slot: Any) -> None:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot!r} is outside 0..{self.slots - 1} (the batch holds {self.slots} slots)")

    def join(self, slot: int, *, prompt: PromptState | None = None, steps: Sequence[PromptStep] = ()) -> None:
        """A session begins in `slot` (one that left, or never had one): its rows reset, then its
        prompt copied in (`prompt`) or queued to step (`steps`; both: the steps come after the state)."""
        self._check_slot(slot)
        if self.queues[slot] is not None:
            raise ValueError(f"slot {slot} holds a session: it leaves before another joins")
        rows = self._rows([slot])
        with torch.no_grad():
            reset_rows(self.models.lm.transformer, rows)
            self.offsets[slot] = 0
            self.provided[slot] = False
            self.mimi.reset_streaming(rows)
            if prompt is not None:
                self._restore(slot, prompt)
        self.queues[slot] = list(steps)

    def leave(self, slot: int) -> None:
        self._check_slot(slot)
        if self.queues[slot] is None:
            raise ValueError(f"slot {slot} holds no session")
        self.queues[slot] = None

    def priming(self, slot: int) -> int:
        self._check_slot(slot)
        queue = self.queues[slot]
        if queue is None:
            raise ValueError(f"slot {slot} holds no session")
        return len(queue)

    # -- prompt states ------------------------------------------------------------------------------

    def _paths(self) -> dict[str, tuple[str, str]]:
        """The vendor's `state_of` path of each piece of a row: `(row-state name, field)`."""
        paths = {
            ":cache": ("", "cache"),
            ":provided": ("", "provided"),
            ":initial": ("", "initial"),
            "lm_model.transformer:offset": ("transformer", "offset"),
        }
        for name, state in self.rows.items():
            if state.cache is not None:
                prefix = f"lm_model.transformer.{name}:"
                paths |= {
                    prefix + "kv_cache.cache": (name, "cache"),
                    prefix + "kv_cache.end_offset": (name, "end"),
                    prefix + "offset": (name, "offset"),
                }
        return paths

    def _restore(self, slot: int, state: PromptState) -> None:
        paths = self._paths()
        if set(state.tensors) != set(paths) or set(state.host) != {":offset"}:
            raise ValueError(
                f"the prompt state does not fit these slots: it holds {sorted(state.tensors)}, the slots take {sorted(paths)}"
            )
        for path, (name, field) in paths.items():
            saved = state.tensors[path]
            if name == "":
                if field == "initial":
                    if not torch.equal(saved, self.initial):
                        raise ValueError("the prompt state's initial tokens are not this LM's (another model)")
                    continue
                target = getattr(self, field)[slot]
                saved = saved[0]
            elif field == "cache":
                cache = self.rows[name].cache
                assert cache is not None  # `_paths` names the rows that have a cache
                target = cache[:, slot, :, : saved.shape[3]]
                saved = saved[:, 0]
            else:
                target = getattr(self.rows["" if name == "transformer" else name], field)[slot]
                saved = saved[0]
            if target.shape != saved.shape or target.dtype != saved.dtype:
                raise ValueError(
                    f"prompt state {path!r} is {saved.dtype} {tuple(saved.shape)}; a slot's is "
                    f"{target.dtype} {tuple(target.shape)} (another model size)"
                )
            target.copy_(saved)
        self.offsets[slot] = state.steps

    def capture(self, slot: int, *, voice: str, role: Sequence[int]) -> PromptState:
        """`slot`'s rows as a `PromptState` (the vendor's paths), once its prompt is stepped: a WAV
        turned into a prompt state once, for later sessions to copy in."""
        self._check_slot(slot)
        if self.queues[slot] is None or self.queues[slot]:
            raise ValueError(f"slot {slot} is not primed (a prompt state is taken once every prompt step ran)")
        tensors = {}
        for path, (name, field) in self._paths().items():
            if name == "":
                value = self.initial if field == "initial" else getattr(self, field)[slot : slot + 1]
            elif field == "cache":
                cache, ends = self.rows[name].cache, self.rows[name].end
                assert cache is not None and ends is not None  # `_paths` names the rows that have a ring
                value = cache[:, slot : slot + 1, :, : min(int(ends[slot]), cache.shape[3])]
            else:
                value = getattr(self.rows["" if name == "transformer" else name], field)[slot : slot + 1]
            tensors[path] = value.detach().clone()
        host = {":offset": int(self.offsets[slot])}
        key = (str(voice), tuple(int(t) for t in role))
        return PromptState(key, tensors, host, _digest(tensors, host))

    # -- ticks --------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _generators(self) -> Iterator[None]:
        caller = rng_get(self.device)
        rng_set(self.device, self.rng)
        try:
            yield
        finally:
            self.rng = rng_get(self.device)
            rng_set(self.device, caller)

    def tick(self, frames: Mapping[int, torch.Tensor]) -> dict[int, SlotOutput | None]:
        """One user frame for each slot in `frames` (each past its prompt), and up to `prompt_rate`
        prompt steps for each priming slot. Each user slot's answer, None while the LM's delays
        have not passed (`LMGen.step` returns None)."""
        for slot, frame in frames.items():
            self._check_slot(slot)
            queue = self.queues[slot]
            if queue is None:
                raise ValueError(f"frames[{slot}]: slot {slot} holds no session (join it first)")
            if queue:
                raise ValueError(
                    f"frames[{slot}]: slot {slot} is priming ({len(queue)} prompt steps left); it takes user frames once primed"
                )
            if not isinstance(frame, torch.Tensor) or frame.shape != (FRAME_SIZE,) or frame.dtype != torch.float32:
                got = f"{frame.dtype} {tuple(frame.shape)}" if isinstance(frame, torch.Tensor) else type(frame).__name__
                raise ValueError(f"frames[{slot}]: a frame is {FRAME_SIZE} float32 samples, shape ({FRAME_SIZE},); got {got}")
        users = sorted(frames)
        priming = {slot: queue for slot, queue in enumerate(self.queues) if queue}  # the priming slots, with their queues
        if not users and not priming:
            raise ValueError("a tick runs at least one slot: no frames, and no slot is priming")
        no_compile = _vendor("utils.compile").no_compile
        outputs: dict[int, SlotOutput | None] = {slot: None for slot in users}
        with self._generators(), no_compile(), _eager_mimi(), torch.no_grad():
            codes = self._encode(frames)
            for call in range(self.prompt_rate):
                steps = {slot: queue[call] for slot, queue in priming.items() if call < len(queue)}
                rows = (users if call == 0 else []) + sorted(steps)
                if not rows:
                    break
                out, speaking = self._call(rows, codes if call == 0 else {}, steps)
                talking = [slot for slot in users if speaking[slot]] if call == 0 else []
                if talking:
                    pcm = self._decode(out, talking)
                    outputs |= {slot: SlotOutput(out[slot, :, 0].clone(), pcm[slot, 0].clone()) for slot in talking}
            for queue in priming.values():
                del queue[: self.prompt_rate]
        self.ticks += 1
        return outputs

    def _rows(self, slots: Sequence[int]) -> torch.Tensor:
        rows = torch.zeros(self.slots, dtype=torch.bool, device=self.device)
        rows[list(slots)] = True
        return rows

    def _encode(self, frames: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Every user frame Mimi-encoded in one batched call, the other rows masked (zeros, their
        streams unchanged): each slot's codes, `(1, 8, 1)`."""
        if not frames:
            return {}
        users = sorted(frames)
        batch = torch.zeros(self.slots, 1, FRAME_SIZE)
        batch[users, 0] = torch.stack([frames[slot] for slot in users])
        self.mimi.set_exec_mask(self._rows(users))
        codes = self.mimi.encode(batch.to(self.device))
        return {slot: codes[slot : slot + 1] for slot in users}

    def _decode(self, out: torch.Tensor, talking: Sequence[int]) -> torch.Tensor:
        """The agent's codes of the `talking` rows decoded in one batched call, the other rows
        masked (code 0 in place of what their rows hold: the ungenerated id, an initial token;
        their streams unchanged): `(B, 1, FRAME_SIZE)`, only the talking rows outputs."""
        rows = self._rows(talking)
        self.mimi.set_exec_mask(rows)
        return self.mimi.decode(torch.where(rows.view(-1, 1, 1), out[:, AGENT], 0))

    def _write(self, ks: slice, values: torch.Tensor, mask: torch.Tensor) -> None:
        """`prepare_step_input`'s writes of provided tokens, per row: codebooks `ks` at each row's
        offset plus their delays, where `mask`."""
        B = self.slots
        k = torch.arange(ks.start, ks.stop, device=self.device)
        positions = (self.offsets.view(B, 1) + self.delays[k].view(1, -1)) % self.cache.shape[2]
        batch = torch.arange(B, device=self.device).view(B, 1)
        keep = mask.view(B, 1)
        self.cache[batch, k, positions] = torch.where(keep, values, self.cache[batch, k, positions])
        self.provided[batch, k, positions] |= keep

    def _call(
        self, rows: Sequence[int], codes: Mapping[int, torch.Tensor], steps: Mapping[int, PromptStep]
    ) -> tuple[torch.Tensor, list[bool]]:
        """One `LMGen.step` for the executing `rows`, masked: user rows with their codes, priming
        rows with their prompt step. Returns `out` `(B, 17, 1)` and, per row, whether it is an
        output (`LMGen.step` did not return None)."""
        B, device, lm, gen = self.slots, self.device, self.models.lm, self.gen
        CT = self.cache.shape[2]
        ex = torch.zeros(B, dtype=torch.bool, device=device)
        ex[list(rows)] = True
        user = self.sine.view(1, 8).repeat(B, 1)
        agent = torch.zeros(B, 8, dtype=torch.long, device=device)
        text = torch.zeros(B, dtype=torch.long, device=device)
        given = torch.zeros(B, dtype=torch.bool, device=device)
        for slot, code in codes.items():
            user[slot] = code[0, :, 0]
        for slot, step in steps.items():
            agent[slot] = torch.tensor(step.agent, device=device)
            text[slot] = step.text
            given[slot] = True
        # prepare_step_input: the user's stream, the agent's and the text where provided, then the initial tokens.
        self._write(_USER, user, ex)
        self._write(slice(1, 9), agent, ex & given)
        self._write(slice(0, 1), text.view(B, 1), ex & given)
        batch = torch.arange(B, device=device).view(B, 1)
        k = torch.arange(self.cache.shape[1], device=device).view(1, -1)
        position = (self.offsets % CT).view(B, 1)
        init = ex.view(B, 1) & (self.offsets.view(B, 1) <= self.delays.view(1, -1))
        self.cache[batch, k, position] = torch.where(init, self.initial[:, :, 0], self.cache[batch, k, position])
        self.provided[batch, k, position] |= init
        # A row at offset 0 only fills its cache's first position and moves to offset 1.
        first = ex & (self.offsets == 0)
        self.cache[:, :, 0] = torch.where(first.view(B, 1), self.initial[:, :, 0], self.cache[:, :, 0])
        self.offsets += first.long()
        run = ex & ~first
        speaking = [False] * B
        out = torch.full((B, self.cache.shape[1], 1), lm.ungenerated_token_id, dtype=torch.long, device=device)
        if not bool(run.any()):
            return out, speaking
        self.calls += 1
        inputs_at = ((self.offsets - 1) % CT).view(B, 1, 1).expand(B, self.cache.shape[1], 1)
        target_at = (self.offsets % CT).view(B, 1, 1).expand(B, self.cache.shape[1], 1)
        input_ = self.cache.gather(2, inputs_at)
        target_ = self.cache.gather(2, target_at)
        provided_ = self.provided.gather(2, target_at)
        set_exec(self.exec, run)
        transformer_out, text_logits = lm.forward_codes(input_)
        sample_token = _vendor("utils.sampling").sample_token
        sampled_text = sample_token(text_logits.float(), gen.use_sampling, gen.temp_text, gen.top_k_text)[:, 0, 0]
        next_text = torch.where(provided_[:, 0, 0], target_[:, 0, 0], sampled_text)
        audio = gen.depformer_step(
            next_text, transformer_out, target_[:, lm.audio_offset :, 0], provided_[:, lm.audio_offset :, 0]
        )
        # process_transformer_output: the input position's flags cleared, the sampled tokens kept where not provided.
        self.provided.scatter_(2, inputs_at, self.provided.gather(2, inputs_at) & ~run.view(B, 1, 1))
        kept = self.provided.gather(2, target_at)[:, :, 0]
        cached = self.cache.gather(2, target_at)[:, :, 0]
        sampled = torch.cat([sampled_text.view(B, 1), audio, cached[:, lm.dep_q + 1 :]], dim=1)
        new = torch.where(run.view(B, 1) & ~kept, sampled, cached)
        self.cache.scatter_(2, target_at, new.view(B, -1, 1))
        talking = run & (self.offsets > self.max_delay)
        index = (self.offsets.view(B, 1) - self.max_delay + self.delays[: lm.dep_q + 1].view(1, -1)) % CT
        out = self.cache.gather(2, index.view(B, -1, 1))
        self.offsets += run.long()
        return out, talking.tolist()
