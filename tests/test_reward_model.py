"""Rewards from a sequence-classification model: a tiny one the test builds, whose preference it knows.

The model's layers are silenced (attention and MLP outputs zero), so each row's final hidden state is its
last token's embedding, normalised: the score head then reads off that one token. Responses ending in "!"
score +1 per unit of the head, any other last character -1. Padding in a batch must not move the read-out.
"""

import asyncio
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from rlsys.api import EnvServiceAbstraction, make_env
from rlsys.cli import parse_config
from rlsys.impl.env.reward_model import RewardModelScorer, Score, shared_scorer
from rlsys.launcher import launch
from rlsys.metrics import read_jsonl_metrics
from rlsys.model.tokenizer import build_char_tokenizer
from tests.helpers import child_pids, left_behind, small_run_overrides

HIDDEN = 8


def build_reward_model(path: Path, preferred: str) -> str:
    """A reward model that scores +1 a response whose last character is in `preferred`, any other -1."""
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = None  # pairs are scored as plain text, so the last token is the response's
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.fill_(-1.0)
        for char in preferred:
            model.model.embed_tokens.weight[tokenizer.convert_tokens_to_ids(char)] = 1.0
        model.score.weight.fill_(1.0 / HIDDEN)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def reward_model_path(tmp_path_factory):
    return build_reward_model(tmp_path_factory.mktemp("reward-model"), "!")


def test_scores_follow_the_known_preference_in_one_padded_batch(reward_model_path):
    scorer = RewardModelScorer(reward_model_path, batch_size=8)
    responses = ["great!", "meh", "a much longer answer that pads the others!", "no."]
    scores = asyncio.run(scorer.score(["Say it"] * 4, responses, timeout=30))
    assert [s.status for s in scores] == ["ok"] * 4
    assert [round(s.reward, 3) for s in scores] == [1.0, -1.0, 1.0, -1.0]


def test_concurrent_episodes_share_batches(reward_model_path):
    scorer = RewardModelScorer(reward_model_path, batch_size=64)
    sizes = []
    forward = scorer.forward
    scorer.forward = lambda pairs: sizes.append(len(pairs)) or forward(pairs)

    async def many():
        return await asyncio.gather(*(scorer.score([f"q{i}"] * 4, ["yes!", "no"] * 2, timeout=30) for i in range(8)))

    results = asyncio.run(many())
    assert all([s.reward > 0 for s in r] == [True, False, True, False] for r in results)
    assert sum(sizes) == 32 and len(sizes) < 8  # fewer passes than episodes: requests were batched together


def test_the_env_scores_a_group_and_the_loop_stays_free(reward_model_path):
    async def episode():
        env = make_env(EnvServiceAbstraction("reward-model", args={"model_path": reward_model_path, "timeout": 30}))
        await env.reset(options={"prompt": "Cheer", "answer": "unused"})
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        result = await env.step(("q", ["hooray!", "boo", "yay!"]))
        ticker.cancel()
        return result, ticks

    (_, rewards, done, _, info), ticks = asyncio.run(episode())
    assert [r > 0 for r in rewards] == [True, False, True] and done
    assert info["statuses"] == ["ok"] * 3
    assert ticks > 0  # the event loop ran while the model scored
    assert shared_scorer(reward_model_path, 16, 1024) is shared_scorer(reward_model_path, 16, 1024)


def test_a_hung_or_failing_model_scores_zero_with_its_reason(reward_model_path):
    scorer = RewardModelScorer(reward_model_path)
    release = threading.Event()
    scorer.forward = lambda pairs: release.wait() and [1.0] * len(pairs)
    start = time.monotonic()
    scores = asyncio.run(scorer.score(["p", "p"], ["a!", "b!"], timeout=0.5))
    assert time.monotonic() - start < 5
    assert scores == [Score(0.0, "timeout", "not scored within 0.5s")] * 2
    release.set()

    failing = RewardModelScorer(reward_model_path)
    failing.forward = lambda pairs: 1 / 0
    scores = asyncio.run(failing.score(["p"], ["a!"], timeout=10))
    assert scores == [Score(0.0, "error", "ZeroDivisionError: division by zero")]


def test_pairs_whose_caller_gave_up_are_not_scored(reward_model_path):
    """Timed out, a pair still queued is dropped: scoring it for nobody would only push later pairs past their own
    timeouts."""
    scorer = RewardModelScorer(reward_model_path, batch_size=1)
    passes, gave_up = [], threading.Event()
    # each pass lasts until the caller has given up (a fixed pass could end first on a loaded machine), then none
    scorer.forward = lambda pairs: passes.append(len(pairs)) or gave_up.wait(30) and [1.0] * len(pairs)
    scores = asyncio.run(scorer.score(["p"] * 4, ["a!"] * 4, timeout=0.1))
    gave_up.set()
    assert [s.status for s in scores] == ["timeout"] * 4
    time.sleep(1.5)  # the other three passes, instant now, would be over by now
    assert len(passes) <= 1  # at most the one in progress when the caller gave up
    scorer.close()


def test_closing_fails_the_queued_pairs_and_ends_the_thread(reward_model_path):
    scorer = RewardModelScorer(reward_model_path, batch_size=1)
    started, release = threading.Event(), threading.Event()
    forward = scorer.forward
    scorer.forward = lambda pairs: started.set() or release.wait() and forward(pairs)

    async def close_while_scoring():
        scoring = asyncio.create_task(scorer.score(["p", "p", "p"], ["a!", "b", "c!"], timeout=30))
        await asyncio.to_thread(started.wait, 10)
        threading.Timer(0.2, release.set).start()  # close() waits for the batch in progress
        await asyncio.to_thread(scorer.close)
        return await scoring

    scores = asyncio.run(close_while_scoring())
    assert scores[0].status == "ok" and round(scores[0].reward, 3) == 1.0  # the batch in progress was scored
    assert scores[1:] == [Score(0.0, "error", "the reward model's scorer was closed")] * 2
    assert not scorer._thread.is_alive()
    with pytest.raises(RuntimeError, match="is closed"):
        asyncio.run(scorer.score(["p"], ["a!"], timeout=1))


EXIT_WHILE_SCORING = textwrap.dedent("""
    import asyncio, sys, time, torch
    from rlsys.impl.env.reward_model import RewardModelScorer

    def busy_forward(pairs):  # torch ops that let go of the GIL, as a real model's forward pass does, for 2 s
        a, end = torch.ones(256, 256), time.monotonic() + 2
        while time.monotonic() < end:
            a = torch.mm(a, a).clamp(-1, 1)
        return [0.0] * len(pairs)

    scorer = RewardModelScorer(sys.argv[1])
    scorer.forward = busy_forward
    print(asyncio.run(scorer.score(["p"], ["a!"], timeout=0.3))[0].status)  # the process exits mid-pass
""")


def test_a_process_that_exits_while_the_model_scores_exits_cleanly(reward_model_path):
    # Without close() at exit the scoring thread is ended inside torch's C++ as the interpreter finalizes:
    # "terminate called without an active exception", SIGABRT (6 of 6 runs before the fix).
    done = subprocess.run([sys.executable, "-c", EXIT_WHILE_SCORING, reward_model_path], capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "timeout"), done.stderr[-2000:]
    assert "terminate called" not in done.stderr


def test_a_classifier_with_many_labels_is_refused(tmp_path, reward_model_path):
    model = Qwen2ForSequenceClassification.from_pretrained(reward_model_path, num_labels=3,
                                                           ignore_mismatched_sizes=True)
    model.save_pretrained(tmp_path)
    build_char_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has 3 labels; a reward model has 1"):
        RewardModelScorer(str(tmp_path))


# docs/data.md's plugin, as a user copies it
REWARD_MODEL_PLUGIN = re.search(r"```python\n(# reward_model_plugin\.py\n.*?)```",
                                (Path(__file__).resolve().parents[1] / "docs" / "data.md").read_text(), re.S).group(1)


STEPS = 30
MARGIN = 0.4  # the mean training reward rose 0.67-0.77, first 5 steps to last 5 (BENCHMARKS.md, "Rewards from a model")


@pytest.mark.slow
def test_a_run_learns_what_the_reward_model_prefers(cache_dir, tmp_path):
    """The math task's policy, rewarded by a model that prefers answers ending in an even digit (+1, any other -1),
    turns toward them; the rollout worker's scorer ends cleanly with the run."""
    existing = child_pids()
    model = build_reward_model(tmp_path / "reward-model", "02468")
    plugin = tmp_path / "reward_model_plugin.py"
    plugin.write_text(REWARD_MODEL_PLUGIN)
    config = parse_config(small_run_overrides(cache_dir, tmp_path) + [
        "experiment=reward-model-experiment", f"plugins=[{plugin}]", f"reward_model_path={model}",
        f"max_steps={STEPS}"])
    summary = launch(config)
    steps = read_jsonl_metrics(Path(config.logging_dir) / "learner.jsonl")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    first, last = (sum(s["reward"] for s in part) / len(part) for part in (steps[:5], steps[-5:]))
    print(f"mean reward, first 5 steps {first:+.3f}, last 5 {last:+.3f}")  # for BENCHMARKS.md: pytest -s
    assert last - first >= MARGIN, (first, last)
    assert summary["final_reward_of_ended"] - summary["initial_reward_of_ended"] >= 2 * MARGIN  # held out, greedy
    assert summary["initial_accuracy"] is summary["final_accuracy"] is None  # a score has no success to count
    assert summary["prompts_accounted"] and summary["unclean_exits"] == {}
    assert left_behind(tmp_path, existing) == []
