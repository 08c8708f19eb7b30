"""Grid puzzles as gym-like text environments (ROLL's FrozenLake and Sokoban), sharing one set of rules.

The board is rendered as text, one row per line. The model answers with one move: `U`, `D`, `L` or `R`
(or the word `Up`, `Down`, `Left`, `Right`), any case, surrounding whitespace ignored. One character is
the shortest answer, which matters for the character-level default tokenizer. Anything else is an invalid
action: it costs `invalid_action_penalty`, changes nothing, and the episode goes on (as in ROLL). A move
into a wall is valid but not effective. Every step reports `action_is_valid`, `action_is_effective` and
`success` in its info. After `max_steps` steps the episode is truncated. A step after the episode ended
(terminated or truncated) is an error until the next `reset`.

A board is generated from the seed alone, so the same seed always gives the same, solvable, puzzle.
"""

import abc
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from rlsys.api import EnvironmentService

MOVES = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
MOVE_WORDS = {"UP": "U", "DOWN": "D", "LEFT": "L", "RIGHT": "R"}


def parse_move(text: str) -> str | None:
    """The move a response names (`U`/`D`/`L`/`R`), or None if it is not exactly one move."""
    word = text.strip().upper()
    if word in MOVES:
        return word
    return MOVE_WORDS.get(word)


def step_to(position: tuple[int, int], move: str) -> tuple[int, int]:
    dr, dc = MOVES[move]
    return position[0] + dr, position[1] + dc


def shortest_moves(start: Hashable, is_goal: Callable[[Any], bool],
                   successors: Callable[[Any], Iterator[tuple[str, Hashable]]],
                   max_states: int | None = None) -> str | None:
    """Breadth-first search: the moves of a shortest path from `start` to a state where `is_goal` holds, or
    None if there is none (within `max_states` states). `successors(state)` yields (move, next state)."""
    previous: dict = {start: None}
    frontier = deque([start])
    while frontier and (max_states is None or len(previous) < max_states):
        state = frontier.popleft()
        if is_goal(state):
            moves = []
            while previous[state] is not None:
                state, move = previous[state]
                moves.append(move)
            return "".join(reversed(moves))
        for move, following in successors(state):
            if following not in previous:
                previous[following] = (state, move)
                frontier.append(following)
    return None


class GridGame(abc.ABC):
    """The puzzle itself: a board, its moves and its text; no parsing, penalties or step limits."""

    @abc.abstractmethod
    def move(self, move: str) -> tuple[float, bool, bool]:
        """Applies one of MOVES; returns (reward, terminated, effective)."""

    @abc.abstractmethod
    def render(self) -> str:
        """The board as text, one row per line."""

    @property
    @abc.abstractmethod
    def solved(self) -> bool:
        ...

    @abc.abstractmethod
    def solution(self) -> str | None:
        """The moves of a shortest solution from the current state, or None if there is none."""


class TextGameEnv(EnvironmentService):
    """Parses the model's move, applies it to a GridGame, enforces the step limit and the format penalty."""

    instruction = ""  # what the game is, for the first observation; subclasses set it

    def __init__(self, max_steps: int, invalid_action_penalty: float = 0.1):
        if max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {max_steps}")
        self.max_steps, self.invalid_action_penalty = max_steps, invalid_action_penalty
        self.game: GridGame | None = None
        self.steps, self.terminated = 0, False

    @abc.abstractmethod
    def new_game(self, seed: int, options: dict) -> GridGame:
        """The board for `seed`; `options` (the dataset row) may carry its size."""

    async def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        options = options or {}
        seed = options.get("seed") if seed is None else seed
        if seed is None:
            raise ValueError(f"{type(self).__name__}.reset needs a seed (argument or options['seed'])")
        self.game, self.steps, self.terminated = self.new_game(int(seed), options), 0, False
        return self.game.render(), {}

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.game is None:
            raise RuntimeError("step() before reset()")
        if self.terminated or self.steps >= self.max_steps:  # a game moved on after a fall or a win
            raise RuntimeError(f"step() after the episode ended ({'terminated' if self.terminated else 'truncated'} "
                               f"at step {self.steps})")
        self.steps += 1
        move = parse_move(action)
        if move is None:
            reward, terminated, effective = -self.invalid_action_penalty, False, False
        else:
            reward, terminated, effective = self.game.move(move)
        self.terminated = terminated
        info = {"action_is_valid": move is not None, "action_is_effective": effective, "success": self.game.solved}
        truncated = not terminated and self.steps >= self.max_steps
        return self.game.render(), reward, terminated, truncated, info

    def first_observation(self, seed: int, options: dict | None = None) -> str:
        """The dataset prompt of a seed: the instruction, then the board (what `reset` will rebuild)."""
        return self.instruction + self.new_game(seed, options or {}).render()
