"""The plugin contracts: registries' errors and the trajectory's msgpack round trip."""

import msgpack
import pytest

from rlsys.api import (Agent, AgentAbstraction, EnvironmentService, EnvServiceAbstraction, GenerationConfig,
                       GenerationOutput, Trajectory, make_agent, make_env, register_agent, register_environment)
from rlsys.api.registry import Registry
from rlsys.errors import ConfigError


class EchoAgent(Agent):
    def __init__(self, temperature: float = 1.0):
        self.temperature = temperature

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        return []


class NullEnv(EnvironmentService):
    def __init__(self, difficulty: int = 1):
        self.difficulty = difficulty

    async def step(self, action):
        return None, 0.0, True, False, {}


register_agent("test-echo", EchoAgent)
register_environment("test-null", NullEnv)


def test_make_agent_passes_args():
    agent = make_agent(AgentAbstraction("test-echo", {"temperature": 0.5}))
    assert isinstance(agent, EchoAgent) and agent.temperature == 0.5


def test_duplicate_name_is_an_error_naming_the_registered_class():
    with pytest.raises(ValueError, match="'test-echo' is already registered.*EchoAgent"):
        register_agent("test-echo", EchoAgent)


def test_unknown_agent_lists_registered_and_close_matches():
    with pytest.raises(KeyError) as err:
        make_agent(AgentAbstraction("test-ecko"))
    message = str(err.value)
    assert "unknown agent 'test-ecko'" in message
    assert "Did you mean ['test-echo']" in message
    assert "'test-echo'" in message.split("Registered agents:")[1]


def test_a_bad_registration_is_refused_naming_what_was_given_and_leaves_the_registry_usable():
    """A plugin's slip (arguments swapped, an instance or a class of another kind) is refused as it registers; the
    swapped call was taken, and every later unknown-name error failed sorting the names to list them."""
    class NotAnAgent:
        async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
            return []

    with pytest.raises(ConfigError, match=r"register_agent\(name, cls\) takes the name first.*got <class .*EchoAgent"):
        register_agent(EchoAgent, "test-swapped")
    for cls in (EchoAgent(), NotAnAgent, NullEnv):
        with pytest.raises(ConfigError, match=r"register_agent\('test-bad', cls\) takes a subclass of Agent"):
            register_agent("test-bad", cls)
    with pytest.raises(ConfigError, match=r"register_environment\('test-bad', cls\) takes a subclass of "
                                          r"EnvironmentService.*EchoAgent"):
        register_environment("test-bad", EchoAgent)
    with pytest.raises(KeyError, match="unknown agent 'test-bad'.*Registered agents: .*'test-echo'"):
        make_agent(AgentAbstraction("test-bad"))


def test_unknown_env_lists_registered():
    with pytest.raises(KeyError, match="Registered environments: .*'test-null'"):
        make_env(EnvServiceAbstraction("no-such-env"))


def test_args_the_constructor_does_not_take_name_what_it_accepts():
    with pytest.raises(TypeError, match=r"cannot take args \['temprature'\].*accepts: \['temperature'\]"):
        make_agent(AgentAbstraction("test-echo", {"temprature": 0.5}))
    with pytest.raises(TypeError, match=r"accepts: \['difficulty'\]"):
        make_env(EnvServiceAbstraction("test-null", {"level": 3}))


def test_a_misspelled_arg_is_named_with_its_close_match_even_where_a_required_one_is_missing():
    """A newcomer's typo of a required arg: Python reports the missing one first; the error names the typo too."""
    registry = Registry("agent")
    registry.register("needs-two", type("NeedsTwo", (EchoAgent,), {"__init__": lambda self, gconfig, my_param: None}))
    with pytest.raises(TypeError, match=r"missing a required argument: 'my_param'.*unknown: 'my_parm' \(did you "
                                        r"mean 'my_param'\?\)\. It accepts: \['gconfig', 'my_param'\]"):
        registry.check("needs-two", {"gconfig": None, "my_parm": 1.0})


def test_registry_kind_names_errors():
    registry = Registry("widget")
    with pytest.raises(KeyError, match="unknown widget 'x'.*Registered widgets: \\[\\]"):
        registry.lookup("x")


def make_trajectory() -> Trajectory:
    return Trajectory(token_ids=[4, 7, 8, 10, 1], loss_mask=[0, 0, 0, 1, 1], logprobs=[0.0, 0.0, 0.0, -0.25, -1e-7],
                      versions=[-1, -1, -1, 3, 3], turn_ends=[5], turn_rewards=[1.0], reward=1.0, group_id="q-1",
                      stop_reason="stop", metrics={"success": 1.0})


def test_trajectory_round_trips_through_msgpack_unchanged():
    trajectory = make_trajectory()
    payload = trajectory.to_msgpack()
    assert isinstance(payload, bytes)
    back = Trajectory.from_msgpack(payload)
    assert back == trajectory
    assert back.logprobs[4] == -1e-7  # floats travel as doubles, not rounded
    assert back.num_generated == 2


def test_trajectory_to_dict_has_every_field_and_shares_no_list_with_the_trajectory():
    import dataclasses

    trajectory = dataclasses.replace(make_trajectory(), turn_obs_keys=["board"])
    data = trajectory.to_dict()
    assert data == dataclasses.asdict(trajectory)
    for name in ("token_ids", "loss_mask", "logprobs", "versions", "turn_ends", "turn_rewards", "turn_obs_keys",
                 "metrics"):
        assert data[name] is not getattr(trajectory, name), name
    data["token_ids"].append(99)
    data["metrics"]["extra"] = 1.0
    assert trajectory.token_ids == [4, 7, 8, 10, 1]
    assert "extra" not in trajectory.metrics


def test_multi_turn_fields_round_trip_and_older_payloads_get_their_defaults():
    import dataclasses

    trajectory = dataclasses.replace(make_trajectory(), turn_ends=[4, 5], turn_rewards=[-0.1, 1.0],
                                     turn_obs_keys=["P_\n_G", "_P\n_G"], void=True)
    assert Trajectory.from_msgpack(trajectory.to_msgpack()) == trajectory
    older = {k: v for k, v in make_trajectory().to_dict().items() if k not in ("turn_obs_keys", "void")}
    back = Trajectory.from_msgpack(msgpack.packb(older))
    assert back.turn_obs_keys == [] and back.void is False
    with pytest.raises(ValueError, match="1 turn_obs_keys for 2 turns"):
        dataclasses.replace(trajectory, turn_obs_keys=["x"])


def test_trajectory_rejects_misaligned_fields_and_unknown_keys():
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2 tokens"):
        Trajectory(token_ids=[1, 2], loss_mask=[1], logprobs=[0, 0], versions=[0, 0], turn_ends=[2],
                   turn_rewards=[0.0], reward=0.0, group_id="g", stop_reason="stop")
    data = make_trajectory().to_dict() | {"pickle": "no"}
    with pytest.raises(ValueError, match="unknown Trajectory fields \\['pickle'\\]"):
        Trajectory.from_msgpack(msgpack.packb(data))


def test_generation_messages_round_trip():
    config = GenerationConfig(n=4, max_new_tokens=7, temperature=0.0, stop_token_ids=[1], seed=3)
    assert GenerationConfig.from_dict(msgpack.unpackb(msgpack.packb(config.to_dict()))) == config
    output = GenerationOutput(qid="q", prompt_ids=[1, 2], output_ids=[[3]], logprobs=[[-0.5]], versions=[[2]],
                              stop_reasons=["stop"])
    assert GenerationOutput.from_dict(msgpack.unpackb(msgpack.packb(output.to_dict()))) == output


def test_a_model_request_is_the_seeds_plain_tuple():
    from rlsys.api import ModelRequest

    request = ModelRequest("q", [1, 2], GenerationConfig(n=2))
    assert request == ("q", [1, 2], GenerationConfig(n=2)) and isinstance(request, tuple)
    qid, token_ids, gconfig = request
    assert (qid, token_ids, gconfig.n) == (request.qid, request.token_ids, 2)
