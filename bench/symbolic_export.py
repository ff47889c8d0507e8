"""Could one symbolic export serve several catalog classes? For each class the pipeline exports,
this probe also exports the very same step with the bound region's retained extent symbolic
(`torch.export.Dim.AUTO` on each state site's retention axis) and records what torch made of it:
the range the extent's symbol kept (the classes one export could serve), or that it specialised
the extent (no symbol left) or failed, and what each export took against the class's own.

Two models: the real MiniCPM-o Token2Wav flow at reduced depth (`FLOW_BINDING`: the CFM loop and
the conformer encoder, K = 4 each), and tests/byom_example.py's `transformers` Mistral decoder
with the 250-token window of bench/binding_wide.py (K = 126; its first `--wide-calls` calls, one
class each). CPU, random weights. Written as JSON with the commit, command and device:

    python bench/symbolic_export.py --out bench/results/symbolic_export_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.export import Dim

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

from cadence_fx import pipeline, transform  # noqa: E402  (the pipeline's operator and export modules, patched below)
from cadence_fx.report import measured_commit  # noqa: E402

_export = torch.export.export


class Probe:
    """Wraps `torch.export.export` while a bound operator captures a class: the pipeline's own
    export, then the symbolic one (its time, and the symbols' ranges or the error)."""

    def __init__(self) -> None:
        self.axes: dict[str, int] = {}  # state site path -> its retention axis, for the class in capture
        self.rows: list[dict] = []
        self.row: dict | None = None

    def export(self, step, args, **kwargs):
        # The class's own export first: a failed symbolic trace can leave the step's private state
        # holding its fake tensors, and the pipeline must get the program it would have got.
        started = time.perf_counter()
        program = _export(step, args, **kwargs)
        self.row["class_export_seconds"] = round(time.perf_counter() - started, 3)
        inputs, state = args
        if not any(isinstance(v, torch.Tensor) and site.path in self.axes for site, v in zip(step.sites, state)):
            self.row["symbolic"] = {"outcome": "no state yet (nothing to make symbolic)", "seconds": 0.0}
            return program
        dynamic = [
            None
            if not isinstance(v, torch.Tensor)
            else {axis: Dim.AUTO if axis == self.axes.get(site.path) else None for axis in range(v.dim())}
            for site, v in zip(step.sites, state)
        ]
        started = time.perf_counter()
        try:
            symbolic = _export(
                step, args, dynamic_shapes=(torch.utils._pytree.tree_map(lambda _: None, inputs), dynamic), **kwargs
            )
            ranges = {str(symbol): str(value) for symbol, value in symbolic.range_constraints.items()}
            self.row["symbolic"] = {"outcome": "symbolic" if ranges else "specialised", "ranges": ranges}
        except Exception as error:  # what torch said, recorded
            self.row["symbolic"] = {"outcome": "failed", "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
        self.row["symbolic"]["seconds"] = round(time.perf_counter() - started, 3)
        return program

    def capture(self, capture):
        probe = self

        def wrapped(op, roots, inputs, state, call, *rest):
            probe.axes = {s.path: op.carries[s.path].axis for s in op.sites if s.region is not None and s.path in op.carries}
            probe.row = {"operator": op.ob.operator, "units": call.call, "extent": call.extent, "flush": call.flush}
            print(f"{op.ob.operator} units={call.call} extent={call.extent}", file=sys.stderr, flush=True)
            try:
                return capture(op, roots, inputs, state, call, *rest)
            finally:
                if "class_export_seconds" in probe.row:  # not a reused export
                    probe.rows.append(probe.row)

        return wrapped


def token2wav() -> None:
    from cadence_fx.models.token2wav_carry import reference_flow

    flow, contract, _ = reference_flow("reduced")
    transform(flow, contract)  # the family's hook warms up every class


def wide(calls: int) -> None:
    import byom_example
    from binding_wide import build

    model, config, contract = build("cpu")
    tokens = torch.randint(
        0, config.vocab_size, (1, calls * byom_example.TOKENS_PER_CALL), generator=torch.Generator().manual_seed(1)
    )
    bound, _ = transform(model, contract, byom_example.binding(), budget=200)
    byom_example.stream(bound, config, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--wide-calls", type=int, default=8, help="calls of the wide decoder's stream (one class each)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = {}
    for name, run in (("token2wav_reduced", token2wav), ("mistral_window250", lambda: wide(args.wide_calls))):
        probe = Probe()
        torch.export.export = probe.export
        capture = pipeline.operator.capture_class
        pipeline.operator.capture_class = probe.capture(capture)
        pipeline.export.EXPORTS.clear()
        try:
            run()
        finally:
            torch.export.export, pipeline.operator.capture_class = _export, capture
        models[name] = probe.rows
    record = {
        "benchmark": "symbolic_export",
        "commit": measured_commit(),
        "worktree_dirty": bool(
            subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
        ),
        "command": " ".join(["python", "bench/symbolic_export.py", *sys.argv[1:]]),
        "device": platform.processor() or "cpu",
        "cpu_count": os.cpu_count(),
        "torch_threads": 1,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "models": models,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for name, rows in models.items():
        for row in rows:
            symbolic = row["symbolic"]
            print(
                f"{name} {row['operator']} units={row['units']} extent={row['extent']}: symbolic {symbolic['outcome']} "
                f"{symbolic.get('ranges', symbolic.get('error', ''))} in {symbolic['seconds']} s, "
                f"the class's own export {row['class_export_seconds']} s"
            )


if __name__ == "__main__":
    main()
