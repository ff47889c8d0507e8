"""Host constants: configuration-only CPU tensors hoisted into device-resident buffers.

Stock streaming code builds small tables on the CPU on every call and copies them to the device:
the DiT's `TimestepEmbedder.timestep_embedding` frequency table (`.to(t)`), HiFT's `stft_window`
(`.to(x.device)`) and `SineGen`'s harmonic multipliers
(`torch.FloatTensor([[range(1, harmonic_num + 2)]]).to(f0.device)`). A pageable host-to-device
copy cannot be captured, so such a call has no graph until these copies are gone.

`HostConstantHoist` is a `CaptureHook`: while the engine probes and warms a class up, every copy
of a CPU tensor to a device (`Tensor.to`, `Tensor.cuda`, `dst.copy_(cpu)`, `torch.tensor(...,
device=...)`, and in an exported graph the `aten.to.*`, `aten._to_copy` and `aten.copy_` calls
they become) is run once exactly as the stock code runs it (CPU value, then the same copy call),
and the device result is kept. During capture the same call site with the same CPU bytes gets that
device buffer back, so the graph reads a resident constant and no bit changes. If the callable
writes a handed-out constant in place, each call gets a device-side clone of it instead (captured
as a device copy). Each hoisted constant is reported with its call site.

What is not a constant: a CPU tensor that is per-call host data, i.e. a CPU tensor argument (or
the CPU result of a cut), or anything computed from one. Copying such a root to the device
becomes a cut (the copy runs eagerly between segments from the refreshed static buffer); a copy
of a value derived from one refuses the class (`host_data`), since the graph would freeze it.
"""

from __future__ import annotations

import os
import sys
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from cadence_fx.replay import NOT_HANDLED, CaptureContext, HoistedConstant, MissReason

__all__ = ["HostConstantHoist"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_SKIP_FILES = {__file__, sys.modules["cadence_fx.replay.capture"].__file__}
_COPY_REASON = "host data: a per-call CPU tensor copied to the device"


def _site() -> str:
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith(_TORCH_DIR) or filename in _SKIP_FILES or "contextlib" in filename):
            break
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
    return f"{name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})"


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _device_of(value: Any) -> torch.device | None:
    if value is None:
        return None
    if isinstance(value, int):
        return torch.device("cuda", value)
    return torch.device(value)


_ATEN_TO = frozenset(getattr(torch.ops.aten.to, name) for name in torch.ops.aten.to.overloads()) | {
    torch.ops.aten._to_copy.default
}
_COPIES = (torch.Tensor.copy_, torch.ops.aten.copy_.default)


def _aten_target(func: torch._ops.OpOverload, args: tuple, kwargs: dict[str, Any]) -> tuple[torch.device | None, tuple]:
    """The device an `aten.to.*` / `aten._to_copy` call copies to, and every argument but the
    source (a tensor `other` by its device and dtype), by its schema's names."""
    bound = {**dict(zip((a.name for a in func._schema.arguments), args)), **kwargs}
    other = bound.pop("other", None)
    if isinstance(other, torch.Tensor):
        bound.update(device=other.device, dtype=other.dtype)
    bound.pop("self")
    return _device_of(bound.get("device")), tuple(sorted(bound.items()))


def _transfer(func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor, Any] | None:
    """(CPU source, hashable description of the target) if this call copies a CPU tensor off the
    host, else None."""
    if func in _ATEN_TO and isinstance(func, torch._ops.OpOverload) and args and isinstance(args[0], torch.Tensor):
        src = args[0]
        device, target = _aten_target(func, args, kwargs)
        if src.device.type == "cpu" and device is not None and device.type != "cpu":
            return src, (str(func), target)
    elif func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor):
        src = args[0]
        try:
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
        except (TypeError, RuntimeError):
            return None
        if src.device.type == "cpu" and device is not None and device.type != "cpu":
            return src, ("to", str(device), dtype, memory_format)
    elif func is torch.Tensor.cuda and args and isinstance(args[0], torch.Tensor):
        src = args[0]
        if src.device.type == "cpu":
            device = args[1] if len(args) > 1 else kwargs.get("device")
            return src, ("cuda", str(device))
    elif func in _COPIES and len(args) >= 2 and isinstance(args[1], torch.Tensor):
        dst, src = args[0], args[1]
        if src.device.type == "cpu" and dst.device.type != "cpu":
            return src, ("copy_", str(dst.device), dst.dtype)
    return None


def _host_factory(func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor, Any] | None:
    """`torch.tensor(data, device=dev)` builds `data` on the host and copies it: (host value, target)."""
    if func not in (torch.tensor, torch.as_tensor) or not args or isinstance(args[0], torch.Tensor):
        return None
    device = _device_of(kwargs.get("device"))
    if device is None or device.type == "cpu":
        return None
    host_kwargs = {k: v for k, v in kwargs.items() if k != "device"}
    return func(*args, **host_kwargs), (func.__name__, str(device), kwargs.get("dtype"))


def _was_written(handed: torch.Tensor, pristine: torch.Tensor) -> bool:
    if handed.is_inference():  # no version counter: compare values
        return not torch.equal(handed, pristine)
    return handed._version > 0


@dataclass
class _Entry:
    site: str
    device_value: torch.Tensor
    handed: list[torch.Tensor] = field(default_factory=list)
    written: bool = False

    def record(self) -> HoistedConstant:
        v = self.device_value
        return HoistedConstant(
            self.site, tuple(v.shape), v.dtype, str(v.device), v.numel() * v.element_size(), shared=not self.written
        )


class HostConstantHoist:
    """CaptureHook hoisting host constants into device buffers; `constants` reports them."""

    def __init__(self) -> None:
        self._entries: dict[tuple, _Entry] = {}
        self._derived: dict[int, Any] = {}

    @property
    def constants(self) -> tuple[HoistedConstant, ...]:
        return tuple(e.record() for e in self._entries.values())

    def intercept(self, ctx: CaptureContext, func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        transfer = _transfer(func, args, kwargs)
        if transfer is not None:
            src, target = transfer
            if ctx.is_host_data(src):
                return ctx.cut(f"host copy at {_site()}", _COPY_REASON, func, args, kwargs)
            if self._is_derived(src):
                ctx.reject(
                    MissReason.HOST_DATA,
                    f"{_site()}: copies to the device a CPU tensor computed from per-call host data; a graph would freeze it",
                )
            key = (_site(), target, src.dtype, tuple(src.shape), src.stride(), _bytes(src))
            return self._serve(ctx, key, func, args, kwargs)
        factory = _host_factory(func, args, kwargs)
        if factory is not None:
            host, target = factory
            key = (_site(), target, host.dtype, tuple(host.shape), host.stride(), _bytes(host))
            return self._serve(ctx, key, func, args, kwargs)
        if ctx.has_host_data or self._derived:
            return self._propagate(ctx, func, args, kwargs)
        return NOT_HANDLED

    def _serve(self, ctx: CaptureContext, key: tuple, func, args, kwargs) -> Any:
        entry = self._entries.get(key)
        if func in _COPIES:
            # dst.copy_(cpu): stage the CPU value as a device constant, then copy device to device.
            dst = args[0]
            if entry is None:
                if ctx.capturing:
                    ctx.reject(MissReason.UNCAPTURABLE, f"{key[0]}: host constant first seen during capture")
                entry = self._entries[key] = _Entry(key[0], args[1].to(dst.device))
            ctx.add_constant(entry.record())
            return func(dst, entry.device_value, *args[2:], **kwargs)
        if entry is None:
            if ctx.capturing:
                ctx.reject(MissReason.UNCAPTURABLE, f"{key[0]}: host constant first seen during capture")
            entry = self._entries[key] = _Entry(key[0], func(*args, **kwargs))
        ctx.add_constant(entry.record())
        if not ctx.capturing:
            # Hand out clones until capture, to learn whether the callable writes the constant.
            handed = entry.device_value.clone()
            entry.handed.append(handed)
            return handed
        return entry.device_value.clone() if entry.written else entry.device_value

    def before_capture(self) -> None:
        """Decide, outside the capture, which constants the callable wrote while warming up."""
        for entry in self._entries.values():
            entry.written = entry.written or any(_was_written(h, entry.device_value) for h in entry.handed)
            entry.handed.clear()

    def _is_derived(self, t: torch.Tensor) -> bool:
        ref = self._derived.get(id(t))
        return ref is not None and ref() is t

    def _propagate(self, ctx: CaptureContext, func, args, kwargs) -> Any:
        inputs = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if not any(ctx.is_host_data(x) or self._is_derived(x) for x in inputs):
            return NOT_HANDLED
        result = func(*args, **kwargs)
        if len(self._derived) > 4096:
            self._derived = {k: r for k, r in self._derived.items() if r() is not None}
        for out in pytree.tree_leaves(result):
            if isinstance(out, torch.Tensor) and out.device.type == "cpu":
                self._derived[id(out)] = weakref.ref(out)
        return result
