"""`frozen-lake`: walk from the top-left corner to the goal in the bottom-right without falling through the ice.

Board text: `P` the player, `_` frozen ice, `O` a hole, `G` the goal. Reaching the goal gives 1.0 and ends
the episode; stepping on a hole ends it with 0.0. The ice is not slippery: a move goes where it says.
Maps are generated like gym's `generate_random_map`: each cell is ice with probability `frozen_prob`,
redrawn until a path from start to goal exists.
"""

import random

from rlsys.api import register_environment
from rlsys.impl.env.text_game import MOVES, GridGame, TextGameEnv, shortest_moves, step_to

START_CELL, ICE, HOLE, GOAL, PLAYER = "S", "_", "O", "G", "P"


def generate_lake(size: int, frozen_prob: float, seed: int, max_draws: int = 100_000) -> list[str]:
    """A size x size map (rows of S/_/O/G) with a path from S (top left) to G (bottom right). ValueError if none
    of `max_draws` maps has one (a second or two): with little ice on a big lake, drawing on would hang."""
    if size < 2:
        raise ValueError(f"a lake needs size >= 2, got {size}")
    rng = random.Random(seed)
    for _ in range(max_draws):
        rows = [[ICE if rng.random() < frozen_prob else HOLE for _ in range(size)] for _ in range(size)]
        rows[0][0], rows[-1][-1] = START_CELL, GOAL
        lake = ["".join(row) for row in rows]
        if shortest_path(lake) is not None:
            return lake
    raise ValueError(f"none of {max_draws} {size}x{size} lakes with frozen_prob {frozen_prob:g} had a path from start "
                     f"to goal (seed {seed}): raise frozen_prob or lower the size")


def shortest_path(lake: list[str], start: tuple[int, int] = (0, 0)) -> str | None:
    """The moves of a shortest safe path from `start` to the goal (breadth-first), or None if there is none."""
    size = len(lake)

    def safe_steps(here: tuple[int, int]):
        for move in MOVES:
            r, c = step_to(here, move)
            if 0 <= r < size and 0 <= c < size and lake[r][c] != HOLE:
                yield move, (r, c)

    return shortest_moves(start, lambda here: lake[here[0]][here[1]] == GOAL, safe_steps)


class FrozenLake(GridGame):
    def __init__(self, lake: list[str]):
        self.lake, self.position = lake, (0, 0)

    def cell(self, position: tuple[int, int]) -> str:
        return self.lake[position[0]][position[1]]

    def move(self, move: str) -> tuple[float, bool, bool]:
        r, c = step_to(self.position, move)
        if not (0 <= r < len(self.lake) and 0 <= c < len(self.lake)):
            return 0.0, False, False  # into the edge: nothing happens
        self.position = (r, c)
        here = self.cell(self.position)
        return (1.0 if here == GOAL else 0.0), here in (GOAL, HOLE), True

    @property
    def solved(self) -> bool:
        return self.cell(self.position) == GOAL

    def solution(self) -> str | None:
        return shortest_path(self.lake, self.position)

    def render(self) -> str:
        rows = [list(row.replace(START_CELL, ICE)) for row in self.lake]
        rows[self.position[0]][self.position[1]] = PLAYER
        return "\n".join("".join(row) for row in rows)


class FrozenLakeEnv(TextGameEnv):
    instruction = "Reach G, avoid O. Move U D L R.\n"

    def __init__(self, size: int = 4, frozen_prob: float = 0.8, max_steps: int = 8,
                 invalid_action_penalty: float = 0.1):
        super().__init__(max_steps, invalid_action_penalty)
        self.size, self.frozen_prob = size, frozen_prob

    def new_game(self, seed: int, options: dict) -> FrozenLake:
        return FrozenLake(generate_lake(int(options.get("size", self.size)),
                                        float(options.get("frozen_prob", self.frozen_prob)), seed))


register_environment("frozen-lake", FrozenLakeEnv)
