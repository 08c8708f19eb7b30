"""The guides' code blocks that no other test runs, taken from the guides as a user copies them.

The README's `my_plugin.py` is run by tests/test_user_plugin.py, docs/data.md's reward-model plugin by
tests/test_reward_model.py and tests/test_bad_input.py, and examples/ by tests/test_examples.py.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def python_block(guide: str, starts_with: str) -> str:
    """The one ```python block of `guide` whose code begins with `starts_with`."""
    blocks = [block for block in re.findall(r"```python\n(.*?)```", (ROOT / guide).read_text(), re.S)
              if block.startswith(starts_with)]
    assert len(blocks) == 1, f"{guide} must hold one python block starting {starts_with!r}"
    return blocks[0]


def test_the_tools_guide_s_tool_is_offered_to_the_model_and_runs_when_called(tmp_path):
    plugin = tmp_path / "my_tools.py"
    plugin.write_text(python_block("docs/tools.md", "from rlsys.api import Tool"))
    # The block's own comment says how it is used: plugins=[my_tools.py] tools=[calculator,word_count]
    script = f"""
import asyncio
from rlsys.api import make_env
from rlsys.cli import parse_config

config = parse_config(["experiment=async-ppo-math-tools", "plugins=[{plugin}]", "tools=[calculator,word_count]"])
env = make_env(config.env)

async def episode():
    observation, _ = await env.reset(options={{"prompt": "12+34=", "answer": "46"}})
    call = '<tool_call>{{"name": "word_count", "arguments": {{"text": "one two three"}}}}</tool_call>'
    result = await env.step((0, call))
    await env.close()
    return observation, result

observation, (response, reward, terminated, _, info) = asyncio.run(episode())
print(observation)
print(response, reward, terminated, info["tool_calls"], info["tool_errors"])
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    instructions, outcome = result.stdout.strip().rsplit("\n", 1)
    assert "word_count(text): counts the words of a text" in instructions
    assert outcome == "<tool_response>3</tool_response> 0.0 False 1 0"


def without_docstring(source: str) -> str:
    tree = ast.parse(source)
    if tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant):
        tree.body = tree.body[1:]
    return ast.dump(tree)


def test_the_agents_guide_s_langgraph_block_is_the_example_the_tests_train():
    """tests/test_endpoint_training.py trains rlsys/impl/agent/langgraph_example.py; the guide shows it as that file:
    the same code, comments aside."""
    block = python_block("docs/agents.md", "from langchain_core.tools import tool")
    example = (ROOT / "rlsys" / "impl" / "agent" / "langgraph_example.py").read_text()
    assert without_docstring(block) == without_docstring(example)
