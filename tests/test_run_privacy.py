"""A run's files are its user's alone (0700 directories, 0600 files), never written through a link planted in
the run directory, and config.yaml holds no password."""

import os
import stat

import pytest

from rlsys.bus import EmbeddedRedis, connect
from rlsys.cli import load_config, parse_config, save_config
from rlsys.metrics import MetricsLogger
from rlsys.run_privacy import REDACTED, append_private, make_private, redact_passwords, redact_url, write_private


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def modes_under(directory) -> dict[str, int]:
    found = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            found[os.path.relpath(os.path.join(root, name), directory)] = mode(os.path.join(root, name))
    return found


def test_a_run_directory_made_by_an_older_run_with_open_permissions_becomes_owner_only(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True, mode=0o755)
    (run / "logs" / "learner.jsonl").write_text("{}")
    (run / "logs" / "learner.jsonl").chmod(0o644)
    make_private(run)
    assert mode(run) == 0o700
    assert modes_under(run) == {"logs": 0o700, os.path.join("logs", "learner.jsonl"): 0o600}


def test_the_private_redis_keeps_its_directory_config_log_and_append_only_file_owner_only(tmp_path):
    directory = tmp_path / "redis"
    directory.mkdir(mode=0o755)
    with EmbeddedRedis(directory) as server:
        with connect(server.url) as bus:
            bus.stream_add("trajectories", {"secret": "the reference answer"})
    assert mode(directory) == 0o700
    found = modes_under(directory)
    assert any(name.endswith(".aof") for name in found) and "redis.log" in found and "redis.conf" in found
    assert {name: m for name, m in found.items() if m != (0o700 if (directory / name).is_dir() else 0o600)} == {}


def test_config_yaml_never_holds_the_redis_password_and_a_rerun_passes_the_url_again(tmp_path):
    url = "redis://:s3cret-pass@10.0.0.5:6379/0?namespace=exp"
    config = parse_config([f"cluster.redis_url={url}"])
    save_config(config, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    assert "s3cret-pass" not in text and mode(tmp_path / "config.yaml") == 0o600
    assert (load_config(tmp_path / "config.yaml").cluster.redis_url
            == f"redis://:{REDACTED}@10.0.0.5:6379/0?namespace=exp")
    rerun = parse_config(["--config", str(tmp_path / "config.yaml"), f"cluster.redis_url={url}"])
    assert rerun.cluster.redis_url == url


def test_redact_url_replaces_only_the_password():
    assert redact_url("redis://user:pw@h:1/0") == f"redis://user:{REDACTED}@h:1/0"
    assert redact_url("rediss://:p%40ss@h:1") == f"rediss://:{REDACTED}@h:1"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    assert redact_url("") == ""
    # MLflow's tracking URIs: a server's, a database's (its password in the query too, as libpq and redis-py take
    # it), and paths that a rebuilt URL changed (sqlite:////abs lost a slash, an IPv6 host its brackets)
    assert redact_url("https://user:secret@host:5000/p") == f"https://user:{REDACTED}@host:5000/p"
    assert redact_url("postgresql+psycopg2://u:p@h/db") == f"postgresql+psycopg2://u:{REDACTED}@h/db"
    assert redact_url("postgresql://h/db?user=u&password=p&sslmode=require") == \
        f"postgresql://h/db?user=u&password={REDACTED}&sslmode=require"
    assert redact_url("redis://h:1/0?PASSWORD=pw") == f"redis://h:1/0?PASSWORD={REDACTED}"
    assert redact_url("mysql://u:p@[::1]:3306/db") == f"mysql://u:{REDACTED}@[::1]:3306/db"
    assert redact_url("sqlite:////tmp/runs/mlflow.db") == "sqlite:////tmp/runs/mlflow.db"


def test_redact_passwords_replaces_a_password_where_it_stands_as_one_not_the_same_characters_elsewhere():
    """A short password ("a", "12") is also a piece of the error's other words and numbers: replaced everywhere, it
    garbled them ("API" -> "REDACTEDPI", port 5412 -> 54REDACTED) and told whoever reads the error what it is."""
    error = ("MlflowException: API request to http://rlsys:a@127.0.0.1:5412/api/2.0/mlflow/runs/create failed with "
             "exception HTTPConnectionPool(host='127.0.0.1', port=5412): Max retries exceeded (a connection refused)")
    assert redact_passwords(error, "http://rlsys:a@127.0.0.1:5412") == error.replace("rlsys:a@", f"rlsys:{REDACTED}@")
    error = "OperationalError: postgresql://h:5412/db?user=u&password=12&sslmode=require: port 5412 refused (12 tries)"
    assert redact_passwords(error, "postgresql://h:5412/db?user=u&password=12") == \
        error.replace("password=12&", f"password={REDACTED}&")
    # As written and percent-decoded, in the URL's credential and as a query's password (MLflow appends its API path
    # to the URI as written, so a query's password runs on into it)
    error = "API request to http://u:p%40s@h/?PWD=x y/api/2.0/mlflow/runs/get failed; u:p@s@h; p%40s p@s, x y"
    assert redact_passwords(error, "http://u:p%40s@h/?pwd=x%20y") == \
        f"API request to http://u:{REDACTED}@h/?PWD={REDACTED}/api/2.0/mlflow/runs/get failed; u:{REDACTED}@h; " \
        f"p%40s p@s, x y"


def test_config_yaml_never_holds_the_mlflow_password(tmp_path):
    uri = "postgresql://mlflow:s3cret-pass@db.example:5432/mlflow"
    save_config(parse_config(["trace.mlflow=true", f"trace.mlflow_tracking_uri={uri}"]), tmp_path / "config.yaml")
    assert "s3cret-pass" not in (tmp_path / "config.yaml").read_text()
    assert load_config(tmp_path / "config.yaml").trace.mlflow_tracking_uri == \
        f"postgresql://mlflow:{REDACTED}@db.example:5432/mlflow"


def plant_links(tmp_path):
    """A file and a directory outside the run, each with open permissions, and the run directory."""
    outside = tmp_path / "outside.txt"
    outside.write_text("the user's own file")
    outside.chmod(0o644)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    (elsewhere / "notes.txt").write_text("notes")
    (elsewhere / "notes.txt").chmod(0o644)
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    return run, outside, elsewhere


def test_a_link_planted_at_config_yaml_or_summary_json_is_replaced_never_written_through(tmp_path):
    run, outside, _ = plant_links(tmp_path)
    (run / "config.yaml").symlink_to(outside)
    (run / "summary.json").symlink_to(outside)
    save_config(parse_config([]), run / "config.yaml")
    write_private(run / "summary.json", "{}")
    assert outside.read_text() == "the user's own file" and mode(outside) == 0o644
    for name in ("config.yaml", "summary.json"):
        assert not (run / name).is_symlink() and mode(run / name) == 0o600
    assert (run / "summary.json").read_text() == "{}" and "experiment" in (run / "config.yaml").read_text()
    assert sorted(os.listdir(run)) == ["config.yaml", "logs", "summary.json"]  # no temporary file left


def test_a_failed_private_write_leaves_no_temporary_file(tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(OSError):
        write_private(tmp_path / "taken", "text")  # a directory cannot be replaced by a file
    assert os.listdir(tmp_path) == ["taken"]


def test_make_private_skips_links_to_a_file_and_to_a_directory_and_changes_neither_target(tmp_path):
    run, outside, elsewhere = plant_links(tmp_path)
    (run / "logs" / "learner.log").write_text("x")
    (run / "logs" / "learner.log").chmod(0o644)
    (run / "logs" / "link-to-file").symlink_to(outside)
    (run / "link-to-directory").symlink_to(elsewhere, target_is_directory=True)
    make_private(run)
    assert mode(outside) == 0o644 and mode(elsewhere) == 0o755 and mode(elsewhere / "notes.txt") == 0o644
    assert mode(run / "logs") == 0o700 and mode(run / "logs" / "learner.log") == 0o600
    assert (run / "link-to-directory").is_symlink() and (run / "logs" / "link-to-file").is_symlink()


def test_a_log_is_never_appended_through_a_link(tmp_path):
    run, outside, _ = plant_links(tmp_path)
    (run / "logs" / "learner.jsonl").symlink_to(outside)
    with pytest.raises(OSError, match="is a symbolic link"):
        MetricsLogger(run / "logs", "learner")
    assert outside.read_text() == "the user's own file" and mode(outside) == 0o644
    fd = append_private(run / "logs" / "rollout.log")
    os.write(fd, b"line\n")
    os.close(fd)
    assert mode(run / "logs" / "rollout.log") == 0o600


def test_a_link_planted_at_an_episode_s_frame_is_replaced_never_written_through(tmp_path):
    """A frame's name is foreseeable from the episode id (train-train-0-3.png)."""
    from rlsys.frames import render_episode

    run, outside, _ = plant_links(tmp_path)
    (run / "frames").mkdir()
    for ext in ("png", "gif"):
        (run / "frames" / f"train-train-0-3.{ext}").symlink_to(outside)
    messages = [{"role": "prompt", "text": "S.\n.G"}, {"role": "assistant", "text": "R", "reward": 1.0}]
    record = {"tag": "train", "episode_id": "train-0-3", "trajectories": [{"messages": messages, "reward": 1.0}]}
    png, gif = render_episode(record, run / "frames")
    assert outside.read_text() == "the user's own file" and mode(outside) == 0o644
    for frame in (png, gif):
        assert not frame.is_symlink() and mode(frame) == 0o600
    assert png.read_bytes().startswith(b"\x89PNG") and gif.read_bytes().startswith(b"GIF8")
