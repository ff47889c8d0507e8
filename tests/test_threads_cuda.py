"""Issue 14's failures, on small models: engines driven from several host threads at once.

On an H200, two transformed flows stepped at the same time from two threads on two CUDA streams
crashed the process once (segfault) and hung for more than 500 s once, and a flow stepped from a
second thread ran HiFT eagerly (refused as `autograd`: grad mode is per thread). Here: two engines
captured and replayed from two threads at once, each on its own stream, equal bit for bit to the
same calls made alone; an engine in a new thread replays; lanes whose calls draw device RNG
through an `RngSection` draw for each session what it draws alone; a second engine capturing
into a shared graph pool reuses what the first one's capture freed.

Recorded on the GPU machine by `python bench/gpu_tests.py OUT.json tests/test_threads_cuda.py`.
"""

from __future__ import annotations

import threading

import pytest
import torch

from cadence_fx import determinism
from cadence_fx.lanes import Lane, RngSection
from cadence_fx.multiplex import SessionState, rng_seeded
from cadence_fx.replay import ExactShapeReplay

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

DEVICE = "cuda"
SHAPES = (64, 64, 128, 64, 256, 128, 256, 64, 128, 256, 64, 64)  # captures fall between replays


@pytest.fixture(autouse=True, scope="module")
def _deterministic():
    with determinism.deterministic() as settings:
        yield settings


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512), torch.nn.LayerNorm(512)]
    return torch.nn.Sequential(*layers).to(DEVICE).eval()


def _inputs(seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return [torch.randn(n, 512, device=DEVICE, generator=g) for n in SHAPES]


def _run(engine, inputs: list[torch.Tensor], stream: torch.cuda.Stream) -> list[torch.Tensor]:
    with torch.no_grad(), torch.cuda.stream(stream):
        outs = [engine(x) for x in inputs]
        stream.synchronize()
    return outs


def _threads(targets: dict[str, callable]) -> dict[str, object]:
    """Run every target in its own thread, started together; their results or errors."""
    start = threading.Barrier(len(targets), timeout=60)
    results: dict[str, object] = {}

    def run(name, fn):
        try:
            start.wait()
            results[name] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            results[name] = e

    threads = [threading.Thread(target=run, args=(n, f), name=n) for n, f in targets.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung (issue 14: more than 500 s on an H200)"
    return results


def test_two_engines_captured_and_replayed_from_two_threads_at_once_equal_each_alone():
    models, inputs = [_mlp(1), _mlp(2)], [_inputs(11), _inputs(12)]
    with torch.no_grad():
        alone = [[m(x) for x in xs] for m, xs in zip(models, inputs)]
    engines = [ExactShapeReplay(m, lambda s: True, name=f"mlp{i}") for i, m in enumerate(models)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()  # the inputs, made on the default stream, are read on the threads' own
    results = _threads({f"t{i}": (lambda i=i: _run(engines[i], inputs[i], streams[i])) for i in (0, 1)})
    for i in (0, 1):
        assert not isinstance(results[f"t{i}"], BaseException), repr(results[f"t{i}"])
        assert all(torch.equal(a, b) for a, b in zip(results[f"t{i}"], alone[i], strict=True))
        c = engines[i].counters
        assert (c.calls, c.captures, c.replays, c.eager) == (len(SHAPES), 3, len(SHAPES), 0)
        assert {cert.thread for cert in engines[i].certificates.values()} == {f"t{i}"}


def test_an_engine_stepped_from_a_new_thread_replays_rather_than_refusing():
    model, inputs = _mlp(3), _inputs(13)
    with torch.no_grad():
        alone = [model(x) for x in inputs]
    engine = ExactShapeReplay(model, lambda s: True, name="mlp", inference=True)

    def step() -> tuple[bool, list[torch.Tensor]]:  # no no_grad here: a new thread is in grad mode
        outs = [engine(x) for x in inputs]
        torch.cuda.synchronize()
        return torch.is_grad_enabled(), outs

    grad, outs = _threads({"second": step})["second"]
    assert grad is True
    assert all(torch.equal(a, b) for a, b in zip(outs, alone, strict=True))
    c = engine.counters
    assert (c.calls, c.captures, c.replays, c.eager, dict(c.fallbacks)) == (len(SHAPES), 3, len(SHAPES), 0, {})


class _Noisy(torch.nn.Module):
    """Draws device RNG on every call, as HiFT does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.rand_like(x)


def test_lanes_drawing_device_rng_through_a_section_draw_for_each_session_what_it_draws_alone():
    device = torch.device(DEVICE)
    torch.manual_seed(4)
    model = _Noisy().to(DEVICE).eval()
    g = torch.Generator(device=DEVICE).manual_seed(5)
    chunks = [torch.randn(32, 256, device=DEVICE, generator=g) for _ in range(6)]
    seeds = (21, 22, 23, 24)
    alone = {}
    with torch.no_grad():
        for seed in seeds:
            torch.cuda.set_rng_state(rng_seeded(device, seed))
            alone[seed] = [model(x) for x in chunks]
    with torch.no_grad():
        lanes = [Lane(f"lane{k}", DEVICE) for k in (0, 1)]
    engines = [ExactShapeReplay(model, lambda s: True, name=f"noisy{k}", inference=True) for k in (0, 1)]
    section = RngSection(device)
    states = {seed: SessionState([], [], rng_seeded(device, seed)) for seed in seeds}
    drawn: dict[int, list[torch.Tensor]] = {seed: [] for seed in seeds}
    torch.cuda.synchronize()  # the chunks, made on the default stream, are read on the lanes' own

    def lane_round(k: int, c: int) -> None:
        for seed in seeds[k::2]:
            drawn[seed].append(section.call(states[seed], engines[k], chunks[c]))

    try:
        for c in range(len(chunks)):
            for future in [lane.submit(lane_round, k, c) for k, lane in enumerate(lanes)]:
                future.result(timeout=120)
    finally:
        for lane in lanes:
            lane.close()
    for seed in seeds:
        assert all(torch.equal(a, b) for a, b in zip(drawn[seed], alone[seed], strict=True)), seed
    for e in engines:
        assert (e.counters.captures, e.counters.eager) == (1, 0)
        assert e.certificates["class0"].reads_device_rng


def test_a_second_engine_capturing_into_a_shared_pool_reuses_what_the_first_freed():
    x = torch.randn(512, 512, device=DEVICE)
    pool = torch.cuda.graph_pool_handle()
    shared = [ExactShapeReplay(_mlp(6), lambda s: True, name=f"shared{i}", pool=pool, inference=True) for i in (0, 1)]
    own = ExactShapeReplay(_mlp(7), lambda s: True, name="own", inference=True)
    for engine in (*shared, own):
        engine(x)
    first, second, alone = (e.certificates["class0"] for e in (*shared, own))
    assert first.staged_bytes == second.staged_bytes == alone.staged_bytes == 512 * 512 * 4
    assert first.pool_reserved_bytes > 0 and alone.pool_reserved_bytes > 0
    assert second.pool_reserved_bytes == 0


def test_a_session_seeded_on_the_device_draws_what_the_process_generator_seeded_alike_draws():
    """`rng_seeded` uses a generator of its own (it must not touch the process's, which another
    lane may be drawing from): its state is the one `torch.cuda.manual_seed` gives."""
    device = torch.device(DEVICE)
    state = rng_seeded(device, 11)
    with torch.random.fork_rng(devices=[0]):
        torch.cuda.manual_seed(11)
        assert torch.equal(state, torch.cuda.get_rng_state(device))
        expected = torch.rand(5, device=device)
        torch.cuda.set_rng_state(state, device)
        assert torch.equal(torch.rand(5, device=device), expected)
