#!/usr/bin/env bash
# The pipeline verified where graphs really replay, on one GPU in one sitting (BUDGET seconds, about
# 590 by default): phase 1, every cuda test file that does not time
# itself in three groups side by side with the differential fuzzer on CUDA (correctness only); phase
# 2, the two test files that time themselves, alone, completing the gpu_tests record; phase 3, the
# speed benchmarks, alone, each in the time left. PHASES picks (default 123). The records land in
# $OUT; move each to bench/results/ (the record it replaces to history/, its name suffixed with its
# commit) and run bench/results_index.py.
#   bash bench/gpu_verify.sh        (from the repository root, on the GPU machine)
set +e
START=$(date +%s); END=$((START + ${BUDGET:-585})); PHASES=${PHASES:-123}
left() { echo $((END - $(date +%s))); }
# On a machine with no package index, the wheels this needs beside its CUDA torch travel in .whl/
# (every pure-Python dependency: openai 3.57 imports httpx2 and httpcore2, fastapi 0.165 opentelemetry)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
fi
# cadence-fx as it installs, from this checkout, which Python puts first on its path: its
# sub-packages (top-level folders here) linked into cadence_fx/, and its entry points in /tmp/pkg
for sub in passes models serve; do [ -e cadence_fx/$sub ] || ln -s ../$sub cadence_fx/$sub; done
python3 - <<'PY' || exit 4
import pathlib, tomllib
project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
info = pathlib.Path("/tmp/pkg") / f"cadence_fx-{project['version']}.dist-info"
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: cadence-fx\nVersion: {project['version']}\n")
groups = project["entry-points"] | {"console_scripts": project["scripts"]}
(info / "entry_points.txt").write_text("".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in t.items()) for g, t in groups.items()))
PY
export PYTHONPATH=/tmp/site:/tmp/pkg:$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results/gpu_run}
python3 -c "import cadence_fx.passes, cadence_fx.families as f; print('families:', sorted(f.families()))" || exit 5
mkdir -p $OUT
nvidia-smi -L; python3 -c "import torch, sys; print(sys.version, torch.__version__, torch.cuda.get_device_name())"
L=$OUT/logs; mkdir -p $L
if [[ $PHASES == *1* ]]; then
  T="timeout $(( $(left) - 130 ))"
  $T python3 bench/gpu_tests.py $OUT/g1.json tests/test_token2wav_cuda.py tests/test_token2wav_batch_cuda.py > $L/g1.log 2>&1 &
  $T python3 bench/gpu_tests.py $OUT/g2.json tests/serve/test_token2wav_gpu.py tests/test_token2wav_checkpoint_cuda.py > $L/g2.log 2>&1 &
  $T python3 bench/gpu_tests.py $OUT/g3.json tests/test_byom_probe.py tests/test_moshi_cuda.py tests/test_binding_cuda.py \
    tests/test_moshi_checkpoint.py tests/serve/test_moshi_weights.py tests/test_moshi_slots_cuda.py tests/test_threads_cuda.py \
    tests/test_binding_ring.py tests/test_binding_static_cache.py tests/test_binding_tensor_state.py \
    tests/test_binding_two_operators.py tests/test_binding_moshi.py tests/serve/test_moshi_cuda_plugin.py > $L/g3.log 2>&1 &
  $T python3 bench/fuzz.py --device cuda --seeds 4 --steps 40 --model-seeds 1 --model-steps 16 --jobs 4 --out $OUT/fuzz_cuda.json > $L/fuzz.log 2>&1 &
  while [ -n "$(jobs -r)" ]; do sleep 20; echo "$(date +%T) phase 1 running: $(jobs -r | wc -l); $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"; done
fi
if [[ $PHASES == *2* ]]; then
  A=""; for g in g1 g2 g3; do [ -f $OUT/$g.json ] && A="$A --after $OUT/$g.json"; [ -f .gpu/$g.json ] && A="$A --after .gpu/$g.json"; done
  timeout $(( $(left) - 20 )) python3 bench/gpu_tests.py $OUT/gpu_tests.json $A tests/test_replay_cuda.py tests/test_freeze_omni_cuda.py > $L/g4.log 2>&1
fi
if [[ $PHASES == *3* ]]; then
  timeout $(( $(left) - 10 )) python3 bench/moshi.py --out $OUT/moshi.json > $L/moshi.log 2>&1
  [ $(left) -gt 120 ] && timeout $(( $(left) - 10 )) python3 bench/moshi_slots.py --slots 64 --out $OUT/moshi_slots.json > $L/moshi_slots.log 2>&1
  [ $(left) -gt 150 ] && timeout $(( $(left) - 5 )) python3 bench/token2wav.py --arms eager,SRc --blocks 2 --chunks 6 --arm-limit $(( $(left) / 2 - 10 )) --out $OUT/token2wav.json > $L/token2wav.log 2>&1
fi
echo "ended with $(left) s left"
# at most 8 files come back: the records, and everything else in one archive
(cd $OUT && tar czf rest.tar.gz $(ls -A | grep -v -x -e gpu_tests.json -e fuzz_cuda.json -e moshi.json -e moshi_slots.json -e token2wav.json) \
  && ls -A | grep -v -x -e gpu_tests.json -e fuzz_cuda.json -e moshi.json -e moshi_slots.json -e token2wav.json -e rest.tar.gz | xargs rm -rf)
for f in $L/*.log; do echo "===== $f"; grep -v "Warning\|warn(" $f | tail -40; done | tail -c 11000
