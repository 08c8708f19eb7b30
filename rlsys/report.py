"""The run report: `<run dir>/summary.html`, one self-contained file (figures inline as SVG, frames as data
URIs) with the reward and held-out accuracy (or mean reward) curves, where the time went, the prompt accounting,
the correctness alarms, and a few traces and frames. Written at the end of every run; for any run directory:

    python3 -m rlsys.report runs/<experiment>/<trial>
"""

import base64
import html
import io
import json
import math
import sys
from pathlib import Path

import yaml

from rlsys import evaluations
from rlsys.console import HELD_OUT_NAMES, held_out, held_out_text
from rlsys.learner_figures import BATCH_REWARD, LOGPROB_ALARM, PROBE_ALARM, TIME_KEYS, WAIT_DATA, agent_figure, label
from rlsys.metrics import LEARNER_RECORDS, STEP, read_jsonl_metrics, records_file
from rlsys.prompt_ledger import describe
from rlsys.run_files import CONFIG_FILE, SUMMARY_FILE, logs_dir
from rlsys.run_privacy import write_private
from rlsys.token_continuity import PREFIX_BREAKS
from rlsys.tracing import TRACES_DIR, read_traces

REPORT_FILE = "summary.html"
TRACES_SHOWN = 4
FRAMES_SHOWN = 4
# The two logprob comparisons' figures (rlsys/alarms.py; the report reads the file, not torch): tokens sampled by the
# learner's own version, which an asynchronous run has at its first steps only, and the probe, which an inference
# worker scores after loading each version.
LOGPROB_ALARMS = {LOGPROB_ALARM: "sampled tokens", PROBE_ALARM: "probe"}

STYLE = """body{font-family:sans-serif;margin:2em;max-width:1100px;color:#222}
h1{font-size:1.5em} h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse} td,th{border:1px solid #ddd;padding:.25em .6em;text-align:left}
.msg{border-left:4px solid #aaa;margin:.4em 0;padding:.2em .6em;white-space:pre-wrap;font-family:monospace}
.assistant{border-color:#3366cc}.tool{border-color:#2a9d4b}.user,.prompt{border-color:#999}
.call{background:#eef7ee;padding:.1em .4em} .meta{color:#666;font-size:.9em} .warn{color:#b00}
figure{display:inline-block;margin:.5em} img{border:1px solid #ccc;max-width:100%}"""


def _run_paths(run_dir: Path) -> Path:
    """The run's metrics directory (config.yaml's logging_dir, else <run dir>/logs)."""
    config_file = run_dir / CONFIG_FILE
    saved = (yaml.safe_load(config_file.read_text()) or {}) if config_file.exists() else {}
    return logs_dir(run_dir, saved.get("logging_dir"))


def _rows(path: Path) -> list[dict]:
    return read_jsonl_metrics(path) if path.exists() else []


def _svg(fig) -> str:
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    svg = buffer.getvalue()
    return svg[svg.index("<svg"):]


def _curve(series: dict[str, tuple[list, list]], title: str, ylabel: str, xlabel: str = "step") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 3.2))
    for name, (x, y) in series.items():
        ax.plot(x, y, marker="o" if len(x) < 30 else None, markersize=3, label=name)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    return _svg(fig)


def _series(rows: list[dict], key: str, x: str = STEP) -> tuple[list, list]:
    points = [(r[x], r[key]) for r in rows if key in r]
    return [p[0] for p in points], [p[1] for p in points]


def time_curves(learner: list[dict]) -> tuple[dict[str, tuple[list, list]], str]:
    """Where each step's time went, and the plot's title. The first step's wait for data is the run's start-up
    (engines loading, the first evaluation), often longer than all the other steps together: with more steps than
    one, the plot starts at step 2 and its title says what step 1 waited."""
    shown = learner[1:] if len(learner) > 1 else learner
    times = {label(key): _series(shown, key) for key in TIME_KEYS if any(key in r for r in shown)}
    if shown is learner or WAIT_DATA not in learner[0]:
        return times, "Time per step"
    return times, f"Time per step (from step 2; step 1 waited {learner[0][WAIT_DATA]:.0f} s for the start-up)"


def _figures(learner: list[dict], held_out_curve: list[dict]) -> list[tuple[str, str]]:
    """(id, svg) of every curve the run has data for; `held_out_curve`: evaluations.curve's."""
    figures = []
    if learner:
        reward = {"reward (train, mean)": _series(learner, BATCH_REWARD)}
        figures.append(("reward-curve", _curve(reward, "Training reward", "reward")))
    evals = _series(held_out_curve, evaluations.ACCURACY, evaluations.VERSION)
    if evals[0]:
        figures.append(("accuracy-curve", _curve({"held-out accuracy": evals}, "Held-out accuracy (greedy)",
                                                 "accuracy", "version")))
    elif (evals := _series(held_out_curve, evaluations.REWARD_OF_ENDED, evaluations.VERSION))[0]:  # no successes
        figures.append(("held-out-reward-curve", _curve({"held-out mean reward of the episodes that ended": evals},
                                                        "Held-out mean reward (greedy)", "reward", "version")))
    times, title = time_curves(learner)
    if times:
        figures.append(("time-curve", _curve(times, title, "seconds")))
    alarms = {label(key): _series(learner, key)
              for prefix in LOGPROB_ALARMS for key in (f"{prefix}_abs_diff_mean", f"{prefix}_abs_diff_max")
              if any(key in r for r in learner)}
    if alarms:
        figures.append(("logprob-curve", _curve(alarms, "Inference vs learner logprobs", "nats")))
    return figures


def _table(rows: list[tuple[str, object]]) -> str:
    return "<table>" + "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
                               for k, v in rows) + "</table>"


def _time_split(learner: list[dict]) -> list[tuple[str, str]]:
    """The learner's seconds by what it did, as the time plot shows them: from step 2, the first step's wait for data
    being the run's start-up (engines loading, the first evaluation), which made waiting look like most of a short
    run's time; that wait on a row of its own."""
    shown = learner[1:] if len(learner) > 1 else learner
    totals = {key: sum(r.get(key, 0.0) for r in shown) for key in TIME_KEYS}
    whole = sum(totals.values()) or 1.0
    rows = [(label(key), f"{seconds:.1f} s ({100 * seconds / whole:.0f}%)") for key, seconds in totals.items()]
    if shown is not learner and WAIT_DATA in learner[0]:
        rows.append(("start-up (step 1's wait for data, left out above)", f"{learner[0][WAIT_DATA]:.1f} s"))
    return rows


def _alarm_rows(learner: list[dict], summary: dict) -> list[tuple[str, str]]:
    def worst(key):
        # NaN where any step's is: Python's max keeps or drops a NaN by where it stands, and a step whose logprobs
        # disagree by NaN is the worst there is (rlsys/alarms.py, largest; not imported: the report needs no torch)
        values = [r[key] for r in learner if key in r]
        return f"{max(values, key=lambda v: (math.isnan(v), v)):.4g}" if values else "n/a"

    breaks = [r[agent_figure(PREFIX_BREAKS)] for r in learner if agent_figure(PREFIX_BREAKS) in r]
    compared = sum(any(r.get(f"{prefix}_tokens") for prefix in LOGPROB_ALARMS) for r in learner)
    rows = [("steps with a train/inference logprob comparison", f"{compared} of {len(learner)}")]
    for prefix, what in LOGPROB_ALARMS.items():
        rows += [(f"{what}: logprob |diff| mean (worst step)", worst(f"{prefix}_abs_diff_mean")),
                 (f"{what}: logprob |diff| max (worst step)", worst(f"{prefix}_abs_diff_max")),
                 (f"{what}: logprob KL (worst step)", worst(f"{prefix}_kl"))]
    return rows + [("weight updates verified by checksum", summary.get("weight_checks", "n/a")),
                   ("token-prefix breaks per trajectory (worst step)",
                    f"{max(breaks):g}" if breaks else "n/a (single-turn)")]


def _message_html(message: dict) -> str:
    meta = f"{message['role']} · {message['tokens']} tokens"
    if message["role"] == "assistant":
        meta += (f" · versions {message['versions']} · reward {message['reward']}"
                 f" · mean logprob {message['logprob_mean']:.3f}")
    calls = "".join(f"<div class='call'>tool call: {html.escape(json.dumps(call))}</div>"
                    for call in message.get("tool_calls", []))
    return (f"<div class='msg {message['role']}'><div class='meta'>{html.escape(meta)}</div>"
            f"{html.escape(message['text'])}{calls}</div>")


def _trace_html(episode: dict) -> str:
    parts = [f"<details class='trace' open><summary>{html.escape(episode['tag'])} episode "
             f"<b>{html.escape(episode['episode_id'])}</b> · {episode['seconds']:.2f} s · "
             f"{len(episode['calls'])} model calls</summary>"]
    if episode["failure"]:
        parts.append(f"<p class='warn'>failed ({html.escape(episode['failure']['reason'])}): "
                     f"{html.escape(episode['failure']['detail'])}</p>")
    for t in episode["trajectories"][:2]:
        trained = t.get("trained")
        at_step = f" · trained at step {trained['step']}, advantage {trained['advantage']:.3f}" if trained else ""
        parts.append(f"<p class='meta'>trajectory {t['traj_id'][:8]} · reward {t['reward']:g} · "
                     f"stop {t['stop_reason']} · {t['generated_tokens']} generated tokens · versions {t['versions']}"
                     f"{at_step}</p>")
        parts += [_message_html(m) for m in t["messages"]]
    if len(episode["trajectories"]) > 2:
        parts.append(f"<p class='meta'>and {len(episode['trajectories']) - 2} more trajectories in the trace file</p>")
    return "".join(parts) + "</details>"


def _chosen_traces(episodes: list[dict]) -> list[dict]:
    """A few to look at: traced training episodes that were trained (the best and worst), any with tool
    calls, a failed one, and an evaluation episode."""
    train = [e for e in episodes if e["tag"] == "train" and e["trajectories"]]
    trained = [e for e in train if any("trained" in t for t in e["trajectories"])] or train
    by_reward = sorted(trained, key=lambda e: max(t["reward"] for t in e["trajectories"]))
    with_tools = [e for e in episodes if any(m.get("tool_calls") for t in e["trajectories"] for m in t["messages"])]
    failed = [e for e in episodes if e["failure"]]
    evals = [e for e in episodes if e["tag"] != "train"]
    chosen = []
    for e in with_tools[:1] + by_reward[-1:] + by_reward[:1] + failed[:1] + evals[-1:]:
        if all(e is not c for c in chosen):
            chosen.append(e)
    return chosen[:TRACES_SHOWN]


def _frames_html(run_dir: Path, frame_files: list[Path]) -> str:
    parts = []
    for path in frame_files[:FRAMES_SHOWN]:
        data = base64.b64encode(path.read_bytes()).decode()
        rel = path.relative_to(run_dir) if path.is_relative_to(run_dir) else path
        parts.append(f"<figure><a href='{html.escape(str(rel))}'><img alt='{html.escape(path.name)}' "
                     f"src='data:image/png;base64,{data}'></a>"
                     f"<figcaption>{html.escape(path.name)}</figcaption></figure>")
    return "".join(parts)


def build_report(run_dir: Path, frames_dir: Path | None = None) -> Path:
    """Writes `<run dir>/summary.html` from what the run left in its directory; returns its path."""
    run_dir = Path(run_dir)
    logs = _run_paths(run_dir)
    learner = _rows(records_file(logs, LEARNER_RECORDS))
    summary_file = run_dir / SUMMARY_FILE
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    episodes = read_traces(run_dir)
    frames_dir = frames_dir or run_dir / "frames"
    frame_files = sorted(frames_dir.glob("*.png")) if frames_dir.exists() else []

    title = f"rlsys run {run_dir.parent.name}/{run_dir.name}"
    figure, before, after = held_out(summary)
    headline = [("steps", len(learner)), ("minutes", f"{summary['minutes']:.1f}" if "minutes" in summary else "n/a"),
                *([("warm start minutes", f"{summary['warm_start_minutes']:.1f}")]
                  if summary.get("warm_start_minutes") else []),
                (f"held-out {HELD_OUT_NAMES[figure]} before", held_out_text(figure, before)),
                (f"held-out {HELD_OUT_NAMES[figure]} after", held_out_text(figure, after)),
                # a run that did not finish wrote no summary: what it restarted or set aside is not known, not none
                ("restarts", summary.get("restarts", {}) or "none" if summary else "n/a"),
                ("dead letters", summary.get("dead_letters", 0) if summary else "n/a"),
                ("requests and replies set aside", summary.get("messages_set_aside", 0) if summary else "n/a")]
    prompts = summary.get("prompts")
    body = [f"<h1>{html.escape(title)}</h1>", _table(headline),
            "<h2>Curves</h2><section id='curves'>"]
    body += [f"<figure id='{fid}'>{svg}</figure>" for fid, svg in _figures(learner, evaluations.curve(logs))]
    body.append("</section><h2>Where the time went (learner)</h2>" + _table(_time_split(learner)))
    body.append("<h2>Prompt accounting</h2>")
    body.append(f"<p id='accounting'>{html.escape(describe(prompts))}</p>" if prompts
                else f"<p>no {SUMMARY_FILE}: the run did not finish</p>")
    body.append("<h2>Correctness alarms</h2>" + _table(_alarm_rows(learner, summary)))
    trace_files = sorted((run_dir / TRACES_DIR).glob("*.jsonl")) if (run_dir / TRACES_DIR).exists() else []
    body.append(f"<h2>Traces</h2><p>{len(episodes)} episodes recorded: "
                + ", ".join(f"<a href='{TRACES_DIR}/{p.name}'>{p.name}</a>" for p in trace_files) + "</p>")
    body += [_trace_html(e) for e in _chosen_traces(episodes)]
    if frame_files:
        body.append(f"<h2>Frames</h2><p>{len(frame_files)} episodes in <a href='{html.escape(str(frames_dir))}'>"
                    f"{html.escape(str(frames_dir))}</a></p>" + _frames_html(run_dir, frame_files))
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>{''.join(body)}</body></html>")
    path = run_dir / REPORT_FILE
    write_private(path, page)
    return path


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python3 -m rlsys.report RUN_DIR (runs/<experiment>/<trial>)", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    if not (run_dir / CONFIG_FILE).is_file():  # every run writes it first: anything else is no run's directory
        below = sorted(str(p.parent) for p in run_dir.glob(f"**/{CONFIG_FILE}"))[:5] if run_dir.is_dir() else []
        why = f"no {CONFIG_FILE}" if run_dir.is_dir() else "no such directory"
        print(f"error: {run_dir} is not a run directory ({why}); a run's is runs/<experiment>/<trial>"
              + (f", such as {', '.join(below)}" if below else ""), file=sys.stderr)
        return 2
    if not (logs := _run_paths(run_dir)).is_dir():  # else a report of 0 steps, with no word of why
        print(f"error: {run_dir}'s metrics directory {logs} ({CONFIG_FILE}'s logging_dir, else "
              "<run dir>/logs) does not exist; a relative logging_dir is read from the current directory",
              file=sys.stderr)
        return 2
    print(build_report(run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
