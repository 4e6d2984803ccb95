"""amp's logger: rank 0 only, with a rate limit for repeated messages."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("mixprec.amp")


def is_rank_zero() -> bool:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return True


def log_rank0(level: int, msg: str, *args) -> None:
    if is_rank_zero():
        logger.log(level, msg, *args)


class OverflowLog:
    """Reports skipped steps without flooding the log.

    The overflows numbered 1, 2, 4, ... below ``every`` are logged, then one line per
    ``every``, each carrying the running count and the scale: a diverging fp16 run skips
    thousands of steps and used to print each one, while the burst of a run's first steps
    (the scale falling from 65536 to what the model needs) shows where the scale went.
    """

    def __init__(self, verbosity: int, every: int = 100):
        self.verbosity = verbosity
        self.every = every
        self.count = 0

    def overflow(self, loss_id: int, new_scale: float, floor: float = 0.0) -> None:
        self.count += 1
        if self.verbosity <= 0:
            return
        count = self.count
        if (count < self.every and count & (count - 1) == 0) or count % self.every == 0:
            # (At min_loss_scale the scale no longer falls: "reduced to" it again would say
            # that the back-off is still working.)
            log_rank0(
                logging.INFO,
                "Gradient overflow (loss_id %d): skipping step, loss scale "
                + ("at min_loss_scale, %g" if new_scale <= floor else "reduced to %g")
                + " (%d step(s) skipped so far).",
                loss_id, new_scale, self.count,
            )
