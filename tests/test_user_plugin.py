"""A user writes a plugin outside the package, exactly as the README shows, and runs the entry point."""

import re
import subprocess
import sys
from pathlib import Path

from rlsys.metrics import read_jsonl_metrics
from tests.helpers import small_run_overrides

ROOT = Path(__file__).resolve().parents[1]


def readme_plugin_source() -> str:
    """The README's `my_plugin.py` block: if the README's example breaks, this test breaks."""
    blocks = re.findall(r"```python\n(# my_plugin\.py\n.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) == 1, "README must hold one my_plugin.py example"
    return blocks[0]


def test_user_plugin_param_reaches_the_agent(cache_dir, tmp_path):
    plugin = tmp_path / "my_plugin.py"
    plugin.write_text(readme_plugin_source())
    args = small_run_overrides(cache_dir, tmp_path / "runs") + [
        "experiment=my-experiment", f"plugins=[{plugin}]", "my_param=5.0", "max_steps=2", "trial_name=t"]
    result = subprocess.run([sys.executable, str(ROOT / "training" / "main_async_ppo.py"), *args],
                            capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = read_jsonl_metrics(tmp_path / "runs" / "my-experiment" / "t" / "logs" / "learner.jsonl")
    assert [s["agent/my_param"] for s in steps] == [5.0, 5.0]
    assert "held-out accuracy" in result.stdout
