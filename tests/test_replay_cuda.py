"""ExactShapeReplay on CUDA: replay is bit-identical to deterministic eager, RNG included.

Every comparison is `torch.equal` against eager from the same state, with deterministic kernels
pinned for both arms and eager first checked against itself. The real-model tests use
MiniCPM-o 4.5 Token2Wav (minicpmo-utils 1.0.6) at full size with random weights.

Recorded on the GPU machine by `python bench/gpu_tests.py OUT.json tests/test_replay_cuda.py ...`,
which also collects the timings the tests put in `MEASURED`.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import time

import pytest
import torch

from cadence_fx import determinism
from cadence_fx.passes.hoist import HostConstantHoist
from cadence_fx.passes.piecewise import Piecewise
from cadence_fx.replay import ExactShapeReplay, Phase, ShapeClass, Signature, TensorSpec

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

DEVICE = "cuda"
MEASURED: dict[str, float] = {}


@pytest.fixture(autouse=True, scope="module")
def _deterministic():
    with determinism.deterministic() as settings:
        yield settings


def _clone(tree):
    return torch.utils._pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def _equal(a, b) -> bool:
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb))


def _ms(fn, n: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e3


# -- synthetic --------------------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


@pytest.fixture(scope="module")
def block():
    torch.manual_seed(0)
    return Block().to(DEVICE).eval()


@torch.no_grad()
def test_replay_equals_eager_for_each_catalog_class(block):
    xs = {n: torch.randn(2, n, 256, device=DEVICE) for n in (50, 56)}
    engine = ExactShapeReplay(block, [ShapeClass(f"T={n}", Signature.of(x, 0.5)) for n, x in xs.items()])
    for _ in range(3):
        for n, x in xs.items():
            fresh = torch.randn_like(x)
            assert torch.equal(engine(fresh, 0.5), block(fresh, 0.5))
    assert engine.counters.captures == 2 and engine.counters.replays == 6 and engine.counters.eager == 0
    assert engine.phase("T=50") is Phase.REPLAY


@torch.no_grad()
def test_a_catalog_declared_on_bare_cuda_admits_tensors_on_the_current_device(block):
    engine = ExactShapeReplay(block, [Signature.of(TensorSpec((2, 50, 256), device="cuda"), 0.5)])
    x = torch.randn(2, 50, 256, device=DEVICE)
    assert torch.equal(engine(x, 0.5), block(x, 0.5))
    assert (engine.counters.captures, engine.counters.replays, engine.counters.eager) == (1, 1, 0)


@torch.no_grad()
def test_class_miss_falls_back_eager_with_identical_output(block):
    x = torch.randn(2, 50, 256, device=DEVICE)
    engine = ExactShapeReplay(block, [Signature.of(x, 0.5)])
    engine(x, 0.5)
    other = torch.randn(2, 48, 256, device=DEVICE)
    assert torch.equal(engine(other, 0.5), block(other, 0.5))
    assert torch.equal(engine(x, 0.25), block(x, 0.25))
    assert engine.counters.fallbacks == {"shape": 1, "scalar": 1}


@torch.no_grad()
def test_clone_rule_outputs_survive_the_next_replay_static_rule_outputs_do_not(block):
    x1, x2 = torch.randn(2, 50, 256, device=DEVICE), torch.randn(2, 50, 256, device=DEVICE)
    cloned = ExactShapeReplay(block, [Signature.of(x1, 1.0)])
    static = ExactShapeReplay(block, [Signature.of(x1, 1.0)], output_rule="static")
    a, b = cloned(x1, 1.0), static(x1, 1.0)
    expected = block(x1, 1.0)
    cloned(x2, 1.0)
    b2 = static(x2, 1.0)
    assert torch.equal(a, expected)
    assert b.data_ptr() == b2.data_ptr() and torch.equal(b, block(x2, 1.0))


def carry_step(x: torch.Tensor, carry: torch.Tensor) -> torch.Tensor:
    carry.mul_(0.5).add_(x)
    return carry.sum(0)


@torch.no_grad()
def test_pointer_drift_invalidates_runs_eager_and_recovers():
    x = torch.randn(4, 1024, device=DEVICE)
    carry, mirror = torch.zeros(4, 1024, device=DEVICE), torch.zeros(4, 1024, device=DEVICE)
    engine = ExactShapeReplay(carry_step, [Signature.of(x, carry)], aliased=[1])
    for _ in range(3):
        assert torch.equal(engine(x, carry), carry_step(x, mirror))
    moved, moved_mirror = carry.clone(), mirror.clone()
    assert torch.equal(engine(x, moved), carry_step(x, moved_mirror))
    assert engine.counters.invalidations == 1 and engine.counters.fallbacks == {"pointer_drift": 1}, engine.explain()
    for _ in range(3):
        assert torch.equal(engine(x, moved), carry_step(x, moved_mirror))
    assert torch.equal(moved, moved_mirror)
    assert engine.counters.captures == 2 and engine.counters.replays == 6


def _replayed_module_with_a_buffer() -> tuple[torch.nn.Module, torch.nn.Module, ExactShapeReplay, torch.Tensor]:
    """A module with a buffer (``shift``) its step reads, its stock mirror, and an engine over the
    step whose class captured and replayed (three calls, each equal to the mirror's)."""
    m = torch.nn.Linear(1024, 1024).to(DEVICE)
    m.register_buffer("shift", torch.randn(1024, device=DEVICE))
    mirror = copy.deepcopy(m)
    x = torch.randn(4, 1024, device=DEVICE)
    engine = ExactShapeReplay(lambda x: m(x) + m.shift, [Signature.of(x)], modules=[m], inference=True)
    for _ in range(3):
        assert torch.equal(engine(x), mirror(x) + mirror.shift)
    assert (engine.counters.captures, engine.counters.replays) == (1, 3)  # the capture's call ran its graph too
    return m, mirror, engine, x


def test_a_module_tensor_whose_storage_moved_between_replays_invalidates_the_class_and_names_it():
    """A replayed graph reads the module's tensors at their capture addresses: one whose storage was
    swapped since (``.data =``) is pointer drift, found before the replay (which would read the old
    storage)."""
    m, mirror, engine, x = _replayed_module_with_a_buffer()
    m.shift.data = torch.randn(1024, device=DEVICE)
    mirror.shift.data = m.shift.clone()
    assert torch.equal(engine(x), mirror(x) + mirror.shift)
    assert engine.counters.invalidations == 1 and engine.counters.fallbacks == {"pointer_drift": 1}, engine.explain()
    assert engine.last_miss.detail[0].startswith("module state shift (1024,): data_ptr expected ")


def test_a_module_tensor_rebound_between_replays_invalidates_the_class_and_names_it():
    """A module that rebinds a buffer (``module.shift = new``) leaves the graph reading the old
    tensor, which is still alive at its old address: the replay reads each buffer's place in its
    module again, so that is pointer drift too (the engine once kept the old tensor objects and
    replayed the stale buffer)."""
    m, mirror, engine, x = _replayed_module_with_a_buffer()
    old = m.shift  # kept alive: its storage stays where the graph reads it
    m.shift = torch.randn(1024, device=DEVICE)
    mirror.shift = m.shift.clone()
    assert not torch.equal(old, m.shift)
    assert torch.equal(engine(x), mirror(x) + mirror.shift)
    assert engine.counters.invalidations == 1 and engine.counters.fallbacks == {"pointer_drift": 1}, engine.explain()
    assert engine.last_miss.detail[0].startswith("module state shift (1024,): data_ptr expected ")


def scratch_step(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    scratch.add_(x)
    return scratch * 2


@torch.no_grad()
def test_copied_argument_written_in_place_is_written_back():
    x = torch.randn(8, device=DEVICE)
    s1, s2 = torch.zeros(8, device=DEVICE), torch.zeros(8, device=DEVICE)
    engine = ExactShapeReplay(scratch_step, [Signature.of(x, s1)])
    for _ in range(3):
        assert torch.equal(engine(x, s1), scratch_step(x, s2))
    assert torch.equal(s1, s2)
    assert engine.certificates["class0"].written_back == ("args[1]",)


def noisy(x: torch.Tensor) -> torch.Tensor:
    return x + torch.randn_like(x) * torch.rand(x.shape[0], 1, device=x.device)


class Position:
    """A stream position on the host that every call advances, by 1 or by 2 frames."""

    def __init__(self) -> None:
        self.frames = 0

    def read(self) -> list[int]:
        return [self.frames]

    def write(self, values) -> None:
        (self.frames,) = values

    def step(self, x: torch.Tensor) -> torch.Tensor:
        self.frames += x.shape[0]
        return x * 2


@torch.no_grad()
def test_replays_move_declared_host_counters_as_eager_calls_do():
    position = Position()
    one, two = torch.ones(1, device=DEVICE), torch.ones(2, device=DEVICE)
    engine = ExactShapeReplay(
        position.step, [ShapeClass("one", Signature.of(one)), ShapeClass("two", Signature.of(two))], host_counters=position
    )
    for x in (one, two, one, one, two):
        assert torch.equal(engine(x), x * 2)
    assert engine.counters.captures == 2 and engine.counters.replays == 5 and engine.counters.eager == 0
    assert position.frames == 7


@torch.no_grad()
def test_device_rng_replays_draw_what_eager_draws_first_replay_included():
    x = torch.randn(4, 1000, device=DEVICE)
    torch.cuda.manual_seed(1234)
    eager = [noisy(x) for _ in range(20)]
    eager_state = torch.cuda.get_rng_state()
    engine = ExactShapeReplay(noisy, [Signature.of(x)])
    torch.cuda.manual_seed(1234)
    replayed = [engine(x) for _ in range(20)]
    assert all(torch.equal(a, b) for a, b in zip(eager, replayed))
    assert torch.equal(torch.cuda.get_rng_state(), eager_state)
    cert = engine.certificates["class0"]
    assert cert.captured and cert.reads_device_rng and engine.counters.replays == 20, engine.explain()


class SinusoidalHead(torch.nn.Module):
    """Host constant + device RNG + istft: the HiFT pattern in small."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Conv1d(8, 18, 3, padding=1)
        self.window = torch.hann_window(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        harmonics = torch.FloatTensor([[range(1, 9)]]).to(x.device).transpose(1, 2)
        h = self.proj(x * harmonics + 0.003 * torch.randn_like(x))
        spec = torch.complex(
            torch.exp(h[:, :9]).clip(max=1e2) * torch.cos(h[:, 9:]), torch.exp(h[:, :9]).clip(max=1e2) * torch.sin(h[:, 9:])
        )
        y = torch.istft(spec, 16, 4, 16, window=self.window.to(x.device))
        return torch.clamp(y, -0.99, 0.99)


@torch.no_grad()
def test_piecewise_host_constants_and_device_rng_replay_bit_exact():
    torch.manual_seed(0)
    head = SinusoidalHead().to(DEVICE).eval()
    x = torch.randn(1, 8, 64, device=DEVICE)
    torch.cuda.manual_seed(7)
    eager = [head(x) for _ in range(6)]
    engine = ExactShapeReplay(head, [Signature.of(x)], hooks=[Piecewise(), HostConstantHoist()])
    torch.cuda.manual_seed(7)
    replayed = [engine(x) for _ in range(6)]
    assert all(torch.equal(a, b) for a, b in zip(eager, replayed))
    cert = engine.certificates["class0"]
    assert cert.segments == 2, engine.explain()
    assert cert.segments == 2 and [c.name for c in cert.cuts] == ["torch.istft"]
    assert len(cert.host_constants) == 2


def test_uncapturable_operator_without_a_cut_falls_back_eager_identically():
    code = (
        "import torch\n"
        "from cadence_fx.replay import ExactShapeReplay, Signature\n"
        "f = lambda x: x / x.abs().max().item()\n"
        "x = torch.randn(64, device='cuda')\n"
        "e = ExactShapeReplay(f, [Signature.of(x)])\n"
        "outs = [e(x) for _ in range(3)]\n"
        "assert all(torch.equal(o, f(x)) for o in outs)\n"
        "assert torch.equal(torch.randn(4, device='cuda').cpu(), torch.randn(4, device='cuda').cpu()) is False\n"
        "print(dict(e.counters.fallbacks), e.certificates['class0'].reason)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "{'uncapturable': 3}" in run.stdout


# -- MiniCPM-o 4.5 Token2Wav, full size --------------------------------------------------------


@pytest.fixture(scope="module")
def flow():
    from cadence_fx.models.token2wav_stream import build_flow

    return build_flow(device=DEVICE)


@pytest.fixture(scope="module")
def hift():
    from cadence_fx.models.token2wav_stream import build_hift

    return build_hift(device=DEVICE)


def _estimator_inputs(extent: int, frames: int, seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, device=DEVICE, generator=g)

    store = r(16, 2, 8, 1000, 128)  # the stock att cache is a time slice of a 1000-frame buffer
    return dict(
        x=r(2, 80, frames),
        mu=r(2, 80, frames),
        t=torch.rand(2, device=DEVICE, generator=g),
        spks=r(2, 80),
        cond=r(2, 80, frames),
        cnn_cache=r(16, 2, 1024, 2),
        att_cache=store[:, :, :, :extent, :],
    )


@pytest.mark.parametrize(
    ("extent", "frames"), [(302, 50), (352, 50), (402, 50), (402, 56)], ids=["L302", "L352", "L402", "flush56"]
)
@torch.no_grad()
def test_dit_estimator_replay_equals_eager(flow, extent, frames):
    estimator = flow.decoder.estimator
    inputs = _estimator_inputs(extent, frames, seed=extent + frames)
    assert determinism.check_repeatable(estimator.forward_chunk, **inputs).equal
    eager = _clone(estimator.forward_chunk(**inputs))
    engine = ExactShapeReplay(
        estimator.forward_chunk, [Signature.of(**inputs)], aliased=["cnn_cache", "att_cache"], hooks=[HostConstantHoist()]
    )
    assert _equal(engine(**inputs), eager)
    assert _equal(engine(**inputs), eager)
    x2 = torch.randn_like(inputs["x"])
    assert _equal(engine(**{**inputs, "x": x2}), estimator.forward_chunk(**{**inputs, "x": x2}))
    cert = engine.certificates["class0"]
    assert cert.captured and cert.segments == 1, engine.explain()
    assert [c.site.split(" ")[0] for c in cert.host_constants] == ["TimestepEmbedder.timestep_embedding"]
    assert engine.counters.replays == 3 and engine.counters.eager == 0
    if extent == 402 and frames == 50:
        MEASURED["dit_step_L402_eager_ms"] = _ms(lambda: estimator.forward_chunk(**inputs))
        MEASURED["dit_step_L402_replay_ms"] = _ms(lambda: engine(**inputs))


@pytest.mark.parametrize("extent", [302, 352, 402], ids=["L302", "L352", "L402"])
@torch.no_grad()
def test_cfm_loop_of_a_chunk_replay_equals_eager(flow, extent):
    decoder = flow.decoder
    g = torch.Generator(device=DEVICE).manual_seed(extent)
    decoder.att_cache_buffer.normal_(generator=g)
    decoder.cnn_cache_buffer.normal_(generator=g)
    start = (decoder.att_cache_buffer.clone(), decoder.cnn_cache_buffer.clone())

    def rewind():
        decoder.att_cache_buffer.copy_(start[0])
        decoder.cnn_cache_buffer.copy_(start[1])

    args = dict(
        mu=torch.randn(1, 80, 50, device=DEVICE, generator=g),
        spks=torch.randn(1, 80, device=DEVICE, generator=g),
        cond=torch.randn(1, 80, 50, device=DEVICE, generator=g),
        n_timesteps=10,
        temperature=1.0,
        cnn_cache=decoder.cnn_cache_buffer,
        att_cache=decoder.att_cache_buffer[:, :, :, :, :extent, :],
    )
    eager = _clone(decoder.forward_chunk(**args))
    rewind()
    again = _clone(decoder.forward_chunk(**args))
    assert _equal(eager, again)
    engine = ExactShapeReplay(
        decoder.forward_chunk,
        [ShapeClass(f"L={extent}", Signature.of(**args))],
        aliased=["cnn_cache", "att_cache"],
        hooks=[HostConstantHoist()],
    )
    for _ in range(2):
        rewind()
        assert _equal(_clone(engine(**args)), eager)
    cert = engine.certificates[f"L={extent}"]
    assert cert.captured and cert.segments == 1 and engine.counters.replays == 2, engine.explain()
    if extent == 402:
        MEASURED["cfm_loop_L402_eager_ms"] = _ms(lambda: decoder.forward_chunk(**args), n=5)
        MEASURED["cfm_loop_L402_replay_ms"] = _ms(lambda: engine(**args), n=5)


@torch.no_grad()
def test_hift_20_replayed_calls_equal_20_eager_calls_from_the_same_rng_state(hift):
    g = torch.Generator(device=DEVICE).manual_seed(5)
    mels = [torch.randn(1, 80, 58, device=DEVICE, generator=g) for _ in range(20)]
    source = torch.randn(1, 1, 3840, device=DEVICE, generator=g) * 0.1
    torch.cuda.manual_seed(99)
    assert determinism.check_repeatable(hift, mels[0], source).equal
    torch.cuda.manual_seed(99)
    eager = [_clone(hift(m, source)) for m in mels]
    eager_state = torch.cuda.get_rng_state()
    engine = ExactShapeReplay(hift, [Signature.of(mels[0], source)], hooks=[Piecewise(), HostConstantHoist()])
    torch.cuda.manual_seed(99)
    replayed = [engine(m, source) for m in mels]
    assert [i for i, (a, b) in enumerate(zip(eager, replayed)) if not _equal(a, b)] == []
    assert torch.equal(torch.cuda.get_rng_state(), eager_state)
    cert = engine.certificates["class0"]
    assert cert.captured and cert.segments == 2 and cert.reads_device_rng, engine.explain()
    assert [c.name for c in cert.cuts] == ["torch.istft"]
    assert sorted(c.site.split(" ")[0] for c in cert.host_constants) == [
        "HiFTGenerator._istft",
        "HiFTGenerator._stft",
        "SineGen2.forward",
    ]
    assert engine.counters.replays == 20 and engine.counters.eager == 0
    MEASURED["hift_58_eager_ms"] = _ms(lambda: hift(mels[0], source))
    MEASURED["hift_58_replay_ms"] = _ms(lambda: engine(mels[0], source))
    MEASURED["hift_philox_offset_per_call"] = float(cert.device_rng_advance[torch.cuda.current_device()])
    print(cert.explain())
