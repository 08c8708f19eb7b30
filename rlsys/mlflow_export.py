"""Exports a run's traces to MLflow Tracing (and its learner metrics to an MLflow run), so that
`mlflow ui --backend-store-uri <uri>` shows each episode as a trace: the episode, its trajectories, each
model call (LLM span, with the context it saw and what it answered) and each tool call (TOOL span).

It runs once, at the end of the run, from the files in `<run dir>/traces`: nothing of MLflow is on the
rollout path.
"""

import contextlib
import logging
import re
import time
from pathlib import Path

from rlsys.metrics import LEARNER_RECORDS, LOGGED_AT, STEP, read_jsonl_metrics, records_file
from rlsys.run_files import logs_dir
from rlsys.run_privacy import redact_passwords
from rlsys.tracing import read_traces

log = logging.getLogger(__name__)
NS = 1_000_000_000
# Tags of the run's MLflow run: the last learner step exported, and the end (time.time()) of the last episode. A
# resumed run's launch ends after every episode of the launches before it.
EXPORTED_STEP, EXPORTED_UNTIL = "rlsys.exported_step", "rlsys.exported_until"
METRICS_PER_BATCH = 1000  # MLflow's limit on one log_batch call
MAX_METRIC_NAME = 250  # MLflow's limit on a metric name's length


def metric_name(key: str) -> str:
    """`key`, a learner metric's name, as MLflow takes it: `/` as `.`, and what MLflow refuses in a name (it allows
    letters, digits, `_`, `-`, `.` and spaces everywhere) as `_`, at most MAX_METRIC_NAME characters. An agent's own
    metric, such as `agent/pass@1`, is any string: one refused name failed the whole export, every metric and trace."""
    return re.sub(r"[^\w.\- ]", "_", key.replace("/", "."))[:MAX_METRIC_NAME]


def default_tracking_uri(run_dir: Path) -> str:
    return f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


def _turn_times(episode: dict, n_turns: int) -> list[tuple[float, float]]:
    """(start, end) of each model turn: the recorded calls when there is one per turn, else equal slices."""
    calls = sorted(episode["calls"], key=lambda c: c["sent"])
    if len(calls) == n_turns:
        return [(c["sent"], c["sent"] + c["seconds"]) for c in calls]
    width = episode["seconds"] / max(n_turns, 1)
    return [(episode["started"] + k * width, episode["started"] + (k + 1) * width) for k in range(n_turns)]


def _export_episode(mlflow, episode: dict, experiment_id: str) -> None:
    from mlflow.entities import SpanType

    prompt = next((m["text"] for t in episode["trajectories"] for m in t["messages"] if m["role"] == "prompt"), "")
    root = mlflow.start_span_no_context(
        f"episode {episode['episode_id']}", span_type=SpanType.AGENT, inputs={"prompt": prompt},
        attributes={"tag": episode["tag"], "model_calls": len(episode["calls"])},
        experiment_id=experiment_id, start_time_ns=int(episode["started"] * NS))
    for t in episode["trajectories"]:
        chain = mlflow.start_span_no_context(
            f"trajectory {t['traj_id'][:8]}", span_type=SpanType.CHAIN, parent_span=root,
            attributes={k: v for k, v in (("stop_reason", t["stop_reason"]), ("void", t["void"]),
                                          ("versions", str(t["versions"])), ("tokens", t["tokens"]),
                                          ("trained_step", t.get("trained", {}).get("step")),
                                          ("advantage", t.get("trained", {}).get("advantage"))) if v is not None},
            start_time_ns=int(episode["started"] * NS))
        turns = [m for m in t["messages"] if m["role"] == "assistant"]
        times = iter(_turn_times(episode, len(turns)))
        context: list[dict] = []
        for i, message in enumerate(t["messages"]):
            if message["role"] != "assistant":
                context.append({"role": message["role"], "content": message["text"]})
                continue
            start, end = next(times)
            llm = mlflow.start_span_no_context(
                f"model turn {message['turn'] + 1}", span_type=SpanType.LLM, parent_span=chain,
                inputs={"messages": list(context)},
                attributes={"tokens": message["tokens"], "versions": str(message["versions"]),
                            "reward": message["reward"], "logprob_mean": message["logprob_mean"]},
                start_time_ns=int(start * NS))
            llm.end(outputs={"content": message["text"], "reward": message["reward"]}, end_time_ns=int(end * NS))
            results = [m["text"] for m in t["messages"][i + 1:i + 2] if m["role"] == "tool"]
            for call in message["tool_calls"]:
                tool = mlflow.start_span_no_context(call.get("name", "undecodable call"), span_type=SpanType.TOOL,
                                                    parent_span=chain, inputs=call, start_time_ns=int(end * NS))
                tool.end(outputs={"response": results[0] if results else None}, end_time_ns=int(end * NS) + 1)
            context.append({"role": "assistant", "content": message["text"]})
        chain.end(outputs={"reward": t["reward"], "turn_rewards": t["turn_rewards"]},
                  end_time_ns=int(episode["ended"] * NS))
    root.end(outputs={"rewards": [t["reward"] for t in episode["trajectories"]], "failure": episode["failure"]},
             end_time_ns=int(episode["ended"] * NS))


def export_run(run_dir: Path, tracking_uri: str = "", logging_dir: Path | None = None) -> str:
    """Learner metrics into an MLflow run and every trace into its experiment; returns the tracking URI.

    A run resumed in its directory exports at the end of each launch: into the same MLflow run, only the steps and
    episodes the exports before did not take (its tags say how far they went), so none is there twice.

    ExportFailed if MLflow failed. MLflow's errors quote the tracking URI as written, its password too: that error's
    text, and what MLflow's own logger says meanwhile (of a trace its background queue could not send), come with the
    password REDACTED."""
    run_dir = Path(run_dir)
    uri = tracking_uri or default_tracking_uri(run_dir)
    with _passwords_out_of_mlflow_logs(uri):
        try:
            _export(run_dir, uri, logging_dir)
        except Exception as e:  # chained, the error would show MLflow's own text, password and all
            raise ExportFailed(redact_passwords(f"{type(e).__name__}: {e}", uri)) from None
    return uri


class ExportFailed(RuntimeError):
    """The MLflow export failed; the message is MLflow's, with the tracking URI's password REDACTED."""


class _RedactPasswords(logging.Filter):
    def __init__(self, url: str):
        super().__init__()
        self.url = url

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = redact_passwords(record.getMessage(), self.url), ()
        if record.exc_info and not record.exc_text:
            record.exc_text = redact_passwords(logging.Formatter().formatException(record.exc_info), self.url)
        return True


@contextlib.contextmanager
def _passwords_out_of_mlflow_logs(url: str):
    """MLflow's loggers write through the handlers of the `mlflow` logger (they do not propagate; importing mlflow
    sets them up): each redacts `url`'s passwords while the export runs, and until MLflow's background queue has
    sent (or failed to send) every trace the export gave it."""
    import mlflow

    handlers, redact = list(logging.getLogger(mlflow.__name__).handlers), _RedactPasswords(url)
    for handler in handlers:
        handler.addFilter(redact)
    try:
        yield
    finally:
        mlflow.flush_trace_async_logging()
        for handler in handlers:
            handler.removeFilter(redact)


def _export(run_dir: Path, uri: str, logging_dir) -> None:
    import mlflow
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    now = time.time()
    mlflow.set_tracking_uri(uri)
    name = f"{run_dir.parent.name}/{run_dir.name}"
    if mlflow.get_experiment_by_name(name) is None:  # its artifacts (the traces' spans) in the run directory too,
        # not in ./mlruns of whatever directory the command ran in (MLflow's default beside a database store)
        mlflow.create_experiment(name, artifact_location=(run_dir / "mlflow-artifacts").resolve().as_uri())
    experiment = mlflow.set_experiment(name)
    earlier = mlflow.search_runs([experiment.experiment_id], filter_string=f"tags.`{EXPORTED_STEP}` != ''",
                                 output_format="list", max_results=1)
    tags = earlier[0].data.tags if earlier else {}
    exported_step, exported_until = int(tags.get(EXPORTED_STEP, 0)), float(tags.get(EXPORTED_UNTIL, 0.0))
    metrics_file = records_file(logs_dir(run_dir, logging_dir), LEARNER_RECORDS)
    with mlflow.start_run(run_id=earlier[0].info.run_id) if earlier else mlflow.start_run(run_name=run_dir.name) as run:
        new = [row for row in (read_jsonl_metrics(metrics_file) if metrics_file.exists() else [])
               if row[STEP] > exported_step]
        # in batches (one call a step took 12 s a thousand steps, one database write each), stamped when logged
        metrics = [Metric(metric_name(k), float(v), int(row.get(LOGGED_AT, now) * 1000), row[STEP])
                   for row in new for k, v in row.items() if k not in (STEP, LOGGED_AT) and isinstance(v, (int, float))]
        for start in range(0, len(metrics), METRICS_PER_BATCH):
            MlflowClient().log_batch(run.info.run_id, metrics=metrics[start:start + METRICS_PER_BATCH])
        exported_step = max([exported_step] + [row[STEP] for row in new])
        # Against the exports before's mark, not one that moves as this one goes: each rollout worker's file is in
        # the order its episodes ended, but the files follow one another, so a worker's episodes that ended before
        # the last of the file read before it would be taken for exported.
        since = exported_until
        for episode in read_traces(run_dir):
            if episode["ended"] > since:
                _export_episode(mlflow, episode, experiment.experiment_id)
                exported_until = max(exported_until, episode["ended"])
        mlflow.set_tags({EXPORTED_STEP: exported_step, EXPORTED_UNTIL: repr(exported_until)})
