"""Token2Wav streams batched as rows (CPU, tiny depth, HiFT narrowed): each stream bit-identical to
the vendor's stream run alone under the batch-invariant envelope, whatever shares its calls."""

import pytest
import torch
from token2wav_batchkit import Plan, plans, run_alone, run_batched

from cadence_fx.models.token2wav_batch import BatchedStreams
from cadence_fx.models.token2wav_stream import (
    REDUCED_HIFT_CHANNELS,
    TINY_DEPTH,
    build_flow,
    build_hift,
    random_chunks,
    random_prompt,
)

CAPACITY, STREAMS, PROMPT_TOKENS, N_TIMESTEPS = 2, 3, 10, 2


@pytest.fixture(scope="module")
def models():
    return build_flow(TINY_DEPTH), build_hift(base_channels=REDUCED_HIFT_CHANNELS)


@pytest.mark.parametrize("seed", [1, 2])
def test_random_composition_each_stream_exact_to_itself_alone(models, seed):
    flow, hift = models
    schedule = plans(seed, STREAMS, prompt_tokens=PROMPT_TOKENS)
    batched = BatchedStreams(flow, hift, capacity=CAPACITY, n_timesteps=N_TIMESTEPS)
    outs, call_classes = run_batched(batched, schedule, prompt_tokens=PROMPT_TOKENS)
    # Rows of different classes never share a call, and a class past the capacity takes more calls.
    assert all(len(set(classes)) == 1 and len(classes) <= CAPACITY for classes in call_classes)
    assert any(len(classes) > 1 for classes in call_classes)  # some call really batched rows
    assert batched.rows == {}  # every stream left
    for s, plan in enumerate(schedule):
        alone = run_alone(flow, hift, plan, capacity=CAPACITY, prompt_tokens=PROMPT_TOKENS, n_timesteps=N_TIMESTEPS)
        assert len(outs[s]) == len(alone) == sum(map(len, plan.turns))
        assert [torch.equal(a.mel, b.mel) for a, b in zip(alone, outs[s])] == [True] * len(alone), f"stream {s} mel"
        assert [torch.equal(a.speech, b.speech) for a, b in zip(alone, outs[s])] == [True] * len(alone), f"stream {s} PCM"


def test_rows_refuse_bad_requests_by_name(models):
    flow, hift = models
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        BatchedStreams(flow, hift, capacity=0)
    batched = BatchedStreams(flow, hift, capacity=2, n_timesteps=N_TIMESTEPS)
    batched.join("a", random_prompt(0, n_tokens=PROMPT_TOKENS), 0)
    with pytest.raises(ValueError, match="stream 'a' has already joined"):
        batched.join("a", random_prompt(0, n_tokens=PROMPT_TOKENS), 0)
    tokens = random_chunks(0, 1)[0]
    with pytest.raises(ValueError, match=r"streams \['b'\] have not joined"):
        batched.step({"b": tokens})
    with pytest.raises(ValueError, match=r"streams \['a'\] flush but have no chunk"):
        batched.step({}, last={"a"})
    with pytest.raises(ValueError, match=r"stream 'a': a chunk is \(1, 28\) integer speech tokens, got \(28,\)"):
        batched.step({"a": tokens[0]})
    with pytest.raises(ValueError, match="no stream 'b' has joined"):
        batched.reset_turn("b")
    batched.leave("a")
    assert batched.rows == {}


def test_rows_of_two_prompt_lengths_at_one_cache_extent_take_two_calls(models):
    """A 20-frame prompt's second chunk and a 70-frame prompt's first both attend 70 frames; the
    trim keeps each prompt, so they are two classes."""
    flow, hift = models
    batched = BatchedStreams(flow, hift, capacity=2, n_timesteps=N_TIMESTEPS)
    short, long = Plan(7, 0, [random_chunks(7, 2)], set()), Plan(8, 0, [random_chunks(8, 1)], set())
    batched.join("short", random_prompt(7, n_tokens=10), 7)
    first = batched.step({"short": short.turns[0][0]})
    batched.join("long", random_prompt(8, n_tokens=35), 8)
    second = batched.step({"short": short.turns[0][1], "long": long.turns[0][0]}, last={"short", "long"})
    assert [keys for _, keys in batched.calls] == [("short",), ("short",), ("long",)]
    alone_short = run_alone(flow, hift, short, capacity=2, prompt_tokens=10, n_timesteps=N_TIMESTEPS)
    alone_long = run_alone(flow, hift, long, capacity=2, prompt_tokens=35, n_timesteps=N_TIMESTEPS)
    got = {"short": [first["short"], second["short"]], "long": [second["long"]]}
    for name, alone in (("short", alone_short), ("long", alone_long)):
        assert all(torch.equal(a.mel, b.mel) and torch.equal(a.speech, b.speech) for a, b in zip(alone, got[name], strict=True))


def test_rows_of_a_shared_prompt_start_from_its_state_computed_once(models):
    """A server's rows share its voice's prompt state (`share_prompt`), computed at start-up: each
    row is still exact to its stream alone, which computes the state itself; without `record` the
    calls are counted by their rows, not kept."""
    flow, hift = models
    batched = BatchedStreams(flow, hift, capacity=2, n_timesteps=N_TIMESTEPS, record=False)
    prompt = random_prompt(7, n_tokens=PROMPT_TOKENS)
    batched.share_prompt(prompt)
    plans_ = {key: Plan(7, 0, [random_chunks(seed, 2)], set()) for key, seed in (("a", 11), ("b", 12))}
    for key in plans_:
        batched.join(key, prompt, 7)
    assert all(row.base is batched._shared[id(prompt)][1] for row in batched.rows.values())
    got = {key: [] for key in plans_}
    for i in range(2):
        for key, out in batched.step(
            {key: plan.turns[0][i] for key, plan in plans_.items()}, last={"a", "b"} if i else set()
        ).items():
            got[key].append(out)
    assert batched.calls is None and batched.call_rows == {2: 2}
    for key, plan in plans_.items():
        alone = run_alone(flow, hift, plan, capacity=2, prompt_tokens=PROMPT_TOKENS, n_timesteps=N_TIMESTEPS)
        assert all(torch.equal(a.mel, b.mel) and torch.equal(a.speech, b.speech) for a, b in zip(alone, got[key], strict=True))
