"""What a call that falls back to the stock code costs through the bound model, against the same
call on the stock model (plain): the guard read, the class lookup and taking the stock call's
retained state into the carries, and nothing copied for the stock call itself (issue 39: a
fallback copied every state tensor, 1.06 ms against 0.67 ms plain).

    python bench/fallback.py --calls 200 --out bench/results/fallback_cpu.json

Two models from the tests' bindings, two fallbacks each, every one counted by the bound model's
`stock_by_reason` (the record says the count matched the timed calls):

- `refused`: a stream's first call (nothing cached), whose class the program comparison refuses
  (traced, transformers takes another position path): a fresh cache each time;
- `not_in_catalog`: a 3-token call (the catalog's calls bring 2) on a cache primed by two calls.

The models: the README's Mistral example (`tests/byom_example.py`, a sliding window) and the GPT-2
probe of `tests/test_byom_probe.py` (full attention). Each timed call starts from its own cache,
prepared untimed the same way for both, the stock and bound calls interleaved; recorded per model
and case, the medians over `--calls` of the calling thread's CPU time (torch on one thread: other
processes' load on a shared machine leaves it alone) and of the wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from transformers import DynamicCache  # noqa: E402

from cadence_fx import transform  # noqa: E402

STEP = 2


def mistral():
    from byom_example import binding, build_model, contract

    model, config = build_model()
    return model, config, contract(), binding()


def gpt2():
    import test_byom_probe as probes

    model, config = probes.gpt2()
    return model, config, probes.kv_contract("gpt2", 2, 4, tokens=8), probes.DYNAMIC_CACHE


MODELS = {"mistral": mistral, "gpt2": gpt2}
CASES = {"refused": (0, STEP + 0), "not_in_catalog": (2, STEP + 1)}  # (priming calls, tokens of the timed call)


def _call(model, cache, tokens: torch.Tensor):
    return model(input_ids=tokens, cache=cache, use_cache=True)


def _timed(
    model, config, primes: list[torch.Tensor], tokens: torch.Tensor, fell_back: dict | None = None, op=None
) -> tuple[float, float]:
    """Seconds of one call of `tokens` on a fresh cache primed by `primes`: the wall clock's, and
    this thread's CPU time (torch runs on this one thread), which other processes' load leaves alone.
    With the bound operator `op`, why the timed call ran the stock code is added to `fell_back`."""
    cache = DynamicCache(config=config)
    for prime in primes:
        _call(model, cache, prime)
    before = dict(op.counters.stock_by_reason) if op is not None else {}
    wall, cpu = time.perf_counter(), time.thread_time()
    _call(model, cache, tokens)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    if op is not None:
        for reason, n in op.counters.stock_by_reason.items():
            if n != before.get(reason, 0):
                fell_back[reason] = fell_back.get(reason, 0) + n - before.get(reason, 0)
    return wall, cpu


def _ms(seconds: list[float]) -> float:
    return round(1e3 * statistics.median(seconds), 3)


def measure(name: str, calls: int) -> dict:
    model, config, contract, binding = MODELS[name]()
    bound, report = transform(model, contract, binding)
    op = report.operators[binding.operators[0].operator]
    generator = torch.Generator().manual_seed(0)
    figures = {}
    with torch.no_grad():
        for case, (priming, n) in CASES.items():
            primes = [torch.randint(0, config.vocab_size, (1, STEP), generator=generator) for _ in range(priming)]
            tokens = torch.randint(0, config.vocab_size, (1, n), generator=generator)
            for _ in range(3):  # the classes met on the way are captured and verified here, untimed
                _timed(bound, config, primes, tokens)
                _timed(model, config, primes, tokens)
            stock, through, counted = [], [], {}
            for _ in range(calls):
                stock.append(_timed(model, config, primes, tokens))
                through.append(_timed(bound, config, primes, tokens, counted, op))
            figures[case] = {
                "tokens": n,
                "priming_calls": priming,
                "calls": calls,
                "stock_cpu_ms_median": _ms([c for _, c in stock]),
                "bound_cpu_ms_median": _ms([c for _, c in through]),
                "stock_wall_ms_median": _ms([w for w, _ in stock]),
                "bound_wall_ms_median": _ms([w for w, _ in through]),
                "fell_back": counted,
            }
            print(
                f"{name} {case}: CPU stock {figures[case]['stock_cpu_ms_median']} ms, bound "
                f"{figures[case]['bound_cpu_ms_median']} ms; wall stock {figures[case]['stock_wall_ms_median']} ms, bound "
                f"{figures[case]['bound_wall_ms_median']} ms (medians of {calls}); fell back {counted}",
                flush=True,
            )
            if counted != {case: calls}:
                raise SystemExit(f"{name} {case}: expected {calls} fallbacks for {case!r}, counted {counted}")
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200, help="timed calls per model and case")
    parser.add_argument("--out", type=Path, help="where to write the record (JSON)")
    args = parser.parse_args()
    if args.calls < 1:
        parser.error(f"--calls must be at least 1, got {args.calls}")
    torch.set_num_threads(1)
    models = {name: measure(name, args.calls) for name in MODELS}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    record = {
        "benchmark": "fallback",
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "command": "python " + " ".join(["bench/fallback.py", *sys.argv[1:]]),
        "device": f"cpu ({platform.processor() or platform.machine()}), 1 thread, torch {torch.__version__}",
        "load_average_1min": round(os.getloadavg()[0], 2),  # the machine is shared: the CPU times are the figures
        "models": models,
    }
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
