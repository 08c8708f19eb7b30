"""Pictures of a traced episode (text games): each turn's board as the model saw it, its move and reward,
side by side in a PNG strip and one after another in a GIF, so a person can watch what the agent did."""

import io
import re
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from rlsys.run_privacy import write_private

PAD, LINE = 8, 14
INK, PAPER, MOVE = (20, 20, 20), (250, 250, 245), (30, 90, 200)


def turn_panels(trajectory: dict) -> list[tuple[str, str, float | None]]:
    """(board, move, reward) of each model turn: the board is the last prompt or feedback before it."""
    panels, board = [], ""
    for message in trajectory["messages"]:
        if message["role"] == "assistant":
            panels.append((board, message["text"].strip(), message.get("reward")))
        else:
            board = message["text"]
    return panels


def draw_panel(board: str, caption: str, font) -> Image.Image:
    lines = board.rstrip("\n").split("\n") + ["", caption]
    width = max(int(font.getlength(line)) for line in lines) + 2 * PAD
    image = Image.new("RGB", (max(width, 120), len(lines) * LINE + 2 * PAD), PAPER)
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        draw.text((PAD, PAD + i * LINE), line, fill=MOVE if i == len(lines) - 1 else INK, font=font)
    return image


def render_episode(record: dict, directory: Path) -> list[Path]:
    """`<episode>.png` (all turns in a row) and `<episode>.gif` (one turn per frame) of the episode's first
    trajectory, captioned with move and reward; the final board closes both. Returns the paths."""
    trajectory = record["trajectories"][0]
    panels = turn_panels(trajectory)
    if not panels:
        return []
    font = ImageFont.load_default()
    images = [draw_panel(board, f"turn {k + 1}: {move!r}  reward {reward if reward is not None else '-'}", font)
              for k, (board, move, reward) in enumerate(panels)]
    last = trajectory["messages"][-1]
    if last["role"] != "assistant":  # the board after the last move, if the agent was shown one
        images.append(draw_panel(last["text"], f"end: reward {trajectory['reward']:g}", font))
    height = max(i.height for i in images)
    strip = Image.new("RGB", (sum(i.width for i in images) + PAD * (len(images) - 1), height), (200, 200, 200))
    x = 0
    for image in images:
        strip.paste(image, (x, 0))
        x += image.width + PAD
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name = slug(f"{record['tag']}-{record['episode_id']}")
    png, gif = directory / f"{name}.png", directory / f"{name}.gif"
    write_private(png, encoded(strip, "PNG"))  # a frame's name is foreseeable: never written through a link
    width = max(i.width for i in images)
    frames = []
    for image in images:
        frame = Image.new("RGB", (width, height), PAPER)
        frame.paste(image, (0, 0))
        frames.append(frame)
    write_private(gif, encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=800, loop=0))
    return [png, gif]


def encoded(image: Image.Image, image_format: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, image_format, **options)
    return buffer.getvalue()


def slug(text: str) -> str:
    """A file name from an episode id."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)
