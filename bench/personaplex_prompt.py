"""PersonaPlex's prompt phase: the vendor stepping it against a prompt state copied in, on a CPU.

At the tiny size (`TINY`), one torch thread: a session primed with a 1 s voice WAV and a role
prompt (stand-in tokens, `serve/plugins/personaplex_prompts.py`), as the vendor primes it
(`personaplex_prompt.prime`: the voice frames, 12 silence frames, the role's tokens), and the same
session's state restored from its `PromptState` (`restore`). Per arm: the wall and CPU (thread)
time of each run, median over `--runs`. Also the state's size and, for the slots runtime, how many
ticks a slot stepping the prompt in the batch takes at its `prompt_rate` (4 steps a tick: 50 steps
a second at 12.5 ticks a second).

    python bench/personaplex_prompt.py --out bench/results/personaplex_prompt_cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from cadence_fx.models import personaplex, personaplex_stream
from cadence_fx.models.personaplex_prompt import capture, prime, restore
from cadence_fx.report import measured_commit

ROLE = (
    "You work for a bicycle repair shop and your name is Ada. Information: the shop opens at nine, "
    "a tune-up costs forty dollars and takes two days."
)


def _timed(fn, runs: int) -> dict:
    wall, cpu = [], []
    for _ in range(runs):
        started, thread = time.perf_counter(), time.thread_time()
        fn()
        wall.append(1e3 * (time.perf_counter() - started))
        cpu.append(1e3 * (time.thread_time() - thread))
    return {"wall_ms_median": round(statistics.median(wall), 3), "cpu_ms_median": round(statistics.median(cpu), 3), "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of the vendor's priming (restores: 10 times as many)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import sphn

    from cadence_fx.serve.plugins.personaplex_prompts import stand_in_tokens

    torch.set_num_threads(1)
    models = personaplex_stream.build_models(personaplex_stream.TINY)
    role = stand_in_tokens(ROLE)
    with tempfile.TemporaryDirectory() as folder:
        wav = str(Path(folder) / "voice.wav")
        t = torch.arange(24_000, dtype=torch.float32) / 24_000
        sphn.write_wav(wav, (0.1 * torch.sin(2 * math.pi * 140 * t))[None].numpy(), 24_000)
        gen = personaplex_stream.lm_gen(models.lm, sampling=False)
        no_compile = personaplex._vendor("utils.compile").no_compile
        with no_compile(), torch.no_grad(), models.mimi.streaming(1), gen.streaming(1):
            stepped = _timed(lambda: prime(models.mimi, gen, text_prompt_tokens=role, voice_prompt=wav), args.runs)
            state = capture(gen, voice="voice.wav", role=role)
            restored = _timed(lambda: restore(gen, state), 10 * args.runs)
    rate = 4
    record = {
        "benchmark": "personaplex_prompt",
        "commit": measured_commit(),
        "date": time.strftime("%Y-%m-%d"),
        "command": "python " + " ".join(sys.argv),
        "device": f"cpu ({platform.processor() or platform.machine()}), 1 torch thread, torch {torch.__version__}",
        "config": "TINY",
        "prompt": {"voice_seconds": 1.0, "role_tokens": len(role), "steps": state.steps, "state_bytes": state.nbytes},
        "vendor_priming": stepped,
        "restore": restored,
        "slots_prompt_rate": rate,
        "slots_ticks_to_prime": math.ceil(state.steps / rate),
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
