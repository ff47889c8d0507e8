"""PersonaPlex's Mimi at batch B with a stream per row (`models/personaplex_mimi.py`), on CPU at the tiny size.

At batch 1 it is PersonaPlex's own Mimi (codes and PCM `torch.equal`, across a reset). At B = 3 a
row is the same row run alone in the same batch (the other rows busy, masked or reset), a masked
call leaves a row's stream as if it never happened, and a reset row is a fresh stream.
"""

from __future__ import annotations

import pytest
import torch
from personaplex_kit import speechlike

from cadence_fx.models import personaplex_stream
from cadence_fx.models.personaplex import FRAME_SIZE, SAMPLE_RATE
from cadence_fx.models.personaplex_mimi import batched_mimi

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FRAMES = 5


@pytest.fixture(scope="module")
def models():
    return personaplex_stream.build_models(personaplex_stream.TINY)


def frames(seed: int) -> list[torch.Tensor]:
    return list(speechlike(FRAMES * FRAME_SIZE / SAMPLE_RATE, seed=seed)[0].split(FRAME_SIZE))


def mask(batch: int, rows) -> torch.Tensor:
    out = torch.zeros(batch, dtype=torch.bool)
    out[list(rows)] = True
    return out


@torch.no_grad()
def run(mimi, batch: int, ticks):
    """Each tick `(frames by row, resets)`: the resets, then one encode of the rows with a frame
    (the others masked, zeros) and one decode of their codes. Per row: its `(codes, pcm)` per tick it ran."""
    got = {row: [] for row in range(batch)}
    for inputs, resets in ticks:
        if resets:
            mimi.reset_streaming(mask(batch, resets))
        rows = mask(batch, inputs)
        x = torch.zeros(batch, 1, FRAME_SIZE)
        for row, frame in inputs.items():
            x[row, 0] = frame
        mimi.set_exec_mask(rows)
        codes = mimi.encode(x)
        pcm = mimi.decode(codes)
        for row in inputs:
            got[row].append((codes[row].clone(), pcm[row].clone()))
    return got


def assert_equal(got, expected):
    assert len(got) == len(expected)
    for (codes, pcm), (want_codes, want_pcm) in zip(got, expected):
        assert torch.equal(codes, want_codes) and torch.equal(pcm, want_pcm)


def test_batch_one_is_personaplex_own_mimi_across_a_reset(models):
    audio = frames(1) + frames(2)
    got = run(
        batched_mimi(models.mimi, models.config, 1), 1, [({0: f}, (0,) if i == FRAMES else ()) for i, f in enumerate(audio)]
    )[0]
    expected, mimi = [], models.mimi
    with torch.no_grad(), mimi.streaming(1):
        for i, frame in enumerate(audio):
            if i == FRAMES:
                mimi.reset_streaming()
            codes = mimi.encode(frame.view(1, 1, FRAME_SIZE))
            expected.append((codes[0], mimi.decode(codes)[0]))
    assert_equal(got, expected)


def test_a_row_is_the_same_row_alone_whatever_the_others_do(models):
    a, b, c, d = frames(3), frames(4), frames(5), frames(6)
    # Row 1 runs a, is masked at tick 2 (row 0 runs then), then runs the rest of a. Row 0 runs b
    # and is reset at tick 3 to run c; row 2 runs d from tick 1, masked at ticks 3 and 4.
    ticks = [
        ({0: b[0], 1: a[0]}, ()),
        ({0: b[1], 1: a[1], 2: d[0]}, ()),
        ({0: b[2], 2: d[1]}, ()),
        ({0: c[0], 1: a[2]}, (0,)),
        ({0: c[1], 1: a[3]}, ()),
        ({1: a[4], 2: d[2]}, ()),
    ]
    busy = run(batched_mimi(models.mimi, models.config, 3), 3, ticks)
    alone = {
        1: run(batched_mimi(models.mimi, models.config, 3), 3, [({1: f}, ()) for f in a])[1],
        2: run(batched_mimi(models.mimi, models.config, 3), 3, [({2: f}, ()) for f in d[:3]])[2],
        "c": run(batched_mimi(models.mimi, models.config, 3), 3, [({0: f}, ()) for f in c[:2]])[0],
    }
    assert_equal(busy[1], alone[1])
    assert_equal(busy[2], alone[2])
    assert_equal(busy[0][3:], alone["c"])  # a reset row is a fresh stream


def test_bad_arguments_are_refused_by_name(models):
    with pytest.raises(ValueError, match="batch must be a positive batch size, got 0"):
        batched_mimi(models.mimi, models.config, 0)
    other = personaplex_stream.TINY.__class__(
        **{**personaplex_stream.TINY.__dict__, "transformer": {**personaplex_stream.TINY.transformer, "dim_feedforward": 128}}
    )
    with pytest.raises(ValueError, match="this Mimi's weights do not fit the configuration's sizes"):
        batched_mimi(models.mimi, other, 1)
