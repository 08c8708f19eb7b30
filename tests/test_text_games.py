"""FrozenLake and Sokoban as text environments: seeded maps, rendering, moves, penalties, ends, solvability."""

import asyncio

import pytest

from rlsys.impl.env.frozen_lake import FrozenLakeEnv, generate_lake, shortest_path
from rlsys.impl.env.sokoban import Sokoban, SokobanEnv, generate_room, solve
from rlsys.impl.env.text_game import parse_move


def run(coroutine):
    return asyncio.run(coroutine)


def test_moves_are_one_letter_or_word_in_any_case():
    assert [parse_move(t) for t in ("U", " d\n", "left", "RIGHT", "Up")] == ["U", "D", "L", "R", "U"]
    assert [parse_move(t) for t in ("", "UD", "go left", "x", "<answer>L</answer>")] == [None] * 5


def test_same_seed_same_lake_and_every_lake_is_solvable():
    assert generate_lake(4, 0.8, 7) == generate_lake(4, 0.8, 7)
    lakes = {tuple(generate_lake(4, 0.8, seed)) for seed in range(200)}
    assert len(lakes) > 150  # seeds really vary the map
    for seed in range(200):
        lake = generate_lake(5, 0.6, seed)
        path = shortest_path(lake)
        assert path is not None
        position = (0, 0)  # walk the path: never on a hole, ends on the goal
        for move in path:
            position = (position[0] + {"U": -1, "D": 1}.get(move, 0), position[1] + {"L": -1, "R": 1}.get(move, 0))
            assert lake[position[0]][position[1]] != "O"
        assert lake[position[0]][position[1]] == "G"


def test_a_lake_too_icy_to_cross_is_a_clear_error_not_a_hang():
    with pytest.raises(ValueError, match="none of 100000 2x2 lakes with frozen_prob 0 had a path"):
        generate_lake(2, 0.0, 1)  # all holes: the default bound, at its cheapest
    with pytest.raises(ValueError, match="none of 1000 8x8 lakes with frozen_prob 0.1 had a path"):
        generate_lake(8, 0.1, 1, max_draws=1000)  # a path has odds far below one in a million


def test_frozen_lake_renders_the_player_and_walks_the_shortest_path_to_the_goal():
    env = FrozenLakeEnv(max_steps=20)
    board, info = run(env.reset(seed=3))
    assert board == "P___\n___O\n__O_\nO__G" and info == {}
    assert env.first_observation(3) == env.instruction + board
    path = shortest_path(generate_lake(4, 0.8, 3))
    for k, move in enumerate(path):
        board, reward, terminated, truncated, info = run(env.step(move))
        assert info["action_is_valid"] and info["action_is_effective"] and not truncated
        assert terminated == (k == len(path) - 1) and reward == (1.0 if terminated else 0.0)
    assert info["success"] and board.endswith("P")


def test_invalid_action_costs_the_penalty_and_changes_nothing():
    env = FrozenLakeEnv(invalid_action_penalty=0.25)
    board, _ = run(env.reset(seed=3))
    after, reward, terminated, truncated, info = run(env.step("fly away"))
    assert (after, reward, terminated, truncated) == (board, -0.25, False, False)
    assert info == {"action_is_valid": False, "action_is_effective": False, "success": False}
    after, reward, *_, info = run(env.step("L"))  # into the edge: valid, not effective, free
    assert after == board and reward == 0.0 and info["action_is_valid"] and not info["action_is_effective"]


def test_a_hole_ends_the_episode_and_max_steps_truncates_it():
    env = FrozenLakeEnv()
    run(env.reset(seed=15))  # a hole right below the start
    board, reward, terminated, truncated, info = run(env.step("D"))
    assert terminated and not truncated and reward == 0.0 and not info["success"]
    assert board.splitlines()[1][0] == "P"
    env = FrozenLakeEnv(max_steps=2)
    run(env.reset(seed=3))
    assert run(env.step("U"))[3] is False
    _, _, terminated, truncated, _ = run(env.step("U"))
    assert truncated and not terminated
    with pytest.raises(RuntimeError, match="after the episode ended"):
        run(env.step("D"))


def test_stepping_after_the_game_ended_is_an_error_until_the_next_reset():
    """A fall into a hole (or a solved room) ends the episode as the step limit does: a step after it walked out of
    the hole and on to the goal, reward 1 after the loss."""
    env = FrozenLakeEnv()
    run(env.reset(seed=15))  # a hole right below the start
    assert run(env.step("D"))[2]
    for game in (env, run(env.fork())):
        with pytest.raises(RuntimeError, match="after the episode ended"):
            run(game.step("U"))
    run(env.reset(seed=15))
    assert run(env.step("R"))[2:4] == (False, False)


def test_reset_needs_a_seed_and_step_needs_a_reset():
    with pytest.raises(RuntimeError, match="before reset"):
        run(FrozenLakeEnv().step("D"))
    with pytest.raises(ValueError, match="needs a seed"):
        run(FrozenLakeEnv().reset())
    board_from_row, _ = run(FrozenLakeEnv().reset(options={"seed": 3, "size": 4}))
    assert board_from_row == run(FrozenLakeEnv().reset(seed=3))[0]
    assert len(run(FrozenLakeEnv().reset(options={"seed": 3, "size": 6}))[0].splitlines()) == 6


def test_a_fork_goes_on_independently():
    env = FrozenLakeEnv()
    run(env.reset(seed=3))
    run(env.step("R"))
    copy = run(env.fork())
    moved, *_ = run(copy.step("D"))
    stayed, *_ = run(env.step("L"))
    assert moved != stayed and env.steps == copy.steps == 2


def test_same_seed_same_room_and_every_room_is_solvable():
    assert generate_room(6, 1, 4).render() == generate_room(6, 1, 4).render()
    assert len({generate_room(6, 1, seed).render() for seed in range(100)}) > 80
    for seed in range(100):
        room = generate_room(6, 2 if seed % 2 else 1, seed)
        assert not room.solved and solve(room) is not None


def test_sokoban_renders_pushes_and_ends_when_solved():
    env = SokobanEnv()
    board, _ = run(env.reset(seed=3))
    assert board == "######\n#___P#\n#__XO#\n#____#\n#____#\n######"
    assert solve(generate_room(6, 1, 3)) == "LLDR"
    board, reward, terminated, _, info = run(env.step("U"))  # into the wall
    assert not info["action_is_effective"] and info["action_is_valid"] and reward == 0.0
    for move in "LLD":
        board, reward, terminated, _, info = run(env.step(move))
        assert not terminated and info["action_is_effective"]
    board, reward, terminated, _, info = run(env.step("R"))  # pushes the box onto the target
    assert board == "######\n#____#\n#__P*#\n#____#\n#____#\n######"
    assert terminated and reward == 1.0 and info["success"]


def test_sokoban_cannot_push_a_box_into_a_wall_or_another_box():
    border = {(r, c) for r in range(5) for c in range(5) if r in (0, 4) or c in (0, 4)}
    game = Sokoban(border, targets={(3, 1), (3, 3)}, boxes={(1, 2), (2, 2)}, player=(3, 2), size=5)
    assert game.render() == "#####\n#_X_#\n#_X_#\n#OPO#\n#####"
    assert game.move("U") == (0.0, False, False)  # box on box
    game.player = (2, 1)
    assert game.move("R") == (0.0, False, True)  # pushes the lower box right: free cell behind it
    assert game.boxes == {(1, 2), (2, 3)} and game.player == (2, 2)
    assert game.move("U") == (0.0, False, False)  # box against the top wall


def test_game_dataset_rows_rebuild_their_puzzles_and_splits_are_disjoint(tmp_path):
    from rlsys.data.dataset import load_rows
    from rlsys.data.games import generate_game_dataset

    env, options = FrozenLakeEnv(), {"size": 4, "frozen_prob": 0.8}
    train, held_out = generate_game_dataset(tmp_path / "a", env, options, seed=5, num_train=60, num_eval=20)
    again = generate_game_dataset(tmp_path / "b", env, options, seed=5, num_train=60, num_eval=20)
    assert [p.read_text() for p in (train, held_out)] == [p.read_text() for p in again]
    train_rows, eval_rows = load_rows(train), load_rows(held_out)
    assert len(train_rows) == 60 and len(eval_rows) == 20
    boards = [row["prompt"] for row in train_rows + eval_rows]
    assert len(set(boards)) == 80  # distinct puzzles, none in both splits
    for row in eval_rows:
        board, _ = run(env.reset(options=row))
        assert row["prompt"] == env.instruction + board and row["size"] == 4
        for move in row["answer"]:  # the reference answer solves it
            *_, info = run(env.step(move))
        assert info["success"]


def test_too_few_distinct_puzzles_is_a_clear_error(tmp_path):
    from rlsys.data.games import generate_game_dataset

    from rlsys.data.dataset import DatasetError

    with pytest.raises(DatasetError, match=r"only 51 distinct puzzles with {'size': 3}; .* lower dataset.num_train "
                                           r"and dataset.num_eval to at most 51 together"):
        generate_game_dataset(tmp_path, FrozenLakeEnv(), {"size": 3}, seed=0, num_train=100, num_eval=10)


def test_valid_moves_change_the_board_and_never_lose():
    from rlsys.data.games import valid_moves
    from rlsys.impl.env.frozen_lake import FrozenLake

    game = FrozenLake(generate_lake(4, 0.8, 15))  # start: ice to the right, a hole below
    assert valid_moves(game) == ["R"]
    assert game.position == (0, 0)  # probing moved nothing


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_frozen_lakes_warm_start_stops_only_above_what_one_move_to_every_board_scores(tmp_path, seed):
    """The warm start's held-out checks accept every valid move, so one move answered to every board passes many of
    them; a threshold below that let the warm start stop before the model's moves depended on the board, and its
    greedy policy answered one move to most boards (BENCHMARKS.md, "FrozenLake's warm start stops above what one
    move scores")."""
    from rlsys.cli import parse_config
    from rlsys.data.dataset import load_rows
    from rlsys.impl.env.text_game import MOVES
    from rlsys.model.tiny import HELD_OUT_CHECKS
    from rlsys.model.tokenizer import build_char_tokenizer

    config = parse_config(["experiment=async-ppo-frozen-lake", f"seed={seed}"])
    _, held_out = config.generate_dataset(tmp_path)
    _, checks = config.warm_start_examples(build_char_tokenizer(), [], load_rows(held_out))
    checks = checks[:HELD_OUT_CHECKS]  # the ones the warm start stops on
    blind = max(sum(move in check.accepted for check in checks) / len(checks) for move in MOVES)
    assert 0.75 < blind <= config.model.warm_start_accuracy - 0.05, blind
