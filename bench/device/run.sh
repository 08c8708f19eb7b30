#!/usr/bin/env bash
# One call on a lent GPU machine (the device tool): the GPU tests, the learner against a plain loop, and rlsys against
# TRL with both on the GPU, on the default task and on the long-answer one, with a py-spy profile of each of rlsys's
# roles. Never part of CI.
#
# Prepare on the CPU machine, once a session (the GPU machine has no registry; the default task's dataset and
# warm-started model travel from this machine's cache, so nothing is rebuilt there; so does the long-answer task's
# where this machine has built it (`python3 training/main_async_ppo.py experiment=async-ppo-math-long max_steps=1`,
# about 12 minutes here), else it is warm-started there, on the GPU):
#   bash ../shared/device/prepare-carry.sh .device-carry && echo /.device-carry/ >> .git/info/exclude
#   mkdir -p .device-carry/cache && cp -r ~/.cache/rlsys/models ~/.cache/rlsys/data .device-carry/cache/
# Then: run(command="bash bench/device/run.sh", carry=[".device-carry"], timeout_s=560): the GPU tests (about 30 s),
# the learner against a plain loop on the two batches (the default step's and the 135M-shaped one, about
# 60 s), the learner's publish with its checks' share (bench/publish_cost.py, about 20 s), the transformers engine
# eager against its CUDA graphs (`inference.enforce_eager=false`, about 45 s), and rlsys against TRL on the default
# task, rlsys with and without CUDA graphs (about 4.5 min; 413 s in all on 2026-12-04). PARTS names the parts to run
# (of: tests learner publish engine vs_trl long; by default all but long; VS_TRL_LIMIT, seconds, bounds vs_trl's part,
# 330 unless set); a second call with PARTS=long (up to 8 min:
# the long-answer task's model's warm start, when it did not travel, up to 4 of them; TRL about 85 s, rlsys about
# 130 s twice, then the scoring) runs the long-answer task on what time is left.
# What comes back in $OUT (the tool returns at most 8 files): tests.txt, engine.txt, learner_vs_plain.txt,
# vs_trl.txt, vs_trl.json, vs_trl_long.txt, vs_trl_long.json, and profiles.tgz: py-spy's collapsed stacks (10 s at
# 100 Hz) of learner0, inference0 and rollout0 in each of rlsys's runs (CUDA graphs, then eager), 25 s after each
# run's learner starts, and torch.profiler's tables of one learner step and one plain-loop step on each batch
# (learner-tiny.txt, learner-135m.txt), with py-spy's stacks of each batch's whole bench (pyspy-tiny.txt,
# pyspy-135m.txt). No vLLM
# there (its wheel is too large to carry): the transformers engine serves.
set -uo pipefail
source .device-carry/env.sh
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT/profiles" ~/.cache/rlsys
cp -r .device-carry/cache/* ~/.cache/rlsys/
started=$SECONDS
PARTS=${PARTS:-"tests learner publish engine vs_trl"}
EAGER="eager:inference.enforce_eager=true"  # rlsys again, its engine's decode steps without CUDA graphs
part() { [[ " $PARTS " == *" $1 "* ]]; }
stamp() { echo "== $1 at $((SECONDS - started)) s" | tee -a "$OUT/tests.txt"; }

profile_roles() {  # each of rlsys's runs (TRL goes first) once its roles have trained a while: runs $1 to $2
  for run in $(seq "$1" "$2"); do
    for _ in $(seq 300); do pgrep -x learner0 > /dev/null && break; sleep 1; done
    sleep 25
    for role in learner0 inference0 rollout0; do
      pid=$(pgrep -x "$role" | head -1)
      [ -n "$pid" ] && py-spy record --pid "$pid" -d 10 -r 100 --format raw -o "$OUT/profiles/$role-run$run.txt" \
        --nonblocking > /dev/null 2>&1 &
    done
    wait
    while pgrep -x learner0 > /dev/null; do sleep 1; done
  done
}

part tests && { stamp "GPU tests"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$OUT/tests.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py >> "$OUT/tests.txt" 2>&1; }

part engine && { stamp "the transformers engine, eager and with CUDA graphs"
for tokens in 8 128; do
  timeout 60 python3 bench/generation_throughput.py --engines transformers,transformers-graphs --new-tokens "$tokens" \
    --out /tmp/engine.json >> "$OUT/engine.txt" 2>&1
done; }

part learner && { stamp "learner against a plain loop"
for batch in "tiny:" "135m:--random-model 576,1536,30,9,3,49152 learner.dtype=bfloat16"; do
  settings=${batch#*:}
  echo "--- $settings" >> "$OUT/learner_vs_plain.txt"
  # py-spy samples the whole bench (both sides, alternating): where each side's host time goes, Python included,
  # which torch.profiler's tables of operations do not show
  # shellcheck disable=SC2086  # the settings are words
  timeout 60 py-spy record --format raw -r 100 --nonblocking -o "$OUT/profiles/pyspy-${batch%%:*}.txt" -- \
    python3 bench/learner_vs_plain.py --repeats 3 --out /tmp/lvp.json \
    --profile "$OUT/profiles/learner-${batch%%:*}.txt" $settings >> "$OUT/learner_vs_plain.txt" 2>&1
done
}

part publish && { stamp "the learner's publish and its checks"
echo "--- the learner's publish and its checks" >> "$OUT/learner_vs_plain.txt"
timeout 60 python3 bench/publish_cost.py --out /tmp/publish_cost.json >> "$OUT/learner_vs_plain.txt" 2>&1; }

part long && { stamp "rlsys against TRL on the long-answer task, the GPU"
profile_roles 1 1 &
timeout 480 python3 bench/vs_trl.py --device cuda --task async-ppo-math-long --steps 60 --snapshot-steps 10 \
  --held-out 200 --variant "$EAGER" --out "$OUT/vs_trl_long.json" > "$OUT/vs_trl_long.txt" 2>&1
echo "exit $? after $((SECONDS - started)) s" >> "$OUT/vs_trl_long.txt"
wait; }

part vs_trl && { stamp "rlsys against TRL on the GPU"
profile_roles 1 2 & profiler=$!
timeout "${VS_TRL_LIMIT:-330}" python3 bench/vs_trl.py --device cuda --variant "$EAGER" --out "$OUT/vs_trl.json" \
  > "$OUT/vs_trl.txt" 2>&1
echo "exit $? after $((SECONDS - started)) s" >> "$OUT/vs_trl.txt"
kill "$profiler" 2> /dev/null; wait; }
tar -czf "$OUT/profiles.tgz" -C "$OUT" profiles && rm -r "$OUT/profiles"
stamp "done"
