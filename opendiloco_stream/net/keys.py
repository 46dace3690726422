"""A run's names on a shared DHT, and the error of the network layer.

Every DHT key of a run goes through :func:`run_key`, so runs sharing a DHT never see each other.
Kept apart from ``dht.py`` (which starts nodes and imports hivemind) because the key names are
needed below it too: the run-key validators (``auth.py``) and the flags (``flags.py``).
"""

from __future__ import annotations

import re

from opendiloco_stream.config import ConfigError

_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


class NetError(ConfigError):
    """A networking problem the user can fix (bad address, unreachable peer, port in use): one line, exit 2."""


def check_run_id(run_id: str) -> str:
    """Return ``run_id`` if usable in DHT keys and fragment prefixes, else raise NetError."""
    if not _RUN_ID_RE.fullmatch(run_id or ""):
        # matchmaking keys are "<prefix>_r<round>.match": a '.' in the prefix would blur them
        raise NetError(f"run id {run_id!r} is not usable: use 1-64 letters, digits, '-' or '_' (e.g. 'llama-150m_v2')")
    return run_id


def run_prefix(run_id: str) -> str:
    """The namespace of one run on a shared DHT: ``ods[<run_id>]``."""
    return f"ods[{check_run_id(run_id)}]"


def run_key(run_id: str, *parts: str) -> str:
    """The DHT key (or fragment prefix) of ``parts`` within a run, e.g. ``run_key("r1", "metrics")``.

    The brackets end the run id unambiguously, so run "a" never reads run "a_b"'s keys. No '.' is
    produced: matchmaking uses the prefix in keys of the form ``<prefix>_r<round>.match``.
    """
    for part in parts:
        if not part or "." in part:
            raise ValueError(f"DHT key part {part!r} must be non-empty and contain no '.'")
    return "_".join((run_prefix(run_id), *parts))
