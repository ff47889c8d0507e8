"""Token2Wav batched rows: device memory per stream, predicted by the memory model for 1, 64 and
128 streams (issue 43, item 5), as data for the GPU issue to check on the device.

The memory model is the contract's derivation (`cadence_fx.catalog.derive`): each region's shape
and bytes at its bound (the live extent of a call: what is retained plus the call's frames), its
prompt extent (`lower`) and its retained top (`lower + window`). A row of `BatchedStreams`
(models/token2wav_batch.py) holds between chunks:

* on the device, every flow region it carries at its retained top (the estimator's and the
  conformer's attention caches, the estimator's conv cache) and HiFT's mel and source caches; and
  two caches the contract does not declare, at the vendor's fixed shapes: the conformer's conv
  cache (1, 512, 6) and HiFT's speech cache (1, 3840);
* in pinned host memory, its prompt state for turn resets (the same caches at the prompt extent).

A call of n rows of one class holds, besides, three copies of the flow's caches for its rows (the
rows' caches stacked, the new caches at the bound, and the rows' own unstacked from them); calls
run one after another, so at most one call's worth is live: `capacity` rows. Weights are one copy
for every row. Activations are not modelled (a call's are of the order of one CFM step's, freed
step by step). Nothing here is measured: the GPU issue checks it against `cadence_fx.memory`.

    python bench/token2wav_batch_memory.py --out bench/results/token2wav_batch_memory.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != Path(__file__).resolve().parent]

from cadence_fx.catalog import derive  # noqa: E402
from cadence_fx.models.token2wav import token2wav_contract  # noqa: E402
from cadence_fx.models.token2wav_stream import FULL_DEPTH, REDUCED_DEPTH, build_flow, build_hift  # noqa: E402
from cadence_fx.report import measured_commit  # noqa: E402

FLOW_REGIONS = ("estimator_att_cache", "estimator_cnn_cache", "conformer_att_cache")
HIFT_REGIONS = ("hift_mel_cache", "hift_source_cache")
#: Caches a row holds that the contract does not declare (the vendor's fixed shapes, float32).
UNDECLARED = {"conformer_cnn_cache": 512 * 6 * 4, "hift_speech_cache": 3840 * 4}
#: Streams, each at two capacities (rows a call): 16, and every stream in one call (the largest transient).
STREAMS = (1, 64, 128)


def _at(region, extent: int) -> int:
    return region.bytes * extent // region.bound


def per_stream(contract) -> dict:
    catalog = derive(contract)
    regions = {name: catalog.region(name) for name in (*FLOW_REGIONS, *HIFT_REGIONS)}
    resident = {name: _at(r, r.lower + r.window) for name, r in regions.items()} | dict(UNDECLARED)
    prompt_state = {name: _at(regions[name], regions[name].lower) for name in FLOW_REGIONS}
    prompt_state["conformer_cnn_cache"] = UNDECLARED["conformer_cnn_cache"]
    call = 3 * sum(regions[name].bytes for name in FLOW_REGIONS)
    return {
        "regions": {
            name: {
                "shape_at_bound": list(r.shape),
                "bytes_at_bound": r.bytes,
                "prompt_extent": r.lower,
                "retained_top": r.lower + r.window,
                "bound": r.bound,
            }
            for name, r in regions.items()
        },
        "device_resident_bytes": resident,
        "device_resident_bytes_total": sum(resident.values()),
        "host_prompt_state_bytes": prompt_state,
        "host_prompt_state_bytes_total": sum(prompt_state.values()),
        "call_transient_bytes_per_row": call,
    }


def weights(depth) -> dict:
    """The model's own tensors, one copy for every row: parameters, and the vendor's buffers (the
    CFM's 16 x 16 x 1000-frame cache envelope among them, which a row's turn start writes into)."""
    flow, hift = build_flow(depth), build_hift()
    count = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    return {
        "flow_parameter_bytes": count(flow.parameters()),
        "flow_buffer_bytes": count(flow.buffers()),
        "hift_bytes": count((*hift.parameters(), *hift.buffers())),
    }


def totals(row: dict, shared: dict, streams: int, capacity: int) -> dict:
    weights_bytes = sum(shared.values())
    device = (
        weights_bytes
        + streams * row["device_resident_bytes_total"]
        + min(streams, capacity) * row["call_transient_bytes_per_row"]
    )
    return {
        "streams": streams,
        "capacity": capacity,
        "device_bytes": device,
        "device_gib": round(device / 2**30, 2),
        "device_bytes_per_stream": math.ceil(device / streams),
        "host_pinned_bytes": streams * row["host_prompt_state_bytes_total"],
        "host_pinned_gib": round(streams * row["host_prompt_state_bytes_total"] / 2**30, 2),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    sizes = {
        "full": (token2wav_contract(), FULL_DEPTH),
        "reduced": (token2wav_contract(f_prompt=102, dit_depth=2, conformer_blocks=2), REDUCED_DEPTH),
    }
    record = {
        "benchmark": "token2wav_batch_memory",
        "commit": measured_commit(),
        "date": time.strftime("%Y-%m-%d"),
        "command": "python " + " ".join([f"bench/{Path(__file__).name}", *(argv if argv is not None else sys.argv[1:])]),
        "device": "none: predicted from the contract (the memory model), float32",
        "model": " ".join(__doc__.split("\n\n")[1:-1]).replace("\n", " "),
        "sizes": {},
    }
    for name, (contract, depth) in sizes.items():
        row, shared = per_stream(contract), weights(depth)
        record["sizes"][name] = {
            "per_stream": row,
            "weights": shared,
            "streams": [totals(row, shared, n, capacity=c) for n in STREAMS for c in sorted({min(n, 16), n})],
        }
        for t in record["sizes"][name]["streams"]:
            print(
                f"{name}: {t['streams']} streams at capacity {t['capacity']}: device {t['device_gib']} GiB "
                f"({t['device_bytes_per_stream'] / 2**20:.1f} MiB a stream), host pinned {t['host_pinned_gib']} GiB",
                file=sys.stderr,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
