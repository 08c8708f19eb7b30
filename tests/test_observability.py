"""What a person sees of a run: a short console, TensorBoard scalars, traces, the HTML report, and the
traces in MLflow's UI, the last two opened in a real headless browser (Debian's chromium)."""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from unittest.mock import Mock

import pytest

from rlsys.api import Trajectory
from rlsys.model.tokenizer import build_char_tokenizer
from rlsys.protocol import role_name
from rlsys.tracing import TraceWriter, read_traces
from tests.helpers import held_port, small_run_overrides

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
MAX_CONSOLE_LINES = 60


@pytest.fixture(scope="module")
def tiny_run(cache_dir, tmp_path_factory):
    """A finished 4-step run with every episode traced and the traces exported to MLflow: (run dir, console)."""
    out = tmp_path_factory.mktemp("observed")
    (out / "tmp").mkdir()  # the run's temp directory, to see what it leaves there
    args = small_run_overrides(cache_dir, out) + ["trial_name=t", "max_steps=4", "logging_steps=2",
                                                   "trace.sample_rate=1.0", "trace.mlflow=true"]
    proc = subprocess.run([sys.executable, str(ROOT / "training" / "main_async_ppo.py"), *args], cwd=out,
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(out / "tmp")})
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-3000:]
    return out / "async-ppo-math" / "t", console


def test_console_shows_progress_and_result_and_sends_library_output_to_role_logs(tiny_run):
    run_dir, console = tiny_run
    lines = console.splitlines()
    assert len(lines) < MAX_CONSOLE_LINES, console
    assert any(line.startswith("step     4/4") for line in lines), console
    assert any(line.startswith("held-out accuracy:") for line in lines) and any("report:" in line for line in lines)
    assert "<role>.log" in console and "Loading" not in console  # vLLM's and transformers' bars are in the logs
    assert "resource_tracker" not in console  # the inference process's quick exit leaves no semaphore to report
    inference_log = (run_dir / "logs" / "inference0.log").read_text()
    assert "version 1" in inference_log or "vllm" in inference_log.lower()


def test_a_role_killed_by_a_native_abort_leaves_its_python_stack_in_its_log(tmp_path):
    """A native library's abort ("terminate called ...") or segfault kills the process without a Python traceback:
    its log still says which Python code it was in."""
    log_file = tmp_path / "learner0.log"
    program = ("import os\nfrom pathlib import Path\nfrom rlsys.console import role_output_to_file\n"
               f"role_output_to_file(Path({str(log_file)!r}), 'learner0')\n"
               "def tearing_down_the_ranks():\n    os.abort()\ntearing_down_the_ranks()\n")
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -6
    log = log_file.read_text()
    assert "Fatal Python error: Aborted" in log and "in tearing_down_the_ranks" in log, log


FAILING_ROLE = """
import itertools
from pathlib import Path
from rlsys.console import role_output_to_file
from rlsys.workers.failure_log import FailureLog
log_file = Path({log_file!r})
role_output_to_file(log_file, "rollout0")
ticks = itertools.count()  # each look at the clock a second later: 300 failures take minutes
failures = FailureLog(log_file, clock=lambda: float(next(ticks)))
for i in range(300):
    failures.failed(f"train-0-{{i}}", "env_error",
                    f"BrokenEnv.step raised ImportError: no reward package {{i}} (at env.py:7 in step)")
failures.failed("train-0-300", "agent_error", "RuntimeError: a bug (at agent.py:3 in run)")
failures.close()
"""


def test_many_failed_episodes_reach_the_console_as_the_first_in_full_then_counts_and_the_log_as_each(tmp_path):
    """A broken reward fails every episode: the console says the first failure of its kind in full (its exception
    and where), then a count now and then instead of a line each, while the role's log keeps every one."""
    log_file = tmp_path / "rollout0.log"
    proc = subprocess.run([sys.executable, "-c", FAILING_ROLE.format(log_file=str(log_file))], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    console = proc.stderr.splitlines()
    in_full = [line for line in console if "failed (env_error): BrokenEnv.step raised ImportError" in line]
    assert in_full == ["rollout0 WARNING episode train-0-0 failed (env_error): BrokenEnv.step raised ImportError: "
                       "no reward package 0 (at env.py:7 in step)"], console
    counts = [re.fullmatch(rf"rollout0 WARNING (\d+) more episodes failed \(env_error\), (\d+) in all: see "
                           rf"{re.escape(str(log_file))}", line) for line in console if "more episodes" in line]
    assert all(counts) and 2 <= len(counts) <= 300 // 60 + 2, console  # one a minute at most, and the rest at the end
    assert sum(int(c[1]) for c in counts) == 299 and int(counts[-1][2]) == 300, console
    assert any("failed (agent_error): RuntimeError: a bug" in line for line in console), console
    assert len(console) == 1 + len(counts) + 1, console
    logged = re.findall(r"episode train-0-(\d+) failed \(env_error\): BrokenEnv.step raised ImportError: "
                        r"no reward package (\d+)", log_file.read_text())
    assert [int(qid) for qid, _ in logged] == list(range(300)) and all(qid == n for qid, n in logged)


def test_a_reason_whose_details_differ_each_time_is_said_in_full_three_times_then_counted(tmp_path, caplog):
    """A detail that names the episode's own values makes each failure a kind of its own: the console still hears of
    at most three in full, and counts the rest."""
    from rlsys.workers.failure_log import FailureLog

    failures = FailureLog(tmp_path / "rollout0.log", clock=lambda: 0.0)
    with caplog.at_level("INFO", logger="rlsys.workers.failure_log"):
        for i in range(10):
            failures.failed(f"train-0-{i}", "invalid_output",
                            f"group train-0-{i}: the same trajectory id appears twice")
        failures.close()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned[:3] == [f"episode train-0-{i} failed (invalid_output): group train-0-{i}: the same trajectory id "
                          "appears twice" for i in range(3)]
    assert warned[3:] == [f"7 more episodes failed (invalid_output), 10 in all: see {tmp_path / 'rollout0.log'}"]
    assert sum("failed (invalid_output): group" in r.getMessage() for r in caplog.records) == 10


def test_a_finished_run_leaves_nothing_in_the_temp_directory(tiny_run):
    run_dir, _ = tiny_run
    left = [p.name for p in (run_dir.parents[1] / "tmp").iterdir()
            if not p.name.startswith("torchinductor_")]  # torch's compile cache, kept across runs on purpose
    assert left == []  # vLLM's rendezvous file (vllm_dist_*) was left by every run


def test_tensorboard_files_hold_reward_and_accounting_scalars(tiny_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = tiny_run
    learner = EventAccumulator(str(run_dir / "logs" / "tensorboard" / "learner"))
    learner.Reload()
    tags = set(learner.Tags()["scalars"])
    assert {"reward", "prompts/admitted", "prompts/trained", "alarms/logprob_abs_diff_mean"} <= tags, tags
    assert [e.step for e in learner.Scalars("reward")] == [1, 2, 3, 4]
    assert learner.Scalars("prompts/trained")[-1].value == 4 * 16  # ppo.batch_size prompts per step
    rollout = EventAccumulator(str(run_dir / "logs" / "tensorboard" / "rollout0"))
    rollout.Reload()
    assert "eval/accuracy" in rollout.Tags()["scalars"]


def test_traces_follow_each_episode_from_the_model_calls_to_the_gradient(tiny_run):
    run_dir, _ = tiny_run
    episodes = read_traces(run_dir)
    train = [e for e in episodes if e["tag"] == "train" and e["trajectories"]]
    evals = [e for e in episodes if e["tag"] in ("initial", "final")]
    assert len(evals) == 2 * 200  # every evaluation episode, before and after
    trained = [t for e in train for t in e["trajectories"] if "trained" in t]
    assert len(trained) == 4 * 16 * 8  # every trajectory of every step (sample rate 1), with its step
    assert {t["trained"]["step"] for t in trained} == {1, 2, 3, 4}
    groups: dict[str, list[dict]] = {}
    for t in trained:
        groups.setdefault(t["group_id"], []).append(t)
    assert len(groups) == 4 * 16 and all(len(members) == 8 for members in groups.values())
    for members in groups.values():  # GRPO: above the group's mean reward a positive advantage, below a negative one
        mean = sum(t["reward"] for t in members) / len(members)
        for t in members:
            above = t["reward"] - mean
            assert t["trained"]["advantage"] * above > 0 if abs(above) > 1e-6 else t["trained"]["advantage"] == 0
    episode = train[0]
    assert episode["calls"] and episode["calls"][0]["seconds"] > 0 and episode["calls"][0]["output_tokens"]
    t = episode["trajectories"][0]
    assert [m["role"] for m in t["messages"]] == ["prompt", "assistant"] and t["messages"][0]["text"].endswith("=")
    assert t["messages"][1]["tokens"] == t["generated_tokens"] and t["messages"][1]["reward"] == t["reward"]
    summary = json.loads((run_dir / "summary.json").read_text())
    # Every version the worker loaded was verified by checksum, the final one too (the final evaluation waits for it).
    # Not one per step: two versions published within one of the worker's checks are loaded as the newer one.
    loaded = re.findall(r"version (\d+) loaded", (run_dir / "logs" / "inference0.log").read_text())
    assert summary["weight_checks"] == len(loaded) >= 1 and loaded[-1] == "4"


def chromium(*args: str, timeout: float = 120) -> str:
    proc = subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--hide-scrollbars", *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is installed by scripts/install.sh --tests")


@needs_chromium
def test_report_opens_in_a_browser_with_curves_accounting_and_traces(tiny_run, tmp_path):
    run_dir, _ = tiny_run
    url = (run_dir / "summary.html").as_uri()
    dom = chromium("--dump-dom", url)
    for figure in ("reward-curve", "accuracy-curve", "time-curve", "logprob-curve"):
        assert f'id="{figure}"><svg' in dom, figure
    assert "prompts: " in dom and " trained + " in dom and "weight updates verified by checksum" in dom
    assert dom.count('class="trace"') >= 2
    screenshot = run_dir / "summary.png"  # kept with the run, under pytest's tmp dir
    chromium(f"--screenshot={screenshot}", "--window-size=1200,2400", url)
    assert screenshot.stat().st_size > 20_000


def tool_episode(run_dir: Path, tokenizer_dir: Path) -> None:
    """One traced episode of a tool-using agent: a calculator call, its result, then the answer."""
    tokenizer = build_char_tokenizer()
    parts = [("What is 12*34?\n", 0),
             ('<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>', 1),
             ("<tool_response>408</tool_response>\n", 0), ("<answer>408</answer>", 1)]
    ids, mask, ends = [], [], []
    for text, generated in parts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        mask += [generated] * (len(ids) - len(mask))
        if generated:
            ends.append(len(ids))
    t = Trajectory(token_ids=ids, loss_mask=mask, logprobs=[-0.5 * m for m in mask], versions=[m - 1 for m in mask],
                   turn_ends=ends, turn_rewards=[0.0, 1.0], reward=1.0, group_id="train-0-7", stop_reason="stop")
    writer = TraceWriter(run_dir, "rollout0", tokenizer, sample_rate=1.0)
    started = time.time() - 2
    writer.record("train-0-7", "train", started, [t], None,
                  [{"qid": "train-0-7/1", "sent": started, "seconds": 0.5, "worker": 0, "prompt_tokens": 15,
                    "output_tokens": [70]}, {"qid": "train-0-7/2", "sent": started + 1, "seconds": 0.4, "worker": 0,
                                             "prompt_tokens": 120, "output_tokens": [20]}])
    writer.close()


@contextlib.contextmanager
def mlflow_server(uri: str, cwd: Path):
    """An MLflow tracking server of store `uri` on 127.0.0.1, once it answers: (its process, its port), stopped after
    the block. Its port is held (held_port) until then: no other process takes it before the server binds it (uvicorn
    binds with SO_REUSEADDR), nor listens there once the server stopped."""
    with held_port() as port:
        server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri,
                                   "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise AssertionError("mlflow server did not start") from None
                    time.sleep(0.5)
            yield server, port
        finally:
            stop_server(server)


def stop_server(server: subprocess.Popen) -> None:
    """The server and the workers it started (its session), asked to stop and, past 30 s, killed: at a load average
    of 17 the server once took longer than that to stop after the test had passed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)


@needs_chromium
def test_mlflow_ui_shows_a_traced_run_with_its_tool_calls(tmp_path, tokenizer_dir, monkeypatch):
    import mlflow

    from rlsys.mlflow_export import export_run

    run_dir = tmp_path / "tools-experiment" / "t"
    tool_episode(run_dir, tokenizer_dir)
    assert read_traces(run_dir)[0]["trajectories"][0]["messages"][1]["tool_calls"] == [
        {"name": "calculator", "arguments": {"expression": "12*34"}}]
    monkeypatch.chdir(tmp_path / "tools-experiment")
    uri = export_run(run_dir)
    # The export stays in the run directory: nothing lands in the working directory, and the experiment keeps
    # its artifacts under the run. (Whether MLflow writes any artifact at all is its own race: its background
    # queue stores the spans in the database when they arrive before the trace, else as an artifact.)
    assert sorted(p.name for p in Path(".").iterdir()) == ["t"]
    mlflow.set_tracking_uri(uri)
    assert mlflow.get_experiment_by_name("tools-experiment/t").artifact_location == \
        (run_dir / "mlflow-artifacts").resolve().as_uri()
    (trace,) = mlflow.search_traces(locations=[mlflow.get_experiment_by_name("tools-experiment/t").experiment_id],
                                    return_type="list")
    assert [s.name for s in trace.data.spans if s.span_type == "TOOL"] == ["calculator"]
    with mlflow_server(uri, tmp_path) as (_, port):
        experiment_id = mlflow.get_experiment_by_name("tools-experiment/t").experiment_id
        url = (f"http://127.0.0.1:{port}/#/experiments/{experiment_id}/traces"
               f"?selectedEvaluationId={trace.info.trace_id}")
        dom = chromium("--dump-dom", "--virtual-time-budget=30000", url, timeout=180)
        assert "episode train-0-7" in dom and "calculator" in dom, dom[-3000:]
        screenshot = tmp_path / "mlflow-trace.png"
        chromium(f"--screenshot={screenshot}", "--window-size=1400,900", "--virtual-time-budget=30000", url,
                 timeout=180)
        assert screenshot.stat().st_size > 10_000


def test_frames_show_each_board_with_its_move_and_reward(tmp_path):
    from PIL import Image

    from rlsys.frames import render_episode

    boards = ["S.\n.G", ".S\n.G", "..\n.S"]
    messages = [{"role": "prompt", "text": boards[0]}, {"role": "assistant", "text": "R", "reward": 0.0},
                {"role": "user", "text": boards[1]}, {"role": "assistant", "text": "D", "reward": 1.0},
                {"role": "user", "text": boards[2]}]
    record = {"tag": "train", "episode_id": "train-0-3", "trajectories": [{"messages": messages, "reward": 1.0}]}
    png, gif = render_episode(record, tmp_path / "frames")
    strip, animation = Image.open(png), Image.open(gif)
    assert animation.n_frames == 3  # two moves and the board after the last
    assert strip.width > 2.5 * animation.width / 1.5 and strip.height == animation.height


def test_the_time_plot_leaves_the_first_steps_start_up_wait_out():
    from rlsys.report import time_curves

    rows = [{"step": s, "time/wait_data": w, "time/compute": 0.5} for s, w in ((1, 95.0), (2, 0.1), (3, 0.2))]
    times, title = time_curves(rows)
    assert times["wait_data"] == ([2, 3], [0.1, 0.2]) and times["compute"] == ([2, 3], [0.5, 0.5])
    assert title == "Time per step (from step 2; step 1 waited 95 s for the start-up)"
    assert time_curves(rows[:1]) == ({"wait_data": ([1], [95.0]), "compute": ([1], [0.5])}, "Time per step")


def test_the_summary_counts_the_held_out_episodes_that_failed_before_and_after(tmp_path):
    from rlsys import evaluations
    from rlsys.bus.inproc import InProcessBus
    from rlsys.run_summary import held_out_summary

    bus = InProcessBus()
    evaluations.record(bus, evaluations.INITIAL, {"accuracy": 0.59, "reward": 0.72, "episodes": 82, "failed": 18})
    evaluations.record(bus, evaluations.FINAL, {"accuracy": 0.6, "reward": 0.73, "episodes": 83, "failed": 17})
    figures = held_out_summary(bus, {}, tmp_path)
    assert (figures["initial_failed"], figures["final_failed"]) == (18, 17)


def held_out_rows(reward_key: str) -> list[dict]:
    """Three evaluations' rows of a run whose episodes have no success, their mean reward under `reward_key`."""
    return [{"step": v, reward_key: r, "eval/version": v, "eval/episodes": 100}
            for v, r in ((0, -0.16), (50, 0.42), (100, 1.0))]


def said_of(logs: Path, rows: list[dict], capsys) -> str:
    """What the console's progress lines say of evaluations `rows` in rollout worker 0's records in `logs`."""
    from rlsys.console import ProgressReporter

    (logs / "rollout0.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    ProgressReporter(logs / "learner.jsonl", every=10, max_steps=100, quiet_seconds=3600,
                     evaluations_file=logs / "rollout0.jsonl")()
    return capsys.readouterr().out


def test_a_run_from_before_the_held_out_reward_was_renamed_keeps_it_in_its_report_console_and_resume(tmp_path, capsys):
    """Records and checkpoints written before 2026-12-07 hold the held-out mean reward of the episodes that ended as
    `reward`: read back under its name now, or a report rebuilt for such a run lost its curve and a resume its
    "before" figure."""
    from rlsys import evaluations
    from rlsys.bus.inproc import InProcessBus
    from rlsys.report import build_report
    from rlsys.run_summary import held_out_summary

    logs = tmp_path / "logs"
    logs.mkdir()
    rows = held_out_rows("eval/reward")
    assert said_of(logs, rows, capsys) == \
        "step    50/100  held-out mean reward of the episodes that ended 0.420 (greedy, 100 problems)\n"
    assert "id='held-out-reward-curve'" in build_report(tmp_path).read_text()

    bus = InProcessBus()  # resumed from a checkpoint that kept the run's first evaluation under the earlier name
    evaluations.record(bus, evaluations.INITIAL, {"reward_of_ended": 0.5, "version": 80, "episodes": 100})
    figures = held_out_summary(bus, {"step": 80, "initial_eval": {"reward": -0.16, "episodes": 100}}, logs)
    assert figures["initial_reward_of_ended"] == -0.16 and figures["resumed"]["reward_of_ended"] == 0.5
    assert [e[evaluations.REWARD_OF_ENDED] for e in figures["held_out_curve"]] == [-0.16, 0.42, 1.0]


def test_a_run_whose_episodes_have_no_success_reports_their_mean_reward_and_no_accuracy(tmp_path, capsys):
    """Rewards from a reward model or TRL's functions are scores, not verdicts: the console, the last line and the
    report call the held-out figure what it is."""
    from rlsys.console import held_out_line
    from rlsys.report import build_report

    logs = tmp_path / "logs"
    logs.mkdir()
    rows = held_out_rows("eval/reward_of_ended")
    assert said_of(logs, rows, capsys) == \
        "step    50/100  held-out mean reward of the episodes that ended 0.420 (greedy, 100 problems)\n"
    rows[1].update({"eval/episodes": 97, "eval/failed": 3})  # failed episodes: among the problems, and named
    assert said_of(logs, rows, capsys) == \
        "step    50/100  held-out mean reward of the episodes that ended 0.420 (greedy, 100 problems, 3 failed)\n"

    summary = {"initial_accuracy": None, "final_accuracy": None, "initial_reward_of_ended": -0.16,
               "final_reward_of_ended": 1.0,
               "steps": 100, "minutes": 1.25}
    assert held_out_line(summary) == "held-out mean reward of the episodes that ended: -0.160 before, " \
                                      "1.000 after 100 steps (+1.160) in 1.2 min"
    assert held_out_line({**summary, "initial_accuracy": 0.5, "final_accuracy": 0.625}) == \
        "held-out accuracy: 50.0% before, 62.5% after 100 steps (+12.5 points) in 1.2 min"
    assert held_out_line({**summary, "steps": 1}).startswith(
        "held-out mean reward of the episodes that ended: -0.160 before, 1.000 after 1 step ")
    assert held_out_line({**summary, "initial_accuracy": 0.5, "final_reward_of_ended": None}) == \
        "held-out accuracy: 50.0% before, n/a after 100 steps in 1.2 min"  # stopped before its final evaluation
    # resumed at step 80: the run's 100 steps did not take the last launch's 1.2 minutes
    assert held_out_line({**summary, "initial_accuracy": 0.5, "final_accuracy": 0.625, "resumed": {"step": 80}}) == \
        "held-out accuracy: 50.0% before, 62.5% after 100 steps (+12.5 points) in 1.2 min since its resume at step 80"
    # a first run's warm start is said apart from the run's minutes, which no longer count it
    assert held_out_line({**summary, "initial_accuracy": 0.5, "final_accuracy": 0.625, "warm_start_minutes": 1.1}) \
        == "held-out accuracy: 50.0% before, 62.5% after 100 steps (+12.5 points) in 1.2 min, after a 1.1 min " \
           "warm start"
    assert held_out_line({**summary, "warm_start_minutes": 0.0}) == held_out_line(summary)
    # held-out episodes that failed (an environment that raised or hung) are said: an accuracy counts them unsolved,
    # a mean reward leaves them out, and without this the last line read as a model that got them wrong
    assert held_out_line({**summary, "initial_accuracy": 0.5, "final_accuracy": 0.5, "initial_failed": 18,
                          "final_failed": 17}) == \
        "held-out accuracy: 50.0% before, 50.0% after 100 steps (+0.0 points) in 1.2 min; held-out episodes " \
        "failed: 18 before, 17 after (counted unsolved)"
    assert held_out_line({**summary, "initial_failed": 0, "final_failed": 2}).endswith(
        "in 1.2 min; held-out episodes failed: 0 before, 2 after (left out of the mean)")
    assert held_out_line({**summary, "initial_failed": 0, "final_failed": 0}) == held_out_line(summary)
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "warm_start_minutes": 1.1}))
    page = build_report(tmp_path).read_text()
    assert "<th>minutes</th><td>1.2</td>" in page and "<th>warm start minutes</th><td>1.1</td>" in page
    assert "<th>held-out mean reward of the episodes that ended before</th><td>-0.160</td>" in page
    assert "<th>held-out mean reward of the episodes that ended after</th><td>1.000</td>" in page
    assert "id='held-out-reward-curve'" in page and "accuracy" not in page.lower().replace("accuracy-curve", "")


def test_the_report_command_refuses_what_is_no_run_directory_and_names_the_runs_below(tmp_path, capsys):
    """`python3 -m rlsys.report runs` wrote an empty runs/summary.html and exited 0."""
    from rlsys.report import main

    run_dir = tmp_path / "runs" / "async-ppo-math" / "t1"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("experiment: async-ppo-math\n")
    assert main([str(tmp_path / "runs")]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'runs'} is not a run directory (no config.yaml); "
                                       f"a run's is runs/<experiment>/<trial>, such as {run_dir}\n")
    assert main([str(tmp_path / "nowhere")]) == 2 and "(no such directory)" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "summary.html").exists()
    assert main([str(run_dir)]) == 0 and (run_dir / "summary.html").is_file()
    # a run that did not finish: its restarts and dead letters are unknown, and were shown as "none" and 0
    page = (run_dir / "summary.html").read_text()
    assert "<th>restarts</th><td>n/a</td>" in page and "<th>dead letters</th><td>n/a</td>" in page
    assert "<th>requests and replies set aside</th><td>n/a</td>" in page
    # a logging_dir the report cannot find (relative, run from another directory): said, not a report of 0 steps
    (run_dir / "config.yaml").write_text("experiment: async-ppo-math\nlogging_dir: elsewhere/logs\n")
    assert main([str(run_dir)]) == 2
    assert "metrics directory elsewhere/logs (config.yaml's logging_dir" in capsys.readouterr().err


def test_the_report_shows_the_probe_that_compares_logprobs_at_every_step(tmp_path):
    """An asynchronous run compares the sampled tokens' logprobs at its first steps only; the probe, at every step.
    The report showed the first alone, as if the run had been checked once."""
    from rlsys.report import build_report

    logs = tmp_path / "logs"
    logs.mkdir()
    rows = [{"step": 1, "alarms/logprob_tokens": 40.0, "alarms/logprob_abs_diff_mean": 0.001,
             "alarms/logprob_abs_diff_max": 0.004, "alarms/logprob_kl": 1e-6, "alarms/probe_tokens": 0.0},
            {"step": 2, "alarms/logprob_tokens": 0.0, "alarms/probe_tokens": 12.0, "alarms/probe_abs_diff_mean": 0.02,
             "alarms/probe_abs_diff_max": 0.05, "alarms/probe_kl": 2e-4},
            {"step": 3, "alarms/logprob_tokens": 0.0}]
    (logs / "learner.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    page = build_report(tmp_path).read_text()
    assert "<th>steps with a train/inference logprob comparison</th><td>2 of 3</td>" in page
    assert "<th>probe: logprob |diff| max (worst step)</th><td>0.05</td>" in page
    assert "<th>sampled tokens: logprob |diff| max (worst step)</th><td>0.004</td>" in page
    assert "id='logprob-curve'" in page and "probe_abs_diff_mean" in page


def test_the_report_s_worst_step_is_nan_where_a_step_s_logprobs_disagreed_by_nan(tmp_path):
    """Python's max keeps a NaN only where it comes first: a NaN step between finite ones was reported as the finite
    worst, the one step that most needed a look hidden."""
    from rlsys.report import build_report

    logs = tmp_path / "logs"
    logs.mkdir()
    rows = [{"step": step, "alarms/probe_tokens": 12.0, "alarms/probe_abs_diff_mean": value,
             "alarms/probe_abs_diff_max": value, "alarms/probe_kl": value}
            for step, value in ((1, 0.01), (2, float("nan")), (3, 0.02))]
    (logs / "learner.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    page = build_report(tmp_path).read_text()
    for figure in ("|diff| mean", "|diff| max", "KL"):
        assert f"<th>probe: logprob {figure} (worst step)</th><td>nan</td>" in page


def test_metrics_files_are_strict_json_and_their_readers_get_non_finite_numbers_back(tmp_path):
    """learner.jsonl held bare NaN, which Python's json reads and `jq` and strict JSON parsers refuse."""
    import math

    from rlsys.metrics import JsonlFollower, MetricsLogger, read_jsonl_metrics
    from rlsys.report import build_report

    logger = MetricsLogger(tmp_path / "logs", "learner")
    values = (0.01, math.nan, math.inf, -math.inf)
    for step, value in enumerate(values, 1):
        logger.log(step, {"alarms/probe_tokens": 12.0, "alarms/probe_abs_diff_mean": value,
                          "alarms/probe_abs_diff_max": value, "alarms/probe_kl": value, "loss": value})
    logger.close()
    path = tmp_path / "logs" / "learner.jsonl"

    def refused(constant):
        raise ValueError(f"{constant} is not JSON")

    for line in path.read_text().splitlines():
        json.loads(line, parse_constant=refused)  # as strictly as jq
    for rows in (read_jsonl_metrics(path), JsonlFollower(path)()):
        assert [repr(row["loss"]) for row in rows] == ["0.01", "nan", "inf", "-inf"]
        assert [row["step"] for row in rows] == [1, 2, 3, 4]
    page = build_report(tmp_path).read_text()  # the worst step is still the NaN one
    assert "<th>probe: logprob |diff| max (worst step)</th><td>nan</td>" in page


def test_where_the_learner_s_time_went_leaves_the_start_up_out_as_the_plot_does(tmp_path):
    """Step 1's wait for data is the run's start-up: counted with the rest, a short run's learner looked as if it
    waited for data most of its time (82% in a 10-step run whose steps waited 13%)."""
    from rlsys.report import build_report

    logs = tmp_path / "logs"
    logs.mkdir()
    rows = [{"step": s, "time/wait_data": w, "time/compute": 0.5, "time/publish": 0.0, "time/save": 0.0}
            for s, w in ((1, 95.0), (2, 0.25), (3, 0.25))]
    (logs / "learner.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    page = build_report(tmp_path).read_text()
    assert "<th>wait_data</th><td>0.5 s (33%)</td>" in page and "<th>compute</th><td>1.0 s (67%)</td>" in page
    assert "<th>start-up (step 1&#x27;s wait for data, left out above)</th><td>95.0 s</td>" in page


def test_a_resumed_run_exports_to_mlflow_only_what_the_export_before_did_not(tmp_path, tokenizer_dir):
    """Each launch of a run exports at its end; a run resumed in its directory made a second MLflow run holding every
    step again and a second copy of each earlier trace."""
    import mlflow

    from rlsys.mlflow_export import export_run

    run_dir = tmp_path / "tools-experiment" / "t"
    logs = run_dir / "logs"
    logs.mkdir(parents=True)
    rows = [{"step": step, "reward": step / 10} for step in range(1, 6)]
    (logs / "learner.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:3]))
    tool_episode(run_dir, tokenizer_dir)
    uri = export_run(run_dir)
    (logs / "learner.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))  # the resumed launch's
    tool_episode(run_dir, tokenizer_dir)  # a second episode, in the traces beside the first
    assert len(read_traces(run_dir)) == 2
    export_run(run_dir)
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.get_experiment_by_name("tools-experiment/t").experiment_id
    (run,) = mlflow.search_runs([experiment], output_format="list")
    history = mlflow.tracking.MlflowClient().get_metric_history(run.info.run_id, "reward")
    assert sorted((m.step, m.value) for m in history) == [(r["step"], r["reward"]) for r in rows]
    assert len(mlflow.search_traces(locations=[experiment], return_type="list")) == 2


def test_an_agent_metric_whose_name_mlflow_refuses_costs_the_export_nothing(tmp_path, tokenizer_dir):
    """An agent's metrics are named by the agent (`agent/pass@1`): MLflow refused that name, and with it the whole
    batch, so the run's end exported not one metric and not one trace (a warning in the log said only that)."""
    import mlflow

    from rlsys.mlflow_export import export_run

    run_dir = tmp_path / "exp" / "t"
    logs = run_dir / "logs"
    logs.mkdir(parents=True)
    (logs / "learner.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5, "agent/pass@1": 0.25,
                                                    "agent/" + "x" * 300: 1.0}) + "\n")
    tool_episode(run_dir, tokenizer_dir)
    mlflow.set_tracking_uri(export_run(run_dir))
    experiment = mlflow.get_experiment_by_name("exp/t").experiment_id
    (run,) = mlflow.search_runs([experiment], output_format="list")
    assert run.data.metrics == {"reward": 0.5, "agent.pass_1": 0.25, ("agent." + "x" * 300)[:250]: 1.0}
    assert len(mlflow.search_traces(locations=[experiment], return_type="list")) == 1


def test_the_mlflow_export_takes_every_rollout_workers_episodes(tmp_path):
    """Each worker's trace file is in the order its episodes ended, one file after the other: the export took the
    newest end it had exported so far for the exports before's mark, and skipped every episode of rollout1 that ended
    before rollout0's last."""
    import mlflow

    from rlsys.mlflow_export import export_run

    run_dir = tmp_path / "two-workers" / "t"
    (run_dir / "traces").mkdir(parents=True)
    start = time.time() - 100

    def episode(worker: int, ended: float) -> dict:
        return {"episode_id": f"train-{worker}-{ended:g}", "tag": "train", "started": start + ended - 1,
                "ended": start + ended, "seconds": 1.0, "failure": None, "calls": [], "trajectories": []}

    for worker, ends in ((0, (1, 3, 5)), (1, (2, 4, 6))):  # their episodes ended in turn
        (run_dir / "traces" / f"{role_name('rollout', worker)}.jsonl").write_text(
            "".join(json.dumps(episode(worker, end)) + "\n" for end in ends))
    mlflow.set_tracking_uri(export_run(run_dir))
    experiment = mlflow.get_experiment_by_name("two-workers/t").experiment_id
    names = {s.name for trace in mlflow.search_traces(locations=[experiment], return_type="list")
             for s in trace.data.spans}
    assert names == {f"episode train-{w}-{end}" for w, ends in ((0, (1, 3, 5)), (1, (2, 4, 6))) for end in ends}


def test_a_rollout_worker_killed_mid_record_costs_the_report_only_that_record(tmp_path, tokenizer_dir):
    """A trace writer killed with part of its buffer written leaves a record cut short; its restarted successor
    appended its first record to that line, and the report (and the MLflow export) of the run failed on it."""
    from rlsys.report import build_report

    run_dir = tmp_path / "exp" / "t"
    tool_episode(run_dir, tokenizer_dir)
    trace_file = run_dir / "traces" / "rollout0.jsonl"
    whole = trace_file.read_text()
    with trace_file.open("a") as file:
        file.write(whole[:len(whole) // 2])  # the killed writer's last piece
    (run_dir / "traces" / "trained.jsonl").write_text('{"traj_id": "x", "gro')  # and the learner's
    tool_episode(run_dir, tokenizer_dir)  # the restarted worker's episode
    episodes = read_traces(run_dir)
    assert [e["episode_id"] for e in episodes] == ["train-0-7", "train-0-7"]
    assert "2 episodes recorded" in build_report(run_dir).read_text()


def test_the_mlflow_export_at_a_runs_end_takes_the_learner_metrics_from_its_logging_dir(tmp_path, tokenizer_dir,
                                                                                        capsys):
    """With logging_dir set, the run's end exported to MLflow the traces without a single learner metric: it looked
    for learner.jsonl under <run dir>/logs. The export is said before it begins: it may take minutes."""
    import mlflow

    from experiments import AsyncPPOMATHConfig
    from rlsys.launcher import finish_observability

    run_dir, logs = tmp_path / "exp" / "t", tmp_path / "elsewhere"
    logs.mkdir()
    (logs / "learner.jsonl").write_text("".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in (1, 2)))
    tool_episode(run_dir, tokenizer_dir)
    config = AsyncPPOMATHConfig()
    config.logging_dir, config.trace.mlflow = str(logs), True
    finish_observability(config, run_dir)
    uri = f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
    assert capsys.readouterr().out.splitlines()[1:] == [
        f"exporting the traces and learner metrics to MLflow at {uri}",
        f"traces in MLflow: mlflow ui --backend-store-uri {uri}"]
    mlflow.set_tracking_uri(uri)
    (run,) = mlflow.search_runs([mlflow.get_experiment_by_name("exp/t").experiment_id], output_format="list")
    history = mlflow.tracking.MlflowClient().get_metric_history(run.info.run_id, "reward")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.1), (2, 0.2)]


def test_a_relative_logging_dir_is_saved_absolute_so_the_report_finds_it_from_anywhere(tmp_path, monkeypatch):
    from rlsys.cli import parse_config

    monkeypatch.chdir(tmp_path)
    config = parse_config([f"output_dir={tmp_path / 'runs'}", "trial_name=t", "logging_dir=mylogs",
                           f"dataset.path={tmp_path / 'missing.jsonl'}"])
    # a start that passed its checks and saved its config (a refused one leaves none); no role starts
    launch_until_the_roles_start(config, monkeypatch)
    saved = (tmp_path / "runs" / "async-ppo-math" / "t" / "config.yaml").read_text()
    assert f"logging_dir: {tmp_path / 'mylogs'}\n" in saved


def launch_until_the_roles_start(config, monkeypatch) -> None:
    """`launch(config)` as far as a start that passed its checks goes (prepare's reading of the model and data
    skipped): its placement made and its bus started, which is when it changes the trial (run_start.begin_trial); no
    role starts."""
    from rlsys.launcher import launch

    monkeypatch.setattr("rlsys.launcher.prepare", lambda config: None)
    monkeypatch.setattr("rlsys.launcher.Supervisor", Mock(side_effect=RuntimeError("the roles would start here")))
    with pytest.raises(RuntimeError, match="the roles would start here"):
        launch(config)


def test_a_resumed_launch_takes_its_last_launch_s_summary_away(tmp_path, monkeypatch):
    """Left in place, a resumed launch that then crashed had its report show the last launch's result and prompt
    accounting beside the newer steps, as if the run had ended there. Taken once the start's checks pass: a refused
    start leaves the trial as it was (tests/test_bad_input.py)."""
    from rlsys.cli import parse_config

    run_dir = tmp_path / "runs" / "async-ppo-math" / "t"
    checkpoint = run_dir / "checkpoints" / "step_2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 2, "version": 2}))
    (run_dir / "summary.json").write_text(json.dumps({"steps": 2, "held_out": {}}))
    config = parse_config([f"output_dir={tmp_path / 'runs'}", "trial_name=t", "resume_from_checkpoint=auto",
                           f"dataset.path={tmp_path / 'missing.jsonl'}"])
    # a start that passed its checks; no role starts
    launch_until_the_roles_start(config, monkeypatch)
    assert not (run_dir / "summary.json").exists()


def test_the_mlflow_tracking_uri_is_printed_without_its_password(tmp_path, monkeypatch, capsys):
    """The launcher printed the URI whole: https://user:PASSWORD@host went into the console and the logs."""
    from rlsys import mlflow_export
    from rlsys.cli import parse_config
    from rlsys.launcher import finish_observability

    exported = []
    monkeypatch.setattr(mlflow_export, "export_run", lambda run_dir, uri, logs: exported.append(uri))
    uri = "https://user:s3cret-pass@mlflow.example:5000"
    config = parse_config(["trace.mlflow=true", f"trace.mlflow_tracking_uri={uri}", f"logging_dir={tmp_path}"])
    (tmp_path / "config.yaml").touch()
    finish_observability(config, tmp_path)
    console = capsys.readouterr().out
    assert exported == [uri]  # the export itself has the password
    assert "s3cret-pass" not in console and "mlflow ui --backend-store-uri https://user:REDACTED@mlflow.example:5000" \
        in console, console


def test_a_database_mlflow_store_that_cannot_be_reached_is_refused_at_the_start_naming_the_key(tmp_path, monkeypatch):
    """A database tracking URI was left to MLflow, which opened it only at the run's end: a database server where
    nothing listens, or a sqlite file below a file, failed the export after the whole run."""
    from rlsys import assets
    from rlsys.cli import parse_config
    from rlsys.launcher import prepare
    from rlsys.preflight import StartupError

    class Checked(Exception):
        """The store can be had: prepare went on to the dataset and the model."""

    def checked(config):
        raise Checked

    def prepared(uri):
        prepare(parse_config(["trace.mlflow=true", f"trace.mlflow_tracking_uri={uri}"]))

    monkeypatch.setattr(assets, "prepare_assets", checked)
    with held_port() as port:  # where nothing listens
        for scheme in ("postgresql", "mysql+pymysql"):
            with pytest.raises(StartupError) as refused:
                prepared(f"{scheme}://mlflow:s3cret@127.0.0.1:{port}/runs")
            assert str(refused.value).startswith(
                f"trace.mlflow_tracking_uri={scheme}://mlflow:REDACTED@127.0.0.1:{port}/runs: no database server "
                f"answered (nothing answered at 127.0.0.1:{port}: Connection refused)"), refused.value
    (tmp_path / "a-file").touch()
    with pytest.raises(StartupError, match=f"trace.mlflow_tracking_uri=sqlite:///{tmp_path}/a-file/m.db: "
                                           f"{tmp_path}/a-file is not a directory"):
        prepared(f"sqlite:///{tmp_path}/a-file/m.db")
    with pytest.raises(StartupError, match="its password is REDACTED, as the saved config.yaml keeps it"):
        prepared("https://user:REDACTED@mlflow.example:5000")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with pytest.raises(Checked):
            prepared(f"postgresql://mlflow:s3cret@127.0.0.1:{server.getsockname()[1]}/runs")
    with pytest.raises(Checked):  # a directory to be made: MLflow makes it
        prepared(f"sqlite:///{tmp_path}/new/dir/m.db")
    assert not (tmp_path / "new").exists()


@pytest.mark.skipif(os.geteuid() == 0 and not shutil.which("setpriv"), reason="root writes anywhere without setpriv")
def test_an_mlflow_sqlite_file_this_user_may_not_write_is_refused_at_the_start_naming_the_key_and_the_path(tmp_path):
    """The check runs in a process that honours file modes: root (the suite's user here) writes in any directory,
    unless it drops CAP_DAC_OVERRIDE, as setpriv does for the process it starts."""
    (tmp_path / "read-only").mkdir()
    (tmp_path / "read-only" / "m.db").touch()
    (tmp_path / "read-only" / "m.db").chmod(0o444)
    (tmp_path / "read-only").chmod(0o555)
    honours_modes = ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
                     "--inh-caps=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    check = ("import sys\nfrom rlsys.cli import parse_config\nfrom rlsys.preflight import StartupError, "
             "check_mlflow_server\ntry:\n    check_mlflow_server(parse_config(['trace.mlflow=true', "
             "f'trace.mlflow_tracking_uri={sys.argv[1]}']).trace)\nexcept StartupError as e:\n    print(e)\n")
    for path, problem in ((tmp_path / "read-only" / "new.db", f"this user may not write in {tmp_path}/read-only"),
                          (tmp_path / "read-only" / "dir" / "new.db",
                           f"this user may not write in {tmp_path}/read-only"),
                          (tmp_path / "read-only" / "m.db",
                           f"{tmp_path}/read-only/m.db is no file this user may write (with its directory)")):
        refused = subprocess.run([*honours_modes, sys.executable, "-c", check, f"sqlite:///{path}"],
                                 capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert refused.stdout.startswith(f"trace.mlflow_tracking_uri=sqlite:///{path}: {problem}; fix the path"), \
            (refused.stdout, refused.stderr[-2000:])
    (tmp_path / "read-only").chmod(0o755)
    writable = subprocess.run([*honours_modes, sys.executable, "-c", check, f"sqlite:///{tmp_path}/read-only/new.db"],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert (writable.returncode, writable.stdout) == (0, ""), writable.stderr[-2000:]


def test_trace_files_are_strict_json_and_read_traces_gets_non_finite_numbers_back(tmp_path):
    """A trace wrote a NaN reward or an infinite logprob bare, which `jq` and strict JSON parsers refuse. The numbers
    come back as floats, and a model turn whose text is "NaN" stays text."""
    import math

    from rlsys.report import build_report
    from rlsys.tracing import write_trained

    tokenizer = build_char_tokenizer()
    prompt, answer = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("What is 0/0?", "NaN"))
    t = Trajectory(token_ids=prompt + answer, loss_mask=[0] * len(prompt) + [1] * len(answer),
                   logprobs=[0.0] * len(prompt) + [-math.inf] * len(answer), versions=[0] * (len(prompt) + len(answer)),
                   turn_ends=[len(prompt) + len(answer)], turn_rewards=[math.nan], reward=math.inf,
                   metrics={"score": -math.inf}, group_id="train-0-1", stop_reason="stop")
    writer = TraceWriter(tmp_path, "rollout0", tokenizer, sample_rate=1.0)
    writer.record("train-0-1", "train", time.time() - 1, [t], None, [])
    writer.close()
    write_trained(tmp_path, 1, [t], [math.nan], sample_rate=1.0)

    def refused(constant):
        raise ValueError(f"{constant} is not JSON")

    for path in (tmp_path / "traces").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            json.loads(line, parse_constant=refused)  # as strictly as jq
    (episode,) = read_traces(tmp_path)
    (trajectory,) = episode["trajectories"]
    assert [repr(trajectory[k]) for k in ("reward", "turn_rewards", "metrics")] == ["inf", "[nan]", "{'score': -inf}"]
    turn = trajectory["messages"][1]
    assert turn["text"] == "NaN" and repr(turn["reward"]) == "nan" and repr(turn["logprob_mean"]) == "-inf"
    assert repr(trajectory["trained"]["advantage"]) == "nan"
    assert "advantage nan" in build_report(tmp_path).read_text()


def test_an_mlflow_server_that_does_not_answer_is_refused_at_the_start_naming_the_key(monkeypatch):
    """trace.mlflow_tracking_uri=http://... where no server answers: the run trained to its end, then sat silent
    for about 250 s of MLflow's retries before the export failed."""
    from rlsys import assets
    from rlsys.cli import parse_config
    from rlsys.launcher import prepare
    from rlsys.preflight import StartupError

    class Checked(Exception):
        """The MLflow server answered: prepare went on to the dataset and the model."""

    def checked(config):
        raise Checked

    monkeypatch.setattr(assets, "prepare_assets", checked)
    with held_port() as port:  # where nothing listens
        uri = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        with pytest.raises(StartupError) as refused:
            prepare(parse_config(["trace.mlflow=true", f"trace.mlflow_tracking_uri={uri}/"]))
    assert str(refused.value).startswith(f"trace.mlflow_tracking_uri={uri}/: no MLflow server answered (nothing "
                                         f"answered at 127.0.0.1:{port}: Connection refused); start it")
    assert time.monotonic() - started < 30
    with pytest.raises(StartupError, match="trace.mlflow_tracking_uri: Port could not be cast"):
        prepare(parse_config(["trace.mlflow=true", "trace.mlflow_tracking_uri=http://127.0.0.1:mlflow"]))
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with pytest.raises(Checked):
            prepare(parse_config(["trace.mlflow=true",
                                  f"trace.mlflow_tracking_uri=http://127.0.0.1:{server.getsockname()[1]}"]))


def test_an_mlflow_server_that_is_gone_fails_the_export_without_its_password_in_the_log(tmp_path, tokenizer_dir,
                                                                                         monkeypatch, caplog, capfd):
    """MLflow's error quotes the tracking URI as written: "API request to http://user:PASSWORD@host/... failed"."""
    from experiments import AsyncPPOMATHConfig
    from rlsys.launcher import finish_observability

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # refused at once, not retried for minutes
    run_dir, password = tmp_path / "exp" / "t", "s3cret-pw%2Fx"
    tool_episode(run_dir, tokenizer_dir)
    config = AsyncPPOMATHConfig()
    config.logging_dir, config.trace.mlflow = str(run_dir / "logs"), True
    with held_port() as port:  # where nothing listens
        config.trace.mlflow_tracking_uri = f"http://rlsys:{password}@127.0.0.1:{port}/?pwd=other%20pw"
        finish_observability(config, run_dir)
    printed = capfd.readouterr()
    assert "ExportFailed: MlflowException: API request to http://rlsys:REDACTED@127.0.0.1:" in caplog.text
    for text in (caplog.text, printed.out, printed.err):
        for secret in (password, "s3cret-pw/x", "other%20pw", "other pw"):
            assert secret not in text


@pytest.mark.slow  # an MLflow server's start, and MLflow's client giving up on it once it stopped, take minutes
def test_an_mlflow_store_that_goes_away_mid_export_leaves_its_password_out_of_every_log(tmp_path, tokenizer_dir,
                                                                                          monkeypatch, caplog, capfd):
    """MLflow's own error text holds the tracking URI as written, password and all ("API request to
    http://user:PASSWORD@host/... failed"): in the run's warning when the export failed, and in what MLflow's logger
    says of a trace its background queue could not send. A real tracking server stops as the export writes its
    traces."""
    import rlsys.mlflow_export
    from experiments import AsyncPPOMATHConfig
    from rlsys.launcher import finish_observability

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # a stopped server is refused at once, not for minutes
    password = "s3cret-pw%2Fx"
    with mlflow_server(f"sqlite:///{tmp_path / 'server.db'}", tmp_path) as (server, port):
        export_episode = rlsys.mlflow_export._export_episode

        def server_stops(*args):
            stop_server(server)
            export_episode(*args)

        monkeypatch.setattr(rlsys.mlflow_export, "_export_episode", server_stops)
        run_dir = tmp_path / "exp" / "t"
        tool_episode(run_dir, tokenizer_dir)
        config = AsyncPPOMATHConfig()
        config.logging_dir, config.trace.mlflow = str(run_dir / "logs"), True
        config.trace.mlflow_tracking_uri = f"http://rlsys:{password}@127.0.0.1:{port}"
        finish_observability(config, run_dir)
    printed = capfd.readouterr()
    logged = caplog.text
    assert "could not write the run report or export the traces" in logged
    assert f"http://rlsys:REDACTED@127.0.0.1:{port}" in logged  # the failure still says where
    assert "Failed to send trace to MLflow backend" in printed.err  # MLflow's logger said its part ...
    for text in (logged, printed.out, printed.err):
        for secret in (password, urllib.parse.unquote(password)):
            assert secret not in text  # ... without the password
