"""`sokoban`: push every box onto a target.

Board text: `#` wall, `_` floor, `O` target, `X` box, `*` box on a target, `P` player, `S` player on a
target (ROLL's symbols, with ASCII `*` for its box-on-target). The player walks onto floor and pushes a box
when the cell behind it is free; it cannot pull. Solving the puzzle gives 1.0 and ends the episode.

Rooms are generated backwards, as gym-sokoban does: boxes start on their targets and the player walks and
*pulls* them away at random; replaying those pulls as pushes solves the puzzle, so every room is solvable.
"""

import random

from rlsys.api import register_environment
from rlsys.impl.env.text_game import MOVES, GridGame, TextGameEnv, shortest_moves, step_to

WALL, FLOOR = "#", "_"
Cell = tuple[int, int]


class Sokoban(GridGame):
    def __init__(self, walls: set[Cell], targets: set[Cell], boxes: set[Cell], player: Cell, size: int):
        self.walls, self.targets, self.boxes, self.player, self.size = walls, targets, set(boxes), player, size

    def move(self, move: str) -> tuple[float, bool, bool]:
        ahead = step_to(self.player, move)
        if ahead in self.walls:
            return 0.0, False, False
        if ahead in self.boxes:
            beyond = step_to(ahead, move)
            if beyond in self.walls or beyond in self.boxes:
                return 0.0, False, False
            self.boxes = (self.boxes - {ahead}) | {beyond}
        self.player = ahead
        return (1.0 if self.solved else 0.0), self.solved, True

    @property
    def solved(self) -> bool:
        return self.boxes == self.targets

    def solution(self) -> str | None:
        return solve(self)

    def render(self) -> str:
        def symbol(cell: Cell) -> str:
            if cell in self.walls:
                return WALL
            on_target = cell in self.targets
            if cell == self.player:
                return "S" if on_target else "P"
            if cell in self.boxes:
                return "*" if on_target else "X"
            return "O" if on_target else FLOOR
        return "\n".join("".join(symbol((r, c)) for c in range(self.size)) for r in range(self.size))


def generate_room(size: int, num_boxes: int, seed: int, pulls: int = 30, max_tries: int = 1000) -> Sokoban:
    """A size x size room (walls around the border) whose boxes were pulled off their targets by a random walk."""
    if size < 4 or num_boxes < 1 or num_boxes > (size - 2) ** 2 - 2:
        raise ValueError(f"cannot place {num_boxes} boxes in a {size}x{size} room")
    rng = random.Random(seed)
    border = {(r, c) for r in range(size) for c in range(size) if r in (0, size - 1) or c in (0, size - 1)}
    inside = sorted({(r, c) for r in range(size) for c in range(size)} - border)
    for _ in range(max_tries):
        cells = rng.sample(inside, num_boxes + 1)
        targets, player = set(cells[:-1]), cells[-1]
        boxes = set(targets)
        for _ in range(pulls):
            move = rng.choice(list(MOVES))
            ahead, behind = step_to(player, move), step_to(player, _opposite(move))
            if ahead in border or ahead in boxes:
                continue
            if behind in boxes and rng.random() < 0.8:  # pull the box behind us into our cell
                boxes = (boxes - {behind}) | {player}
            player = ahead
        if boxes != targets:
            return Sokoban(border, targets, boxes, player, size)
    raise RuntimeError(f"no unsolved room after {max_tries} tries (seed {seed})")


def _opposite(move: str) -> str:
    return {"U": "D", "D": "U", "L": "R", "R": "L"}[move]


def solve(game: Sokoban, max_states: int = 200_000) -> str | None:
    """The moves of a shortest solution (breadth-first over player and box positions), or None."""
    def pushes(state):
        player, boxes = state
        for move in MOVES:
            probe = Sokoban(game.walls, game.targets, set(boxes), player, game.size)
            if probe.move(move)[2]:  # effective
                yield move, (probe.player, frozenset(probe.boxes))

    start = (game.player, frozenset(game.boxes))
    return shortest_moves(start, lambda state: state[1] == game.targets, pushes, max_states)


class SokobanEnv(TextGameEnv):
    instruction = "Push X onto O. Move U D L R.\n"

    def __init__(self, size: int = 6, num_boxes: int = 1, max_steps: int = 10, invalid_action_penalty: float = 0.1):
        super().__init__(max_steps, invalid_action_penalty)
        self.size, self.num_boxes = size, num_boxes

    def new_game(self, seed: int, options: dict) -> Sokoban:
        return generate_room(int(options.get("size", self.size)), int(options.get("num_boxes", self.num_boxes)), seed)


register_environment("sokoban", SokobanEnv)
