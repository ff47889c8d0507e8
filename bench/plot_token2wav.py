"""Figures and a README table from a Token2Wav benchmark record (bench/token2wav.py's JSON).

    python bench/plot_token2wav.py bench/results/token2wav.json bench/results/history/token2wav_encoder_replay.json \
        bench/results/token2wav_fp16.json bench/results/token2wav_capacity.json \
        --png bench/results/token2wav.png --readme docs/families/token2wav.md

The PNG is drawn from the first record; the table covers every record given.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

MARK = re.compile(r"(<!-- token2wav-results -->\n).*?(<!-- /token2wav-results -->)", re.S)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _delta(n: int | None) -> str:
    return "not modelled" if n is None else f"{n / 2**30:+.2f} GiB"


def _device_memory(arm: dict) -> str:
    """What the device sees (cadence_fx.memory); records before it carried only reserved at the end."""
    memory = arm.get("memory")
    if memory is None:
        return f"{_gib(arm.get('reserved_bytes_end'))} / not recorded / not recorded"
    return (
        f"{_gib(memory['reserved_bytes_end'])} / {_gib(memory['device_footprint_bytes_end'])} / "
        f"{_gib(memory.get('device_footprint_bytes_after_empty_cache'))}"
    )


def table(record: dict) -> str:
    arms = record["arms"]
    if not arms:
        head = f"{record['device']}, torch {record['torch']}, {record['depth']} size, commit {record['commit']}.\n"
        return head + table_capacity(record)
    rows = [
        "| arm | steady chunk p50 / p95 (ms) | flow chunk p50 (ms) | CFM loop p50 (ms) | vs its eager (CFM loop) "
        "| kernels one chunk (ms, launches) "
        "| peak allocated: all / first turn / later turns | peak delta vs eager: predicted / measured "
        "| exact mel / PCM | replays, eager fallbacks, invalidations (CFM loop) "
        "| device: reserved at end / footprint at end / footprint after empty_cache |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, arm in arms.items():
        if arm.get("outcome") != "ran":
            rows.append(f"| {name} | {arm.get('outcome')} | | | | | | | | | |")
            continue
        eager = arms[arm.get("compared_with", "eager")]
        chunk, cfm, kernels = arm["chunk_stats_ms"], arm["cfm_loop_stats_ms"], arm["kernels_one_steady_chunk"] or {}
        flow = f"{arm['flow_chunk_stats_ms']['p50']:.1f}" if arm.get("flow_chunk_stats_ms") else "-"
        replay = arm["replay"].get("cfm_loop")
        counters = "-" if replay is None else f"{replay['replays']}, {replay['eager']}, {replay['invalidations']}"
        rows.append(
            f"| {name} | {chunk['p50']:.1f} / {chunk['p95']:.1f} | {flow} | {cfm['p50']:.1f} | "
            f"{eager['cfm_loop_stats_ms']['p50'] / cfm['p50']:.2f}x | "
            f"{kernels.get('kernel_ms', float('nan')):.1f}, {kernels.get('launches', '-')} | "
            f"{_gib(arm['peak_allocated_bytes'])} / {_gib(arm.get('peak_allocated_bytes_first_turn'))} / "
            f"{_gib(arm.get('peak_allocated_bytes_later_turns'))} | "
            f"{_delta(arm.get('predicted_delta_bytes'))} / {_delta(arm.get('measured_delta_bytes'))} | "
            f"{arm['mel_equal_chunks']}/{arm['chunks']} / {arm['pcm_equal_chunks']}/{arm['chunks']} | {counters} | "
            f"{_device_memory(arm)} |"
        )
    compiled = record.get("torch_compile_reduce_overhead") or {}
    head = (
        f"{record['device']}, torch {record['torch']}, {record['depth']} size, {record['blocks']} turns x "
        f"{record['chunks_per_block']} chunks, commit {record['commit']}; torch.compile(mode='reduce-overhead') "
        f"of the CFM loop: {compiled.get('outcome', 'not run')}"
        + (f" after {compiled['seconds']:.0f} s" if "seconds" in compiled else "")
        + f". Arms in this run: {', '.join(arms)}."
    )
    text = head + "\n\n" + "\n".join(rows) + "\n"
    return text + table_capacity(record)


def table_capacity(record: dict) -> str:
    text = ""
    sessions = record.get("capacity")
    if sessions and "lanes" in sessions:
        text += table_lanes(sessions)
    elif sessions and "rounds" in sessions:
        lines = [
            "",
            f"Capacity: N streams round robin over one set of SRc bindings, {sessions['chunks_per_stream']} chunks "
            f"each (1 chunk = 1 s of speech); largest N keeping real time: **{sessions['largest_real_time_N']}**. "
            f"Replay counters over the run: "
            + "; ".join(
                f"{name} {c['replays']} replayed, {c['eager']} eager {c['fallbacks']}" for name, c in sessions["replay"].items()
            )
            + ".",
            "",
            "| N | round p50 / p95 (ms, steady) | per chunk incl. carry swap p50 (ms) | keeps real time "
            "| streams checked exact |",
            "|---|---|---|---|---|",
        ]
        for r in sessions["rounds"]:
            steady = r["round_ms_steady"]
            exact = ", ".join(f"{i}: {e}" for i, e in r["streams_checked_exact"].items())
            lines.append(
                f"| {r['sessions']} | {steady['p50']:.1f} / {steady['p95']:.1f} | "
                f"{r['chunk_ms_with_swap']['p50']:.1f} | {r['keeps_real_time']} | {exact} |"
            )
        text += "\n".join(lines) + "\n"
    elif sessions:
        text += f"\nCapacity run: {sessions.get('outcome')}\n"
    return text


def table_lanes(sessions: dict) -> str:
    best = sessions["largest_real_time_N"]
    footprint = sessions.get("largest_real_time_N_device_footprint_bytes")
    lines = [
        "",
        f"Capacity: N streams over {sessions['lanes']} replay lane(s) (each its own SRc bindings, graph pool, thread and "
        f"CUDA stream; stream i on lane i mod L), {sessions['chunks_per_stream']} chunks each (1 chunk = 1 s of speech), "
        f"every stream compared bit for bit with the same stream run alone; lanes built and every class captured in "
        f"{sessions['build_and_capture_s']:.1f} s before the rounds. Largest N keeping real time: **{best}**"
        + (f", device footprint {_gib(footprint)}" if footprint is not None else "")
        + ". Classes refused: "
        + (
            ", ".join(f"lane {r['lane']} {r['engine']} {r['class']} ({r['reason']})" for r in sessions["refused_classes"])
            or "none"
        )
        + ".",
        "",
        "| N | round p50 / p95 (ms, steady) | keeps real time | streams exact | device footprint | reserved |",
        "|---|---|---|---|---|---|",
    ]
    for r in sessions["rounds"]:
        steady = r["round_ms_steady"]
        lines.append(
            f"| {r['sessions']} | {steady['p50']:.1f} / {steady['p95']:.1f} | {r['keeps_real_time']} | "
            f"{r['streams_exact']}/{r['streams_checked']} | {_gib(r['device_footprint_bytes'])} | "
            f"{_gib(r['reserved_bytes'])} |"
        )
    return "\n".join(lines) + "\n"


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = {n: a for n, a in record["arms"].items() if a.get("outcome") == "ran"}
    names = list(arms)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    chunk = [arms[n]["chunk_stats_ms"]["p50"] for n in names]
    cfm = [arms[n]["cfm_loop_stats_ms"]["p50"] for n in names]
    x = range(len(names))
    left.bar([i - 0.2 for i in x], chunk, 0.4, label="steady chunk p50 (flow + HiFT)")
    left.bar([i + 0.2 for i in x], cfm, 0.4, label="CFM loop p50")
    reference = arms.get("eager") or arms.get("eager16")
    kernel = (reference["kernels_one_steady_chunk"] or {}).get("kernel_ms")
    if kernel is not None:
        left.axhline(kernel, color="k", linestyle="--", label=f"eager kernel time {kernel:.1f} ms")
    left.set_xticks(list(x), names)
    left.set_ylabel("ms")
    left.set_title("latency per arm")
    left.legend(fontsize=8)
    right.bar(names, [arms[n]["peak_allocated_bytes"] / 2**30 for n in names], color="tab:green")
    right.set_ylabel("GiB")
    right.set_title("peak allocated memory per arm")
    fig.suptitle(f"Token2Wav on {record['device']} ({record['depth']} size, commit {record['commit']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", type=Path, nargs="+")
    parser.add_argument("--png", type=Path)
    parser.add_argument("--readme", type=Path, help="replace the table between the token2wav-results markers")
    args = parser.parse_args(argv)
    records = [json.loads(path.read_text()) for path in args.records]
    text = "\n".join(table(record) for record in records)
    print(text)
    if args.png:
        plot(records[0], args.png)
    if args.readme:
        readme = args.readme.read_text()
        if not MARK.search(readme):
            raise SystemExit(f"{args.readme} has no <!-- token2wav-results --> markers")
        args.readme.write_text(MARK.sub(lambda m: m.group(1) + text + m.group(2), readme))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
