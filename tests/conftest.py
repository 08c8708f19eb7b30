import hashlib
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rlsys.placement.cpu_threads import torch_loaded_with_the_roles_spin  # noqa: E402 (needs ROOT on the path)

# libgomp reads how its threads wait once, as torch loads, and the test modules load torch as they are collected,
# before any launcher can apply the roles' short spin: the in-process warm starts (launch(config) from a test) ran
# with libgomp's default spin, unlike a command-line run's. Loaded here first, with the short spin, as the launcher
# loads it; os.environ is left as it was, so what the tests see of the environment is unchanged. Alone on the cores
# the short spin is a little slower; beside other work the default one crawled, and a first test's in-process warm
# start ran past pytest's timeout (BENCHMARKS.md, "The warm start inside pytest").
torch_loaded_with_the_roles_spin()


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """The machine has two cores and tests start several processes; one torch thread each keeps them honest."""
    import torch

    torch.set_num_threads(1)


def shared_temp(tmp_path_factory, name: str) -> Path:
    """The folder `name` that every worker of this pytest run sees, made if missing: under pytest-xdist (the tiers'
    `-n 2`) each worker has a session and a base temp of its own, siblings in one folder; without it, the session's
    base temp holds it."""
    base = tmp_path_factory.getbasetemp()
    directory = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    directory.mkdir(exist_ok=True)
    return directory


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One model cache for the whole pytest run: the small test model is warm-started once, not once per module or
    per worker (a worker that wants it while the other builds it waits, as a second run of a sweep does: assets.py,
    one_builder)."""
    return shared_temp(tmp_path_factory, "cache")


@pytest.fixture(scope="session")
def warm_start_caches(tmp_path_factory):
    """One empty cache per warm-start identity (tests/helpers.py, warm_start_identity), for the whole pytest run: the
    math, math-tools and OpenAI-agent experiments teach the same model the same sums, so the first of them run starts
    from an empty cache and the others reuse what it built, as a user's second experiment would; the FrozenLake GiGPO
    run reuses the FrozenLake experiment's. A run that teaches anything else gets a cache of its own."""
    from tests.helpers import warm_start_identity

    def cache_for(config):
        digest = hashlib.sha256(warm_start_identity(config).encode()).hexdigest()[:16]
        return shared_temp(tmp_path_factory, f"cache-{digest}")

    return cache_for


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The character tokenizer saved where agents can load it by path."""
    from rlsys.model.tokenizer import build_char_tokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    build_char_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer():
    from rlsys.model.tokenizer import build_char_tokenizer

    return build_char_tokenizer()
