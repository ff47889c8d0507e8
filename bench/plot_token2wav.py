"""Figures and a README table from a Token2Wav benchmark record (bench/token2wav.py's JSON).

    python bench/plot_token2wav.py bench/results/token2wav.json --png bench/results/token2wav.png --readme README.md
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

MARK = re.compile(r"(<!-- token2wav-results -->\n).*?(<!-- /token2wav-results -->)", re.S)


def table(record: dict) -> str:
    arms = record["arms"]
    eager = arms["eager"]
    rows = [
        "| arm | steady chunk p50 / p95 (ms) | CFM loop p50 (ms) | vs eager (CFM loop) | kernels one chunk (ms, launches) "
        "| peak allocated | exact mel / PCM | replays, eager fallbacks, invalidations (CFM loop) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, arm in arms.items():
        if arm.get("outcome") != "ran":
            rows.append(f"| {name} | {arm.get('outcome')} | | | | | | |")
            continue
        chunk, cfm, kernels = arm["chunk_stats_ms"], arm["cfm_loop_stats_ms"], arm["kernels_one_steady_chunk"] or {}
        replay = arm["replay"].get("cfm_loop")
        counters = "-" if replay is None else f"{replay['replays']}, {replay['eager']}, {replay['invalidations']}"
        rows.append(
            f"| {name} | {chunk['p50']:.1f} / {chunk['p95']:.1f} | {cfm['p50']:.1f} | "
            f"{eager['cfm_loop_stats_ms']['p50'] / cfm['p50']:.2f}x | "
            f"{kernels.get('kernel_ms', float('nan')):.1f}, {kernels.get('launches', '-')} | "
            f"{arm['peak_allocated_bytes'] / 2**30:.2f} GiB | {arm['mel_equal_chunks']}/{arm['chunks']} / "
            f"{arm['pcm_equal_chunks']}/{arm['chunks']} | {counters} |"
        )
    compiled = record.get("torch_compile_reduce_overhead") or {}
    head = (
        f"{record['device']}, torch {record['torch']}, {record['depth']} size, {record['blocks']} turns x "
        f"{record['chunks_per_block']} chunks, commit {record['commit']}; torch.compile(mode='reduce-overhead') "
        f"of the CFM loop: {compiled.get('outcome', 'not run')}"
        + (f" after {compiled['seconds']:.0f} s" if "seconds" in compiled else "")
        + f". Not run: {', '.join(record.get('not_run', []))}."
    )
    return head + "\n\n" + "\n".join(rows) + "\n"


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
    kernel = arms["eager"]["kernels_one_steady_chunk"]["kernel_ms"]
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
    parser.add_argument("record", type=Path)
    parser.add_argument("--png", type=Path)
    parser.add_argument("--readme", type=Path, help="replace the table between the token2wav-results markers")
    args = parser.parse_args(argv)
    record = json.loads(args.record.read_text())
    text = table(record)
    print(text)
    if args.png:
        plot(record, args.png)
    if args.readme:
        readme = args.readme.read_text()
        if not MARK.search(readme):
            raise SystemExit(f"{args.readme} has no <!-- token2wav-results --> markers")
        args.readme.write_text(MARK.sub(lambda m: m.group(1) + text + m.group(2), readme))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
