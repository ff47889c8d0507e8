"""Compute rule: exact-shape CUDA-graph replay with fail-closed admission.

`ExactShapeReplay` wraps a hot callable (an nn.Module, a GraphModule, a function) together with
its catalog: the finite set of `Signature`s the contract says it will be called with. One CUDA
graph is captured per catalog class, at exact shapes (never padded), all classes of one binding
sharing one graph memory pool. Every call is admitted or refused, and a refused call runs the
stock callable eagerly and is counted under its reason:

1. signature: shapes, strides, dtypes, devices, requires_grad, memory formats, the structure of
   the arguments and every non-tensor argument must match a catalog class exactly; an argument
   the engine cannot key on (an arbitrary object, a tensor subclass, a sparse tensor) means eager;
2. address stability: arguments declared `aliased` (contract-owned regions such as the carry) are
   read and written by the graph in place, with no staging copy, so their `data_ptr` is checked on
   every call; drift drops the class's graph, records an invalidation and runs that call eagerly;
   the next call recaptures at the new address. Module parameters and buffers are checked the
   same way. Every other tensor argument is copied into a static buffer per call;
3. effects, certified once per class before capture: a probationary eager call watches the host
   RNGs and the CUDA generators and is then rewound (RNG state and every tensor it wrote), so it
   is invisible. Host-RNG readers are rejected for good (a graph would freeze the drawn values).
   Device-RNG readers are admitted: PyTorch registers the default CUDA generator with each graph
   and feeds each replay the generator's current seed and Philox offset, advancing it by the
   graph's whole increment, so a replay draws exactly what eager would have drawn from the same
   state, and the first call after capture is itself a replay.

Life of one class, in three visible phases: `eager` (not yet certified, refused, or invalidated),
`capture` (probe, warm-up on a side stream, capture; the capturing call's output already comes
from replaying the fresh graph) and `replay`.

Output rule. `output_rule="clone"` (the default) hands back clones of the graph's static outputs,
so no caller ever holds memory that a later replay overwrites. `output_rule="static"` hands back
the graph's own output tensors, valid until the next call of the same class, which overwrites them
in place (zero copies; for callers that consume an output before the next call). In both rules an
output that is a view of an aliased argument or of module state is returned as that view, as eager
would. A copied argument that the callable writes in place is written back after each replay.

Policy that decides how capture treats individual operators is injected as `CaptureHook`s (host
constants: `cadence_fx.passes.hoist`; cuts around operators that cannot be captured:
`cadence_fx.passes.piecewise`). A cut ends the current graph segment; at replay the segments are
replayed in order with the cut operator run eagerly between them on their static buffers.

Without CUDA (or for a class whose tensors are not on a CUDA device) admission, certification and
counters work the same, and every admitted call runs eagerly, counted as `no_cuda`: nothing
pretends to replay.

Threads. Each engine serves one thread at a time (its static buffers and graphs belong to one
stream; a second thread entering raises `ReplayError`); different engines may run in different
threads at once, each on its own CUDA stream, sharing a graph pool only with engines of the same
stream (`pool=`). Captures are serialized process-wide by the device gate (`gate`): a class's
probe, warm-up and capture hold it exclusive, every call holds it shared. Grad mode is per thread:
`inference=True` makes the engine run every call under `no_grad` itself, and a class refused in a
thread is certified and logged with that thread's name. Device-RNG readers share the process's one
generator: drive them from one thread at a time (`cadence_fx.lanes.RngSection`).

Memory. A captured class's certificate holds the bytes it stages per call (the memory model's
charge) beside the measured growth of reserved memory over its capture (the graph pool).

The package's modules: `signature` (what a call is keyed on, and why it misses), `certificate`
(what was checked per class), `counters`, `capture` (the hook seam and the graph segments),
`gate` (which threads may touch the device during a capture) and `engine` (`ExactShapeReplay`).
"""

from .capture import NOT_HANDLED, CaptureContext, CaptureHook, current_capture
from .certificate import Certificate, CutRecord, HoistedConstant
from .counters import ReplayCounters
from .engine import ExactShapeReplay, HostCounters, Phase, ReplayError
from .signature import Miss, MissReason, ShapeClass, Signature, TensorSpec

__all__ = [
    "MissReason",
    "Phase",
    "TensorSpec",
    "Signature",
    "ShapeClass",
    "Miss",
    "HoistedConstant",
    "CutRecord",
    "Certificate",
    "ReplayCounters",
    "CaptureContext",
    "CaptureHook",
    "NOT_HANDLED",
    "ReplayError",
    "ExactShapeReplay",
    "current_capture",
    "HostCounters",
]
