"""Asynchronous PPO: `python training/main_async_ppo.py [experiment=NAME] [key=value ...]`.

The run builds (or finds cached) its dataset and policy, starts a private Redis, then runs three kinds
of processes joined by it: inference workers (vLLM), rollout workers (agents and environments) and
the learner (PPO updates, weight publishing, checkpoints). It ends with held-out accuracy (or, where
episodes have no success to count, mean reward) before and after training. `--help` lists every setting.
"""

import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rlsys.cli import ConfigError, parse_config  # noqa: E402
from rlsys.console import held_out_line  # noqa: E402
from rlsys.launcher import launch  # noqa: E402
from rlsys.preflight import StartupError  # noqa: E402
from rlsys.prompt_ledger import describe  # noqa: E402
from rlsys.errors import RoleFailed  # noqa: E402


def main(argv: list[str]) -> dict:
    try:
        summary = launch(parse_config(argv))
    except (ConfigError, StartupError) as e:  # nothing was started: the message says what to fix
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except RoleFailed as e:  # the run started and could not go on: the roles logged the details above
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    print(held_out_line(summary))
    set_aside = summary["messages_set_aside"]
    print(f"{describe(summary['prompts'])}; {summary['dead_letters']} trajectory messages dead-lettered"
          + (f"; {set_aside} requests and replies set aside (messages:dead)" if set_aside else ""))
    return summary


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:
        print("interrupted: every process of the run was stopped", file=sys.stderr)
        raise SystemExit(130) from None
    except SystemExit as e:
        if e.code == 128 + signal.SIGTERM:  # rlsys.bus.raise_on_sigterm's, once the launcher's stop has run
            print("terminated (SIGTERM): every process of the run was stopped", file=sys.stderr)
        raise
