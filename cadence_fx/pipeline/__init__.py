"""The one pipeline behind `transform(model, contract, binding)`, for models cadence-fx has never seen.

For each bound operator, per class (a catalog class, its regimes' components and its modes), at
the class's first visit:

1. **check and guard**: the call's state sites (found by the binding's paths) have the contract's
   shapes, and the call (its new units against its retained extent) is a class of the catalog;
   every host value the program may depend on (`cadence_fx.guards`) keys the class, so other
   values are another program (a variant, at most `VARIANTS`); anything else runs the stock
   call, counted by reason (fail closed);
2. **capture**: the call as an explicit-state step ``step(inputs, sites) -> (outputs, sites)`` is
   exported with `torch.export` (non-strict) on a copy of the state objects, so the model's own
   state never holds a traced value;
3. **retention rewrite**: the window pass (`passes/window.py`) finds each site's concat-then-trim on
   the exported graph (a sliding window's tail, or a prompt-plus-history's head and tail) and
   rewrites it into in-place writes into the site's carry, a view of its
   region's buffer allocated once at the derived bound (the state rule). A region of one fixed
   extent (`RingCache`, `InPlace`: preallocated, written in place) needs no rewrite: the carry is
   the state. State the step writes in place that the binding does not declare is refused by path
   (a graph would freeze it as a constant);
4. **verify**: the first `binding.verify` visits of the class (and a second value of a counter a
   regime spans) also run the stock call (on clones of the state, the RNG rewound between runs):
   the exported step and the stock call must run the same ATen program (`cadence_fx.program`),
   then the rewritten graph must give every output and every retained tensor bit for bit; a
   difference refuses the class for good (the stock result is kept);
5. **replay**: verified classes run through one `ExactShapeReplay` per operator, the sites
   aliased (one address for the life of the stream), the copied inputs staged; without CUDA the
   engine runs the rewritten graph eager and counts why (`no_cuda`).

A graph runs no Python, so the host-side values the stock call moves (the binding's `counters`:
lengths, positions, flags) are moved by the transformed call exactly as the stock call of the same
class moved them when it was verified; a class whose stock calls moved them differently is refused.
A host value the call only reads to choose what it computes (the binding's `modes`: a decoding
switch) is part of the class: each value its own graphs.
A counter that is a tensor (a device-side length the step advances in place) is state like a
region's: kept at one address, passed to the graph, aliased by the replay.

The stages live in modules of their own, each a set of functions over the `BoundOperator` whose
call they serve: `guard` (1), `step` and `export` (2), `rewrite` (3), `verify` (4); `state` keeps
the carries; `operator` is the driver and `model` the transformed model.
"""

from .model import BoundModel, transform_bound
from .operator import BoundOperator
from .records import VARIANTS, OperatorCounters, class_name

__all__ = ["BoundModel", "BoundOperator", "OperatorCounters", "VARIANTS", "class_name", "transform_bound"]
