"""The runner: a class's certification probe, warm-ups and capture on a side stream, and its
replays (staging copies in, writing copies back, moving the host counters as an eager call would).
Functions of the `ExactShapeReplay` whose class the dispatcher admitted."""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from cadence_fx.determinism import RngState, StateSnapshot

from .capture import (
    _BUSY,
    _CURRENT,
    CaptureContext,
    _GraphStep,
    _GuardFailure,
    _HookMode,
    _Recorder,
    _Rejected,
)
from .certificate import Certificate, CutRecord
from .dispatch import ClassState, Phase
from .signature import (
    _T,
    Miss,
    MissReason,
    Signature,
    _unflatten,
    is_dense,
)

if TYPE_CHECKING:
    from .engine import ExactShapeReplay

log = logging.getLogger("cadence_fx.replay")


class ReplayError(RuntimeError):
    """A replay could not complete and the call's effects cannot be undone, or the engine was
    driven in a way it cannot serve (from two threads at once)."""


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _shares_module_state(
    names: list[str], leaves: list[Any], aliased: Collection[int], buffers: list[tuple[str, torch.Tensor]]
) -> list[str]:
    """Copied arguments that are views of a module buffer: staging them would feed the graph a
    snapshot while the callable updates the buffer itself (the stock Token2Wav cache is a view of
    the CFM's own cache buffer on its first chunks)."""
    storages = {b.untyped_storage().data_ptr(): n for n, b in buffers if b.untyped_storage().data_ptr()}
    return [
        f"{names[i]} ~ {storages[x.untyped_storage().data_ptr()]}"
        for i, x in enumerate(leaves)
        if isinstance(x, torch.Tensor) and i not in aliased and x.untyped_storage().data_ptr() in storages
    ]


@contextlib.contextmanager
def hooked(engine: ExactShapeReplay, ctx: CaptureContext) -> Iterator[None]:
    token, busy = _CURRENT.set(ctx), _BUSY.set(True)
    try:
        if engine.hooks:
            with _HookMode(ctx, engine.hooks):
                yield
        else:
            yield
    finally:
        _BUSY.reset(busy)
        _CURRENT.reset(token)


def capture_device(engine: ExactShapeReplay, leaves: list[Any]) -> torch.device | None:
    if not torch.cuda.is_available():
        return None
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.device.type == "cuda":
            return x.device
    for m in engine.modules:
        for p in m.parameters():
            if p.device.type == "cuda":
                return p.device
    return None


def certify_and_capture(
    engine: ExactShapeReplay, st: ClassState, sig: Signature, leaves: list[Any], spec: tuple, args: tuple, kwargs: dict[str, Any]
) -> Any:
    names = st.names
    device = capture_device(engine, leaves)
    buffers = [(f"buffer {n}", b) for m in engine.modules for n, b in m.named_buffers()]
    snapshot = StateSnapshot.of(
        [
            (n, x)
            for n, x in [*((names[i], x) for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)), *buffers]
            if x.untyped_storage().data_ptr() not in engine._unsnapshotted
        ]
    )
    rng = RngState.capture()
    bindings = [(mod, dict(mod._buffers)) for m in engine.modules for mod in m.modules()]
    host_roots = [x for x in leaves if isinstance(x, torch.Tensor) and x.device.type == "cpu"]
    checks = ["signature", "host RNG", "device RNG", "writes", "buffer rebinding"]
    if st.aliased:
        checks.append("aliased data_ptr")
    if device is not None:
        stream = side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        stream_ctx: Any = torch.cuda.stream(stream)
    else:
        stream, stream_ctx = None, contextlib.nullcontext()
    st.phase = Phase.CAPTURE
    rejected: _Rejected | None = None
    counters = engine._read_counters()
    with stream_ctx:
        probe = CaptureContext("probe", device, host_data=host_roots)
        try:
            with hooked(engine, probe):
                engine.fn(*args, **kwargs)
        except _Rejected as r:
            rejected = r
        except BaseException:
            snapshot.restore()
            rng.restore()
            engine._write_counters(counters)
            for mod, saved in bindings:
                mod._buffers.update(saved)
            st.phase = Phase.EAGER
            raise
        after = RngState.capture()
        writes = snapshot.written()
        rebound = [
            f"{type(mod).__name__}.{n}" for mod, saved in bindings for n, b in saved.items() if mod._buffers.get(n) is not b
        ]
        for mod, saved in bindings:
            mod._buffers.update(saved)
        snapshot.restore()
        rng.restore()
        engine._write_counters(counters)
    if stream is not None:
        torch.cuda.current_stream(device).wait_stream(stream)
    host_rng = rng.host_readers(after)
    copied = [names[i] for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and i not in st.aliased]
    base: dict[str, Any] = dict(
        shape_class=st.shape_class.name,
        signature=sig,
        host_rng=host_rng,
        thread=threading.current_thread().name,
        device_rng_advance=rng.device_advance(after),
        writes=writes,
        aliased=tuple(names[i] for i in st.aliased),
        copied=tuple(copied),
        host_constants=tuple(probe.constants.values()),
        cuts=tuple(CutRecord(n, r, c) for n, (r, c) in probe.cuts.items()),
        checks=tuple(checks),
    )
    refusal: Miss | None = None
    if rejected is not None:
        refusal = Miss(rejected.reason, (rejected.detail,))
    elif host_rng:
        refusal = Miss(
            MissReason.HOST_RNG, (f"reads the host RNG ({', '.join(host_rng)}); a graph would freeze the drawn values",)
        )
    elif rebound:
        refusal = Miss(MissReason.STATE_REBIND, (f"rebinds buffers {rebound}; a graph cannot",))
    elif torch.is_grad_enabled() and (
        any(k[0] == _T and k[5] for k in sig.leaves) or any(p.requires_grad for m in engine.modules for p in m.parameters())
    ):
        refusal = Miss(
            MissReason.AUTOGRAD,
            (
                f"grad mode with tensors that require grad on thread {threading.current_thread().name!r}: "
                "graphs replay no autograd history (grad mode is per thread: call it under torch.no_grad() "
                "there, or build the engine with inference=True)",
            ),
        )
    elif shared := _shares_module_state(names, leaves, st.aliased, buffers):
        refusal = Miss(
            MissReason.LAYOUT,
            (f"{shared} share memory with module state the callable writes; a staged copy would go stale: declare them aliased",),
        )
    elif sparse := [
        f"{names[i]} {tuple(x.shape)} strides {x.stride()}"
        for i, x in enumerate(leaves)
        if isinstance(x, torch.Tensor) and i not in st.aliased and not is_dense(x)
    ]:
        refusal = Miss(
            MissReason.LAYOUT,
            tuple(
                f"{arg} is not dense (its strides leave gaps or repeat elements): the engine stages only dense "
                "tensors; declare it aliased or pass a dense tensor"
                for arg in sparse
            ),
        )
    if refusal is not None:
        return refuse(engine, st, refusal, base, args, kwargs)
    st.aliased_ptrs = [(i, leaves[i].data_ptr()) for i in st.aliased]
    if device is None:
        st.phase = Phase.EAGER
        st.capturable = False
        st.certificate = Certificate(admitted=True, reason="admitted; no CUDA device: runs eager", **base)
        return engine._eager(Miss(MissReason.NO_CUDA), args, kwargs)
    return capture(engine, st, sig, leaves, spec, args, kwargs, device, stream, snapshot, rng, base, writes)


def refuse(
    engine: ExactShapeReplay, st: ClassState, refusal: Miss, base: dict[str, Any], args: tuple, kwargs: dict[str, Any]
) -> Any:
    """A class refused for good: certified as such, logged once (with the thread it was met on:
    a refusal in a worker thread must not pass unseen), and this call runs eagerly."""
    st.phase = Phase.EAGER
    st.refused = refusal
    st.certificate = Certificate(admitted=False, reason=str(refusal), **base)
    log.warning("%s: class %s refused on thread %r: %s", engine.name, st.shape_class.name, base["thread"], refusal)
    return engine._eager(refusal, args, kwargs)


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every engine's probes, warm-ups and captures: each new
    stream costs its own cuBLAS workspace (32 MiB on an H200), held for the process's life."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def capture(engine: ExactShapeReplay, st, sig, leaves, spec, args, kwargs, device, stream, snapshot, rng, base, writes) -> Any:
    names = st.names
    counters = engine._read_counters()
    with torch.cuda.stream(stream):
        for _ in range(engine.warmup - 1):
            with hooked(
                engine,
                CaptureContext(
                    "warmup", device, host_data=[x for x in leaves if isinstance(x, torch.Tensor) and x.device.type == "cpu"]
                ),
            ):
                engine.fn(*args, **kwargs)
            snapshot.restore()
            rng.restore()
            engine._write_counters(counters)
    torch.cuda.current_stream(device).wait_stream(stream)

    reserved_before = torch.cuda.memory_reserved(device)
    static: list[Any] = list(leaves)
    copy_in: list[tuple[int, torch.Tensor]] = []
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and i not in st.aliased:
            buf = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
            with torch.no_grad():
                buf.copy_(x)
            static[i] = buf
            copy_in.append((i, buf))
    cap_args, cap_kwargs = _unflatten(static, spec)
    for hook in engine.hooks:
        prepare = getattr(hook, "before_capture", None)
        if prepare is not None:
            prepare()
    host_roots = [b for _, b in copy_in if b.device.type == "cpu"]
    if engine._pool is None or not (engine._shared_pool or any(other.steps for other in engine.dispatcher.classes.values())):
        # A pool of this engine's own whose graphs are all gone cannot be reused: start a new one.
        engine._pool = torch.cuda.graph_pool_handle()
    staged_bytes = sum(b.numel() * b.element_size() for _, b in copy_in if b.device.type == "cuda")
    recorder = _Recorder(engine._pool)
    ctx = CaptureContext("capture", device, recorder, host_data=host_roots)
    torch.cuda.synchronize(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    pool_before = torch.cuda.memory_reserved(device)
    failure: BaseException | None = None
    # No collection may run inside a capture (a finaliser's CUDA call would break it), so the
    # collector is off while capturing, rather than a full gc.collect() before every capture:
    # with many graphs alive, that cost about 0.5 s a class.
    collecting = gc.isenabled()
    gc.disable()
    with torch.cuda.device(device), torch.cuda.stream(stream):
        recorder.begin()
        try:
            with hooked(engine, ctx):
                out = engine.fn(*cap_args, **cap_kwargs)
            recorder.end()
        except BaseException as e:  # noqa: BLE001 - any failure to capture means eager
            recorder.abort()
            failure = e
        finally:
            if collecting:
                gc.enable()
    torch.cuda.current_stream(device).wait_stream(stream)
    if failure is not None:
        torch.cuda.synchronize(device)
        snapshot.restore()
        rng.restore()
        engine._write_counters(counters)
        if isinstance(failure, _Rejected):
            refusal = Miss(failure.reason, (failure.detail,))
        else:
            first = str(failure).strip().splitlines()[0] if str(failure).strip() else ""
            refusal = Miss(MissReason.UNCAPTURABLE, (f"{type(failure).__name__}: {first}",))
        return refuse(engine, st, refusal, base, args, kwargs)

    # The last segment is captured but not yet run; earlier ones ran at their cuts.
    recorder.steps[-1].run()
    torch.cuda.synchronize(device)
    reserved_after = torch.cuda.memory_reserved(device)
    st.host_advance = tuple(after - before for before, after in zip(counters, engine._read_counters(), strict=True))
    written = set(writes)
    st.steps = recorder.steps
    st.guarded = recorder.has_guards
    st.copy_in = copy_in
    st.write_back = [(i, buf) for i, buf in copy_in if names[i] in written]
    persistent = {leaves[i].untyped_storage().data_ptr() for i in st.aliased}
    if not engine.state_check.remembered:
        engine.state_check.remember()
    persistent |= {t.untyped_storage().data_ptr() for t in engine.module_state}
    out_leaves, st.out_spec = pytree.tree_flatten(out)
    st.out_leaves = out_leaves
    st.out_clone = [isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in persistent for o in out_leaves]
    base.update(
        host_constants=tuple(ctx.constants.values()) or base["host_constants"],
        cuts=tuple(CutRecord(n, r, c) for n, (r, c) in ctx.cuts.items()) or base["cuts"],
    )
    segments = sum(isinstance(s, _GraphStep) for s in st.steps)
    reason = "admitted; captured" + ("; device RNG via graph-safe philox state" if any(base["device_rng_advance"]) else "")
    st.certificate = Certificate(
        admitted=True,
        reason=reason,
        captured=True,
        segments=segments,
        written_back=tuple(names[i] for i, _ in st.write_back),
        staged_bytes=staged_bytes,
        pool_reserved_bytes=reserved_after - pool_before,
        reserved_bytes=reserved_after - reserved_before,
        **base,
    )
    st.phase = Phase.REPLAY
    engine.counters.captures += 1
    engine.counters.replays += 1
    for i, buf in st.write_back:
        with torch.inference_mode(leaves[i].is_inference()):
            leaves[i].copy_(buf)
    return outputs(engine, st)


def replay(engine: ExactShapeReplay, st: ClassState, leaves: list[Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    with torch.no_grad():
        for i, buf in st.copy_in:
            buf.copy_(leaves[i])
        if st.guarded:
            before = torch.cuda.get_rng_state()
        try:
            for step in st.steps:
                step.run()
        except _GuardFailure as g:
            if st.certificate is not None and st.certificate.writes:
                raise ReplayError(
                    f"{engine.name}: class {st.shape_class.name}: cut guard failed after in-place writes: {g}"
                ) from None
            torch.cuda.set_rng_state(before)
            return engine._eager(Miss(MissReason.CUT_GUARD, (str(g),)), args, kwargs)
    for i, buf in st.write_back:
        with torch.inference_mode(leaves[i].is_inference()):
            leaves[i].copy_(buf)
    if st.host_advance:
        engine._write_counters([value + step for value, step in zip(engine._read_counters(), st.host_advance, strict=True)])
    engine.counters.replays += 1
    return outputs(engine, st)


def outputs(engine: ExactShapeReplay, st: ClassState) -> Any:
    if engine.output_rule == "static":
        return pytree.tree_unflatten(st.out_leaves, st.out_spec)
    outs = [o.clone() if c else o for o, c in zip(st.out_leaves, st.out_clone)]
    return pytree.tree_unflatten(outs, st.out_spec)
