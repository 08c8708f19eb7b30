"""A run's files are its user's alone (0700 directories, 0600 files), and config.yaml holds no password."""

import os
import stat

from rlsys.bus import EmbeddedRedis, connect
from rlsys.cli import load_config, parse_config, save_config
from rlsys.run_privacy import REDACTED, make_private, redact_url


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
    assert load_config(tmp_path / "config.yaml").cluster.redis_url == f"redis://:{REDACTED}@10.0.0.5:6379/0?namespace=exp"
    rerun = parse_config(["--config", str(tmp_path / "config.yaml"), f"cluster.redis_url={url}"])
    assert rerun.cluster.redis_url == url


def test_redact_url_replaces_only_the_password():
    assert redact_url("redis://user:pw@h:1/0") == f"redis://user:{REDACTED}@h:1/0"
    assert redact_url("rediss://:p%40ss@h:1") == f"rediss://:{REDACTED}@h:1"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    assert redact_url("") == ""
