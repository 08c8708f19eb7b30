"""bench/vs_trl.py keeps the versions rlsys's learner streams, to score them after the run."""

import sys
from pathlib import Path

from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlsys import protocol
from rlsys.bus import InProcessBus
from rlsys.weight_transport import WeightServer, publish
from tests.helpers import save_random_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.vs_trl import WeightKeeper  # noqa: E402


def test_a_streamed_version_of_a_tied_model_is_kept_under_both_names(tmp_path):
    """The stream sends a tied matrix once, under both names in one buffer; the keeper wrote it with safetensors,
    which refuses shared tensors, so every rlsys snapshot of the default (tied) model was lost and the bench scored
    none of them."""
    model = AutoModelForCausalLM.from_pretrained(save_random_tiny_model(tmp_path / "model"))
    bus, server = InProcessBus(), WeightServer()
    publish(bus, model, 10, "stream", tmp_path / "weights", server=server)
    keeper = WeightKeeper(tmp_path, "rlsys", every=10, last=30)
    keeper.keep_new(bus.get(protocol.WEIGHTS))
    kept = load_file(str(keeper.kept[10]))
    state = model.state_dict()
    assert set(kept) == set(state) and "lm_head.weight" in kept
    for name, tensor in state.items():
        assert kept[name].equal(tensor), name


def test_trls_side_clips_and_weighs_as_rlsys_is_told_to(tmp_path, monkeypatch):
    """The comparison gives TRL rlsys's clip-higher and GSPO settings (its epsilon_high, importance_sampling_level):
    they were left at TRL's defaults, so a run with either compared two different algorithms."""
    # Importing TRL sets VLLM_LOGGING_LEVEL=ERROR where it is unset, which every vLLM engine this process starts later
    # reads: set here, monkeypatch takes it away again (tests/test_weight_sync.py reads vLLM's warnings).
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    from bench.vs_trl import trl_arguments
    from rlsys.cli import parse_config

    given = trl_arguments(parse_config(["ppo.pg_clip_high=0.28", "ppo.importance_sampling_level=sequence"]), 10,
                          tmp_path)
    assert (given.epsilon, given.epsilon_high, given.importance_sampling_level) == (0.2, 0.28, "sequence")
    default = trl_arguments(parse_config([]), 10, tmp_path)
    assert (default.epsilon, default.epsilon_high, default.importance_sampling_level) == (0.2, 0.2, "token")
