"""The state rule at run time: each bound site's carry, allocated at its region's derived bound;
a call's state read, adopted into the carries and committed back; another stream's state moved
out of the carries before this stream's call."""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..binding import (
    SELF,
    BindingError,
    Place,
    Places,
    Site,
    get_path,
    place,
    resolve,
    sites,
)
from ..contract import DTYPES, carry_axis
from ..passes.hoist import HostConstantHoist
from ..passes.window import CarryCounters, WindowCarry
from ..replay import ExactShapeReplay
from ..report import format_bytes

if TYPE_CHECKING:
    from .operator import BoundOperator


def holds_region(values: list[Any], shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> bool:
    """The model's tensors at a region's sites already are its carries: each distinct, dense, of the
    site's derived shape and the region's dtype, on the model's device."""
    return all(
        isinstance(v, torch.Tensor)
        and tuple(v.shape) == tuple(shape)
        and v.dtype == dtype
        and v.device == device
        and v.is_contiguous()
        for v in values
    ) and len({v.data_ptr() for v in values}) == len(values)


def weak_reference(value: Any) -> Callable[[], Any]:
    """A weak reference to a stream's state object where it takes one (a stream that is over lets
    it go), else a strong one (a list or tuple of tensors)."""
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda: value


def switch_stream(op: BoundOperator, roots: dict[str, Any]) -> None:
    """Another stream's state objects than the last call's: the last stream's state that is the
    carries' (its objects hold their views) is copied out to it first, so the carries can take
    this stream's without overwriting the other's (two caches interleaved on one model, no
    session states swapped). State a call returns (`out`) is the caller's to keep apart."""
    owner = tuple((name, id(value)) for name, value in roots.items() if name != SELF)
    last = op._owner
    if last is not None and last[0] == owner and all(last[1][name]() is value for name, value in roots.items() if name != SELF):
        return  # the same objects as the last call's (every steady call; an id reused is not)
    op._owner = (owner, {name: weak_reference(value) for name, value in roots.items() if name != SELF})
    if last is None or not op.carries:
        return
    previous = {name: ref() for name, ref in last[1].items()}
    if any(value is None for value in previous.values()):
        return  # the other stream's state is gone (or was None): nothing to keep for it
    for site in op.sites:
        if site.out is not None or site.path.split(".")[0] == SELF:
            continue
        try:
            where = place(previous, site.path)
            value = where.get()
        except (AttributeError, KeyError, IndexError, TypeError):
            continue  # the other stream's object no longer has the site: nothing of ours in it
        held = op.held.get(site.path) if site.region is None else None
        if isinstance(value, torch.Tensor) and (
            (held is not None and value is held) or (site.region is not None and op.carries[site.path].holds(value))
        ):
            where.set(value.clone())
            op.counters.evicted += 1


def allocate(op: BoundOperator, roots: dict[str, Any]) -> None:
    """The state rule: each bound region's buffer at its derived bound, one carry per site."""
    device = op._device()
    for rb in op.regions:
        region, derived = op.contract.region(rb.region), op.catalog.region(rb.region)
        shape, _ = derived.demand()
        found = sites(rb, roots)
        lead = len(found[0].index) if found else 0
        leading = shape[:lead]
        if not found or [s.index for s in found] != list(itertools.product(*map(range, leading))):
            raise ValueError(
                f"region {rb.region!r}: the binding's paths {rb.at} reach {len(found)} tensors "
                f"({[s.path for s in found][:4]}...), the contract's leading dims "
                f"{leading} ask for {math.prod(leading)}"
            )
        axis = carry_axis(region)
        if axis < lead:
            raise ValueError(
                f"region {rb.region!r}: its retention axis {axis} is one of the {lead} "
                "leading dims the binding's paths index; bind the tensors that hold the axis"
            )
        allocated = rb.region in op.report.carries or any(key[0] == rb.region for key in op.shared)
        values = [get_path(roots, site.path) for site in found]
        # A region written before it is read that the model already holds at its derived shape
        # stays where it is: a new buffer and a copy would cost its size again (a batch's rings).
        by_reference = not allocated and rb.write_before_read and holds_region(values, shape[lead:], DTYPES[region.dtype], device)
        if not allocated and not by_reference:
            # Never an inference tensor (a first call under a vendor's `torch.inference_mode()`):
            # the carry is written in place outside it too (a turn reset, a swap).
            with torch.inference_mode(False):
                buffer = torch.zeros(shape, dtype=DTYPES[region.dtype], device=device)
            op.report.carries[rb.region] = WindowCarry(rb.region, rb.region, buffer, axis)
        for site, value in zip(found, values):
            key = (rb.region, site.index)
            if key not in op.shared:
                home = value if by_reference else op.report.carries[rb.region].buffer[site.index]
                # Named by its path; by its region too where the binding names the region's operators
                # (two methods' arguments of one name, such as two vendor modules' `att_cache`).
                name = f"{rb.region}:{site.path}" if rb.operators else site.path
                op.shared[key] = WindowCarry(name, rb.region, home, axis - lead, auditor=op.report.auditor)
            carry = op.carries[site.path] = op.shared[key]
            op._holder.add_module(f"carry{len(op.sites)}", carry)
            if rb.caller_trims:
                retention = region.retention
                assert retention is not None  # the binding refuses `caller_trims` without a policy that allows it
                head = retention.head
                op.trims[len(op.sites)] = (carry.axis, derived.kept(), head)
            op.sites.append(site)
        op.region_tensors[rb.region] = (
            [op.report.carries[rb.region].buffer]
            if rb.region in op.report.carries
            else [op.shared[(rb.region, site.index)].buffer for site in found]
        )
        if not allocated:
            where = (
                f"kept where the model holds it ({len(found)} tensor{'s' if len(found) > 1 else ''}), none allocated"
                if by_reference
                else f"{len(found)} sites at one address each"
            )
            op.report.stamps.append(
                f"state rule: {rb.region} at {'x'.join(map(str, shape))} ({format_bytes(derived.bytes)}), {where}"
                + (
                    "; written before read (the binding says so): never copied, verified through the outputs it feeds"
                    if rb.write_before_read
                    else ""
                )
            )
    for path in counter_paths(op, roots):
        value = get_path(roots, path)
        if isinstance(value, torch.Tensor):  # a device-side counter: state of its own, at one address
            with torch.inference_mode(False):
                op.held[path] = value.detach().clone()
            op.sites.append(Site(None, path, ()))
    if op._replay_wanted and op.report.auditor is None:  # without CUDA the engine runs eager and says so
        op.replay = ExactShapeReplay(
            op._run,
            op._admit,
            name=op.ob.operator,
            aliased=[1],
            modules=[op.model, op._holder] if isinstance(op.model, torch.nn.Module) else [op._holder],
            host_counters=CarryCounters(list(op.carries.values())),
            hooks=(HostConstantHoist(),),
            write_before_read=[t for rb in op.regions if rb.write_before_read for t in op.region_tensors[rb.region]],
        )
        op.report.replays[op.ob.operator] = op.replay


def site_places(op: BoundOperator) -> Places:
    """Where the sites are, as `Places` (built again whenever sites were found since)."""
    if len(op._places.paths) != len(op.sites):
        op._places = Places([site.path for site in op.sites])
    return op._places


def site_shape_error(op: BoundOperator, site: Site, value: torch.Tensor) -> str | None:
    carry = op.carries[site.path]
    expected = list(carry.buffer.shape)
    actual = list(value.shape)
    if (
        value.dtype != carry.buffer.dtype
        or len(actual) != len(expected)
        or any(a != e for i, (a, e) in enumerate(zip(actual, expected)) if i != carry.axis)
    ):
        return (
            f"{site.path} holds {value.dtype} {tuple(actual)}, the contract declares {carry.buffer.dtype} "
            f"{tuple(expected[: carry.axis])} x extent x {tuple(expected[carry.axis + 1 :])}"
        )
    return None


def region_extent(op: BoundOperator, values: list[Any]) -> int | None:
    """The operator region's retained extent (0 before any state), from the sites' `values`;
    None when its sites disagree."""
    if op.per_call:
        return op.catalog.region(op.op.region).bound
    extents = set()
    for value, site in zip(values, op.sites):
        if site.region != op.op.region:
            continue
        if value is None:
            extents.add(0)
            continue
        carry = op.carries[site.path]
        if carry.holds(value):  # the carry's own view (every steady call): its shape is the contract's
            extents.add(carry.extent)
            continue
        error = site_shape_error(op, site, value)
        if error is not None:
            raise ValueError(f"{op.ob.operator}: {error}")
        extents.add(value.shape[op.carries[site.path].axis])
    return extents.pop() if len(extents) == 1 else None


def carry_view(op: BoundOperator, place: Place, site: Site, value: Any) -> torch.Tensor | None:
    """The site's state `value` (what `place` holds: the caller has just read or written it
    there) as its carry's view: adopted into the carry when it is another tensor."""
    if value is None:
        return None
    if site.region is None:
        view = op.held[site.path]
        if value is not view:
            if value.shape != view.shape or value.dtype != view.dtype:
                raise ValueError(
                    f"{op.ob.operator}: counter {site.path} holds {value.dtype} {tuple(value.shape)}, "
                    f"it held {view.dtype} {tuple(view.shape)} at the first call"
                )
            if value.device != view.device:  # moved by the model (a cache placed lazily at its first call)
                view = op.held[site.path] = value.detach().clone()
            view.copy_(value)
            place.set(view)
            op.counters.adopted += 1
        return view
    carry = op.carries[site.path]
    if carry.holds(value):  # the carry's view already (every steady call)
        return value
    if value.shape[carry.axis] > carry.capacity:
        # The stock code retained more than the contract's bound (a model that does not trim as
        # declared): no class of the catalog has this extent, so the state stays the stock's own.
        return value
    if value.untyped_storage().data_ptr() == carry.buffer.untyped_storage().data_ptr() and not carry._aliases(value):
        # The stock code kept a view of the carry at another offset (a stock fallback cuts its
        # input): copied out first, as the carry's own writes may overlap it.
        value = value.clone()
    view = carry.adopt(value)
    if site.out is None:  # a returned state is the caller's to thread: their object stays as it is
        place.set(view)
    op.counters.adopted += 1
    return view


def commit_state(op: BoundOperator, places: list[Place], new_state: list, current: list | None = None) -> None:
    """Mutated state objects get the carry views back; returned state is in the output already.
    A ring the step returns anew (Whisper's cross-attention keys, computed by a stream's first
    call) is taken into its carry now, so the state object holds the carry from this call on.
    `current`: what the places held when the graph ran (the state passed to it); a site whose
    new state is that very tensor has nothing to commit: a ring written in place, a counter kept
    in its held tensor, and on a replay every site of a steady class (the graph's outputs come
    back as the same objects every call)."""
    for i, (where, site, value) in enumerate(zip(places, op.sites, new_state)):
        if current is not None and value is current[i]:
            continue
        if site.out is None:
            held = op.held.get(site.path) if site.region is None else None
            if held is not None and value is not None and value is not held:
                # A device-side counter the step rebinds (`state.first = torch.where(...)`):
                # its new value written into the one tensor it is kept at.
                held.copy_(value)
                value = held
            where.set(value)
            if site.region is not None and value is not None and not op.carries[site.path].holds(value):
                carry_view(op, where, site, value)


def counter_paths(op: BoundOperator, roots: dict[str, Any]) -> list[str]:
    found = []
    for j, path in enumerate(op.ob.counters):
        try:
            found += [concrete for _, concrete, _ in resolve(roots[path.split(".")[0]], path)]
        except (AttributeError, KeyError, IndexError, TypeError) as error:
            field = f"operators[{op.binding.operators.index(op.ob)}].counters[{j}]"
            raise BindingError(field, f"{path!r} does not resolve on this call's arguments: {error}") from None
    return found


def host_counter_paths(op: BoundOperator, roots: dict[str, Any]) -> list[str]:
    """The counters that are host values (ints, flags): a graph cannot move them, the pipeline does."""
    return [path for path in counter_paths(op, roots) if path not in op.held]


def clone_site(op: BoundOperator, site: Site, value: Any) -> Any:
    """A copy of a site's state for a stock or traced call; a region written before it is read is
    never copied (every call writes what it reads first)."""
    return value if value is None or uncopied(op, site) else value.clone()


def uncopied(op: BoundOperator, site: Site) -> bool:
    """A site of a region the binding says is written before it is read: never copied."""
    return site.region is not None and op.binding.region(site.region).write_before_read
