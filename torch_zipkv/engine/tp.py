"""The engine's tensor-parallel exchange: rank 0's ``add_request`` / ``abort`` calls reach every rank at the start of
each step, and the ranks check that they agree (docs/engine.md, "Tensor parallelism"). One host collective (gloo) a
step, no device sync."""

from __future__ import annotations

import hashlib

import torch.distributed as dist

from ..distributed import exchange
from .params import RequestOutput


def digest(value) -> bytes:
    """A short digest of ``value`` (ints, strs, tuples, SamplingParams: their repr is the same in every process)."""
    return hashlib.blake2b(repr(value).encode(), digest_size=16).digest()


class RankSync:
    """What one rank's engine exchanges with the others over the host ``group``.

    The engine :meth:`record` s each ``add_request`` / ``abort`` made on this rank, and calls :meth:`sync` at the
    start of each step and :meth:`after_step` at its end. ``replay_add(rid, prompt, params, seed)`` and
    ``replay_abort(rid)`` carry out rank 0's calls on a rank that made none; ``draw_seed()`` draws from the engine's
    generator as rank 0 did for a request without a seed, so that later same calls draw the same seeds."""

    def __init__(self, group, *, replay_add, replay_abort, draw_seed):
        self.group = group
        self.rank = dist.get_rank(group)
        self._replay_add, self._replay_abort, self._draw_seed = replay_add, replay_abort, draw_seed
        self._log: list[tuple] = []  # this rank's calls since the last step
        self.state_digest = b""  # of this rank's state after the last step

    def record(self, event: tuple) -> None:
        """``("add", rid, prompt tuple, params, seed, has kv_source, cache_salt)`` or ``("abort", rid)``."""
        self._log.append(event)

    def sync(self, step: int) -> None:
        """Bring rank 0's calls since the last step to every rank, and check that the ranks agree.

        Rank 0 sends its calls; every other rank sends a digest of its own calls: a rank that made none replays
        rank 0's (a rank that only steps: aborts from rank 0, requests arriving at rank 0), one that made them must
        have made the same. Every rank also sends a digest of its state after the last step (requests admitted,
        their progress, the tokens reported). Everything else is identical by construction (admission through the
        cache's agreed capacity, sampling on the same logits with the same seeds), so a difference is a bug; every
        rank raises the same error rather than one rank leaving the others waiting in a collective."""
        log, self._log = self._log, []
        mine = log if self.rank == 0 else (digest(log) if log else None)
        got = exchange((self.state_digest, mine), self.group)
        events = got[0][1]
        diverged = [r for r, (state, _) in enumerate(got) if state != got[0][0]]
        if diverged:
            raise RuntimeError(f"tensor-parallel ranks {diverged} disagree with rank 0 on the engine's state after "
                               f"step {step} (requests admitted, tokens sampled); the ranks must run the same model "
                               "and engine arguments, with every rank calling step()")
        want = digest(events)
        differ = [r for r, (_, calls) in enumerate(got[1:], 1) if calls is not None and calls != want]
        if differ:
            raise RuntimeError(f"ranks {differ} called add_request / abort differently from rank 0 before step "
                               f"{step + 1}: under tensor parallelism a rank other than 0 makes the same calls "
                               "as rank 0 or none (it then follows rank 0's)")
        followers = [r for r, (_, calls) in enumerate(got[1:], 1) if calls is None]
        injected = [e[1] for e in events if e[0] == "add" and e[5]]
        if followers and injected:
            raise RuntimeError(f"requests {injected} were added on rank 0 with a kv_source, which ranks {followers} "
                               "cannot replay: each rank must add such a request with its own kv_source")
        if self.rank != 0 and not log:
            for e in events:
                if e[0] == "add":
                    if e[3].seed is None:
                        self._draw_seed()
                    self._replay_add(e[1], list(e[2]), e[3], e[4], cache_salt=e[6])
                else:
                    self._replay_abort(e[1])

    def after_step(self, step: int, next_id: int, scheduler, outs: list[RequestOutput]) -> None:
        """Remember what every rank must agree on after a step: the requests waiting and running with their
        progress, and the tokens this step reported."""
        running = tuple((r.rid, r.state, r.prefilled, r.launched, len(r.tokens)) for r in scheduler.running)
        reported = tuple((o.request_id, tuple(o.new_token_ids), o.finish_reason) for o in outs)
        self.state_digest = digest((step, next_id, tuple(r.rid for r in scheduler.waiting), running, reported))
