"""What work in a forked averager process (``averager.FragmentAverager``) has to allow for."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def once_more_on_bad_pool(fn, *args):
    """``fn(*args)``, once more if torch says ``Invalid thread pool!``: in this forked averager
    process, a thread's first parallel op re-creates torch's thread pool, and on a 16-core GPU
    machine (torch 2.11) one of the first round's executor threads failed there, every fresh
    swarm's first round; the same threads ran every later round."""
    try:
        return fn(*args)
    except RuntimeError as e:
        if "Invalid thread pool" not in str(e):
            raise
        logger.info("torch's thread pool was not ready in this thread (%s): once more", str(e).splitlines()[0][:80])
        return fn(*args)
