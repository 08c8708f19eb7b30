"""The endpoint's cut at a stop string: time per reply against decoding every prefix, in one run.

    python3 bench/stop_strings.py [--tokens 1000,4000] [--repeats 5] [--out bench/results/stop_strings.json]

An agent's client often sends a stop string of several tokens (ReAct's "Observation:"); the engine stops only on
single stop tokens, so the endpoint cuts each sample after the first token that completes one
(rlsys/endpoint/session.py `_cut_at_stop_strings`), on the rollout worker's event loop. Replies of the character
tokenizer (`build_char_tokenizer`), of `--tokens` lengths, with the stop string never there and halfway. The baseline
is the cut as it was before 2026-12-05: decode each prefix in turn until one holds the stop string. The last line is
the headline: how many times faster the cut is on the longest reply without a stop string.
"""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlsys.api import GenerationOutput  # noqa: E402
from rlsys.endpoint.session import _cut_at_stop_strings  # noqa: E402
from rlsys.model.tokenizer import build_char_tokenizer  # noqa: E402


def every_prefix(ids: list[int], stops: list[str], tokenizer) -> int:
    """The baseline: how many tokens the cut keeps, found by decoding every prefix."""
    for k in range(1, len(ids) + 1):
        if any(s in tokenizer.decode(ids[:k], skip_special_tokens=True) for s in stops):
            return k
    return len(ids)


def median_seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1000,4000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "stop_strings.json"))
    args = parser.parse_args()
    tokenizer, stop, rng = build_char_tokenizer(), "Observation:", random.Random(0)
    rows = []
    for n in map(int, args.tokens.split(",")):
        text = "".join(rng.choice("0123456789+= ") for _ in range(n))
        for where in ("never", "halfway"):
            reply = text if where == "never" else text[:n // 2] + stop + text[n // 2 + len(stop):]
            ids = tokenizer.encode(reply, add_special_tokens=False)
            output = GenerationOutput("q", [1], [ids], [[0.0] * len(ids)], [[0] * len(ids)], ["length"])
            kept = len(_cut_at_stop_strings(output, [stop], tokenizer).output_ids[0])
            assert kept == every_prefix(ids, [stop], tokenizer), "the cut must keep what the baseline keeps"
            cut = median_seconds(lambda: _cut_at_stop_strings(output, [stop], tokenizer), args.repeats)
            baseline = median_seconds(lambda: every_prefix(ids, [stop], tokenizer), args.repeats)
            rows.append({"tokens": n, "stop": where, "kept": kept, "cut_s": cut, "every_prefix_s": baseline,
                         "speedup": baseline / cut})
    print(f"{'tokens':>7} {'stop':>8} {'kept':>6} {'cut (s)':>10} {'every prefix (s)':>17} {'speed-up':>9}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['stop']:>8} {r['kept']:>6} {r['cut_s']:>10.5f} {r['every_prefix_s']:>17.4f} "
              f"{r['speedup']:>8.0f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    longest = max((r for r in rows if r["stop"] == "never"), key=lambda r: r["tokens"])
    print(f"ratio: {longest['speedup']:.0f}x faster than decoding every prefix ({longest['tokens']} tokens, "
          f"no stop string: {longest['cut_s'] * 1e3:.2f} ms against {longest['every_prefix_s']:.2f} s)")


if __name__ == "__main__":
    main()
