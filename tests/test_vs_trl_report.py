"""bench/vs_trl.py's ratio, from a run's saved curves at any target: both sides there, or a bound where one is not."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.vs_trl import compare  # noqa: E402


def side(points: list[tuple[int, float, float]], train_s: float) -> dict:
    """A side as --out saves it: (batch, seconds, accuracy) snapshots after the shared start."""
    curve = [{"batch": 0, "samples": 0, "seconds": 0.0, "accuracy": 0.46}]
    curve += [{"batch": b, "samples": 128 * b, "seconds": s, "accuracy": a} for b, s, a in points]
    return {"curve": curve, "samples_per_second": 20.0, "cpu_s_per_sample": 0.1, "cores_busy": 2.0,
            "train_s": train_s, "wall_s": train_s + 30, "load_average": [1.0, 2.0],
            "learner_s_per_step": {"compute": 4.0, "publish": 0.02, "wait_data": 0.05}}


SAVED = {"args": {"steps": 30}, "cores": 2, "initial_accuracy": 0.46,
         "results": {"trl": side([(10, 100.0, 0.52), (20, 200.0, 0.61), (30, 300.0, 0.63)], 300.0),
                     "rlsys": side([(10, 50.0, 0.565), (20, 100.0, 0.64), (30, 150.0, 0.665)], 150.0)}}


def last_line(capsys, saved: dict, points: float) -> str:
    compare(saved, points)
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_the_ratio_is_taken_at_the_target_asked(capsys):
    # +15 is 61%: TRL at batch 20 (200 s), rlsys at batch 20 (100 s); 56.5% is +10.5, so rlsys's +10 is its batch 10
    assert last_line(capsys, SAVED, 15).startswith("ratio: 2.00 ")
    compare(SAVED, 20)
    table = capsys.readouterr().out
    assert "to +10" in table and "50.0 s" in table  # half of +20: rlsys at 50 s


def test_a_side_that_never_got_there_bounds_the_ratio_by_its_whole_run(capsys):
    # +20 is 66%: rlsys at 150 s, TRL never in its 300 s, so TRL's time is more than 2x rlsys's
    assert last_line(capsys, SAVED, 20) == ("ratio: n/a (TRL did not reach +20 points in 30 batches, 300.0 s of "
                                            "training: more than 2.00 times rlsys's 150.0 s)")
    swapped = {**SAVED, "results": {"trl": SAVED["results"]["rlsys"], "rlsys": SAVED["results"]["trl"]}}
    assert last_line(capsys, swapped, 20) == ("ratio: n/a (rlsys did not reach +20 points in 30 batches, 300.0 s of "
                                              "training: less than 0.50, TRL took 150.0 s)")
    assert last_line(capsys, SAVED, 25) == "ratio: n/a (neither side reached +25 points in 30 batches)"
