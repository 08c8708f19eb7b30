#!/usr/bin/env bash
# One call on a lent GPU machine (device tool): the GPU tests, the learner against a plain loop, the weight path,
# and a whole default run with a py-spy profile of each role. Never part of CI.
#
# Prepare on the CPU machine, once a session (the GPU machine has no registry):
#   bash ../shared/device/prepare-carry.sh .device-carry && echo /.device-carry/ >> .git/info/exclude
# Then: run(command="bash bench/device/run.sh", carry=[".device-carry"], timeout_s=540)
# What it writes to $OUT (at most 8 files come back): tests.txt, learner_vs_plain.txt, scale.txt, run.txt and
# profile-<role>.txt (py-spy's collapsed stacks, 12 s at 100 Hz, of learner0, inference0 and rollout0).
# No vLLM there (its wheel is too large to carry): the transformers engine serves.
set -uo pipefail
source .device-carry/env.sh
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/tests.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_transformers_engine.py \
  tests/test_weight_sync.py -k "not vllm and not VLLM" >> "$OUT/tests.txt" 2>&1
timeout 90 python3 bench/learner_vs_plain.py --repeats 3 > "$OUT/learner_vs_plain.txt" 2>&1
timeout 120 python3 bench/scale.py --models 1b --no-learner-ranks --repeats 3 --out "$OUT/scale.json" \
  > "$OUT/scale.txt" 2>&1
python3 training/main_async_ppo.py inference.engine=transformers max_steps=200 eval_steps=0 trial_name=device \
  > "$OUT/run.txt" 2>&1 &
run=$!
for _ in $(seq 120); do pgrep -x learner0 >/dev/null && grep -q "step " "$OUT/run.txt" && break; sleep 1; done
for role in learner0 inference0 rollout0; do
  pid=$(pgrep -x "$role" | head -1)
  [ -n "$pid" ] && py-spy record --pid "$pid" -d 12 -r 100 --format raw -o "$OUT/profile-$role.txt" --nonblocking \
    > /dev/null 2>&1 &
done
wait "$run"
wait
rm -f "$OUT/scale.json"
