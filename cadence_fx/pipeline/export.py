"""Stage 2, capture: the step exported with `torch.export` (non-strict) on a private copy of the
state objects, refused by path where it would freeze undeclared state; exports kept by a key of
the model's structure and the class's guards, for another model of the same structure."""

from __future__ import annotations

import collections
import contextlib
import copy
import itertools
import time
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..binding import (
    SELF,
    Site,
    get_path,
    method_of,
)
from ..catalog import CatalogClass
from ..guards import HOST_SCALARS
from ..passes.carry import shared_memo
from ..replay import Signature
from ..tracing import without_stack_traces
from .guard import all_regimes, unread_paths
from .records import OperatorClass, class_name
from .rewrite import rewrite_class
from .step import OpaqueOutput, Step, input_shapes, private_roots, writes_in_place

if TYPE_CHECKING:
    from .operator import BoundOperator


#: Exported steps by `export_key`, their model's weights and buffers stripped (meta
#: tensors). Another model of the same structure calling the same method at the same class (a
#: serving lane's copy of a flow, or a second flow with weights of its own) takes a copy rebound to
#: its own weights and buffers by name instead of tracing again (a full-size Token2Wav CFM loop
#: takes minutes to export). That is sound because torch.export traces the weights and buffers as
#: fake tensors: a graph cannot depend on their values (a step that reads one on the host fails
#: its export). Only an export whose every tensor is the model's own weight or buffer is kept (a
#: constant's value is in the graph); verification still runs the stock call beside the graph in
#: every transform.
EXPORTS: collections.OrderedDict[tuple, torch.fx.GraphModule] = collections.OrderedDict()


#: How many exports the process keeps, the least recently used dropped first. Each is kept with its tensors
#: on meta, so it costs its graph only; 256 keeps a Token2Wav flow's exports while many other models export.
EXPORTS_KEPT = 256


#: Module attributes the export key leaves out: the weights, buffers and submodules (keyed by name,
#: shape, dtype and device), and which buffers are saved with the model (not a program's business).
STRUCTURE_KEPT_APART = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})


MODEL_PREFIX = "model."  # where `Step` registers the model: its tensors' names in an export


def setting_key(value: Any) -> Any:
    """A module attribute as the export key holds it: its repr; for an operator this pipeline bound
    on the model, its name; for a NumPy array (whose repr elides the middle of a long one), its
    dtype, shape and bytes."""
    from .operator import BoundOperator  # the driver imports this stage

    if isinstance(value, BoundOperator):
        return f"bound operator {value.ob.operator}"
    if isinstance(value, np.ndarray):
        return (str(value.dtype), value.shape, value.tobytes())
    return repr(value)


def rebound_export(gm: torch.fx.GraphModule, tensor_for) -> torch.fx.GraphModule | None:
    """A copy of `gm` (sharing its nodes' metadata and specs) whose model tensors are
    `tensor_for(name, tensor)`; None when `gm` holds a tensor that is not the model's (a constant)."""
    memo = shared_memo(gm)
    named = dict(itertools.chain(gm.named_parameters(remove_duplicate=False), gm.named_buffers(remove_duplicate=False)))
    owned = {id(t) for t in named.values()}
    if any(isinstance(v, torch.Tensor) and id(v) not in owned for m in gm.modules() for v in vars(m).values()):
        return None
    for name, tensor in named.items():
        if not name.startswith(MODEL_PREFIX):
            return None
        memo[id(tensor)] = tensor_for(name[len(MODEL_PREFIX) :], tensor)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
        return copy.deepcopy(gm, memo)


def meta_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    return torch.nn.Parameter(meta, requires_grad=False) if isinstance(tensor, torch.nn.Parameter) else meta


def keep_export(key: tuple | None, gm: torch.fx.GraphModule) -> None:
    if key is None:
        return
    stripped = rebound_export(gm, meta_tensor)
    if stripped is not None:
        EXPORTS[key] = stripped
        while len(EXPORTS) > EXPORTS_KEPT:
            EXPORTS.popitem(last=False)


def reused_export(key: tuple | None, model: torch.nn.Module) -> torch.fx.GraphModule | None:
    if key is None:
        return None
    kept = EXPORTS.get(key)
    if kept is None:
        return None
    EXPORTS.move_to_end(key)
    found = dict(itertools.chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)))
    return rebound_export(kept, lambda name, _: found[name])


def undeclared_state(program, roots: dict[str, Any], sites: list[Site]) -> list[str]:
    """Paths of the tensors in the state objects (not the bound sites) that the step writes in place
    but the export lifted as constants: a graph would start every call from their value at capture."""
    written = set()
    for spec in program.graph_signature.input_specs:
        if spec.kind.name != "CONSTANT_TENSOR":
            continue
        node = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == spec.arg.name)
        if any(writes_in_place(user) and user.args[0] is node for user in node.users):
            written.add(spec.target)
    lifted = {id(program.constants[target]) for target in written}
    if not lifted:
        return []
    bound = {s.path for s in sites}
    found, seen = [], set()

    def walk(value, path, depth):
        if id(value) in seen or depth > 8:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if id(value) in lifted and path not in bound:
                found.append(path)
            return
        if isinstance(value, torch.nn.Module):
            children = {k: v for k, v in vars(value).items() if not k.startswith("_")} | dict(value._modules)
        elif isinstance(value, dict):
            children = value
        elif isinstance(value, (list, tuple)):
            children = dict(enumerate(value))
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            children = vars(value)
        else:
            return
        for key, child in children.items():
            walk(child, f"{path}.{key}", depth + 1)

    for name, root in roots.items():
        walk(root, name, 0)
    return found


def capture_class(
    op: BoundOperator,
    roots,
    inputs,
    state,
    call: CatalogClass,
    modes: dict[str, Any],
    hosts: dict[str, Any],
    counted: tuple,
    guards: tuple,
    variant: int,
) -> OperatorClass:
    # Unique per program: a class by its regimes' components, a second program of one class
    # (other host values) by its number.
    name = (
        class_name(op.ob.operator, call.call, call.extent, call.flush, modes)
        + "".join(f"<{path}~{component!r}>" for path, component in counted)
        + (f"#{variant + 1}" if variant else "")
    )
    regimes = all_regimes(op)
    spanning = tuple(p for p, r in regimes.items() if p in hosts and r.spans(r.component(hosts[p])))
    everything = {SELF: op.model, **roots}
    spanning += tuple(sorted(p for p in unread_paths(op) if isinstance(get_path(everything, p), HOST_SCALARS)))
    cls = OperatorClass(
        name, call, verify_left=op.binding.verify, hosts=dict(hosts), spanning=spanning, inputs=input_shapes(inputs)
    )
    op._by_name[name] = cls
    started = time.perf_counter()
    example = list(state)  # the export traces fake copies of them: the carries are not written
    key = export_key(op, inputs, example, modes, (counted, guards))
    gm = reused_export(key, op.model)
    if gm is not None:
        op.report.stamps.append(f"{name}: the export of a model of the same structure reused, rebound to this model's tensors")
        return rewrite_class(op, cls, gm, inputs, example, modes, call, name, started)
    at_sites = [get_path(roots, s.path) for s in op.sites]  # the carries, or a returned state's own tensors
    private = private_roots(roots, [v for v in (*state, *at_sites) if isinstance(v, torch.Tensor)])
    method = method_of(private[SELF], op.ob.method) if SELF in private else op.method
    step = Step(op.model, method, private, op.sites, op.trims)
    try:
        with torch.no_grad(), without_stack_traces(), warnings.catch_warnings(), attributes_kept(op.model):
            # The step writes the sites into its private copy of the state: expected, not a bug.
            warnings.filterwarnings("ignore", "The tensor attributes? .* (was|were) assigned during export", UserWarning)
            program = torch.export.export(step, (inputs, example), strict=False)
    except OpaqueOutput as error:
        cls.refused = str(error)
        op.report.stamps.append(f"{name}: refused, {cls.refused}")
        return cls
    except Exception as error:  # the model does not export at this class: it runs stock, and says why
        cls.refused = f"torch.export failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        op.report.stamps.append(f"{name}: refused, {cls.refused}")
        return cls
    frozen = undeclared_state(program, private, op.sites)
    if frozen:
        cls.refused = (
            f"the step reads {', '.join(frozen)}: state the binding does not declare, which a graph "
            "would freeze as a constant; bind it (a region's `at`, or the operator's `counters` for a "
            "position or length the step moves)"
        )
        op.report.stamps.append(f"{name}: refused, {cls.refused}")
        return cls
    gm = program.module()
    keep_export(key, gm)
    return rewrite_class(op, cls, gm, inputs, example, modes, call, name, started)


@contextlib.contextmanager
def attributes_kept(model: Any):
    """Every module attribute of `model` the very object it was before the block. torch.export
    (non-strict) puts back equal copies of some it traced through (transformers' parallel plans):
    the model's settings would then differ by identity from a model whose export was reused, and
    the guards walk them by identity (a list two modules share is read once)."""
    if not isinstance(model, torch.nn.Module):
        yield
        return
    kept = [(vars(module), dict(vars(module))) for module in model.modules()]
    try:
        yield
    finally:
        for table, before in kept:
            table.update((key, value) for key, value in before.items() if table.get(key) is not value)


def export_key(op: BoundOperator, inputs, example, modes, guards: tuple) -> tuple | None:
    """What an export of this operator's step depends on: the model's structure (its class, every
    weight's and buffer's name, shape, dtype and device, every module's other attributes), the
    method, the sites and their trims, and the class's signature (shapes, layouts, host values,
    grad and autocast modes). None for a model that is no module (its weights would be constants)."""
    if not isinstance(op.model, torch.nn.Module):
        return None
    tensors = tuple(
        (name, tuple(t.shape), t.dtype, t.device)
        for name, t in itertools.chain(
            op.model.named_parameters(remove_duplicate=False), op.model.named_buffers(remove_duplicate=False)
        )
    )
    # Every other attribute of every module by type and repr (0.0 and -0.0, True and 1 are not the
    # same program), read now: a setting may have changed since the last class (a mode the binding
    # declares). An object whose repr is its address differs from any other: no reuse.
    settings = tuple(
        (
            name,
            tuple(
                sorted(
                    (k, type(v).__name__, setting_key(v))
                    for k, v in vars(module).items()
                    if k not in STRUCTURE_KEPT_APART and not isinstance(v, (torch.Tensor, torch.nn.Module))
                )
            ),
        )
        for name, module in op.model.named_modules()
    )
    try:
        signature = Signature.of(inputs, example, modes).catalog_key
    except TypeError:
        return None
    mode_key = tuple((path, type(value).__name__, repr(value)) for path, value in modes.items())
    # The guards: the host values frozen into the export (a cache's length), by regime.
    return (
        (type(op.model), tensors, settings),
        op.ob.method,
        tuple(op.sites),
        tuple(sorted(op.trims.items())),
        signature,
        mode_key,
        guards,
    )
