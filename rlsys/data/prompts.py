"""Prompt streams over a dataset: reshuffled every epoch, split across rollout workers, resumable."""

import itertools
import random
from collections.abc import Iterator

from rlsys.api import Prompt
from rlsys.model.tokenizer import row_prompt_ids


def prompt_by_id(rows: list[dict], tokenizer, qid: str) -> Prompt:
    """The prompt `prompt_stream` gave the id `{tag}-{epoch}-{row}`."""
    row = rows[int(qid.rsplit("-", 1)[1])]
    return Prompt(qid=qid, token_ids=row_prompt_ids(tokenizer, row), data=row)


def prompt_stream(rows: list[dict], tokenizer, tag: str, *, seed: int, shuffle: bool, shard: int = 0,
                  num_shards: int = 1, skip: frozenset[str] = frozenset()) -> Iterator[Prompt]:
    """Endless (shuffle=True: a new order per epoch) or one-pass stream of shard `shard`'s rows.

    Prompt ids are `{tag}-{epoch}-{row}`, the same in every process and run, so `skip` (the ids a
    resumed run already trained) keeps a prompt from being trained twice.
    """
    if shuffle and shard >= len(rows):  # an endless stream of no rows would look for its next prompt forever
        raise ValueError(no_share(len(rows), num_shards))
    for epoch in itertools.count() if shuffle else [0]:
        order = list(range(len(rows)))
        if shuffle:
            random.Random(seed + epoch).shuffle(order)
        for i in order[shard::num_shards]:
            qid = f"{tag}-{epoch}-{i}"
            if qid not in skip:
                yield Prompt(qid=qid, token_ids=row_prompt_ids(tokenizer, rows[i]), data=rows[i])


def no_share(n_rows: int, n_rollout_workers: int) -> str:
    return (f"{n_rows} training rows leave some of the {n_rollout_workers} rollout workers none to run: give each at "
            "least one (fewer cluster.n_rollout_workers, or more rows)")
