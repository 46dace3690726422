"""Checks at join: the run key and the run fingerprint, each refused in one line (exit code 2).

    gate = RunGate(dht, run_id, auth)        # auth: net.auth.RunAuth or None
    gate.check_key()                          # before anything else is stored or read
    gate.check_fingerprint(fingerprint_fields(cfg, model))   # before state download and rounds
    gate.wait_for_peers(3, timeout=600)       # optional: until 3 peers of the run are ready to train

Three records per peer, under the run (``run_key``) with the peer id as subkey, kept alive by a
background thread until :meth:`RunGate.close`:

* ``keyid``: the id of the peer's run key (``RunAuth.key_id``) or ``""``: public and unsigned, the
  one record a run key leaves open (``net/auth.py``), so that a peer with another key, or none,
  is told so instead of finding nobody. It only words the refusal: an outsider can forge it to
  make joiners refuse (a denial of service), never to get in.
* ``fingerprint``: what peers must share to average together (:func:`fingerprint_fields`: protocol,
  mode, codec, H, P, the model's parameter names and shapes). Signed by the run key when there is
  one. A joiner compares its own with the run's (the oldest record) and is refused with the first
  field that differs: ``refused: codec differs: this peer fp4-e3m0, the run int8``.
* ``ready``: the peer has passed its checks and built its model (``--wait-for-peers N``: peers
  started together wait for N of these before their first step, so a slow start-up does not send
  the others' first rounds out alone).

It sits above the transport (the fingerprint names its protocol version and codec) and below the
``peer`` command, its one user; the records themselves are plain DHT records (``net.keys.run_key``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from typing import Any, Callable, Optional

from hivemind.utils import get_dht_time

from opendiloco_stream.net.keys import NetError, run_key
from opendiloco_stream.transport.factory import codec_from_config
from opendiloco_stream.transport.reduce import PROTOCOL_VERSION, codec_spec

logger = logging.getLogger(__name__)

JOIN_VERSION = 1
FIELD_NAMES = {"protocol": "protocol", "mode": "mode", "codec": "codec", "codec_params": "codec parameters",
               "inner_steps": "H (inner steps)", "fragments": "P (fragments)", "fragment_pattern": "fragment pattern",
               "model": "model (parameter names and shapes)"}


class JoinRefused(NetError):
    """This peer may not join the run (another run key, none, or another fingerprint): one line, exit 2."""


def fingerprint_fields(cfg: Any, model: Any) -> dict[str, str]:
    """The fingerprint of ``cfg`` (a RunConfig) and ``model``, field by field, in the order compared."""
    d = cfg.diloco
    shapes = [f"{name}:{list(p.shape)}" for name, p in model.named_parameters()]
    digest = hashlib.sha256("\n".join(shapes).encode()).hexdigest()[:16]
    numel = sum(p.numel() for p in model.parameters())
    return {"protocol": f"reduce v{PROTOCOL_VERSION}, join v{JOIN_VERSION}", "mode": d.mode, "codec": d.codec,
            "codec_params": "/".join(str(x) for x in codec_spec(codec_from_config(cfg))[1:]),
            "inner_steps": str(d.inner_steps), "fragments": str(d.num_fragments),
            "fragment_pattern": d.fragment_pattern,
            "model": f"{len(shapes)} tensors, {numel} parameters, sha256 {digest}"}


def fingerprint_digest(fields: dict[str, str]) -> str:
    """One hash of the fields (what groupmates compare in every round)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def first_difference(mine: dict[str, str], run: dict[str, Any]) -> Optional[str]:
    """``"<field> differs: this peer X, the run Y"`` for the first field that differs, else None."""
    for name, label in FIELD_NAMES.items():
        if mine.get(name) != run.get(name):
            return f"{label} differs: this peer {mine.get(name)}, the run {run.get(name, '(not set)')}"
    return None


#: how long after the last awaited peer became ready peers started together take their first step:
#: covers a poll (0.5 s) and a DHT read at a few hundred ms RTT, so every waiting peer has seen it
START_MARGIN_S = 2.0


def common_start(sinces: list[float], count: int, margin_s: float = START_MARGIN_S) -> float:
    """When peers that waited for ``count`` ready peers take their first step (DHT time): ``margin_s``
    after the ``count``-th earliest ``ready`` record. Every peer computes it from the same records,
    so peers that waited for each other agree on it; one that joins a swarm whose ``count`` peers were
    ready long ago gets a time in the past (no hold)."""
    if len(sinces) < count or count < 1:
        raise ValueError(f"{len(sinces)} ready records, {count} awaited")
    return sorted(sinces)[count - 1] + margin_s


class RunGate:
    """This peer's join checks and the records that let later joiners check against it."""

    def __init__(self, dht: Any, run_id: str, auth: Any = None, *, expiration: float = 60.0, timeout: float = 15.0):
        self.dht, self.run_id, self.auth = dht, run_id, auth
        self.expiration, self.timeout = float(expiration), float(timeout)
        self.peer_id = str(dht.peer_id)
        self.key_id = auth.key_id if auth is not None else ""
        self._records: dict[str, Any] = {}  # part -> the value to keep alive
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.start_at: Optional[float] = None  # wait_for_peers: the common first step's DHT time

    # ------------------------------------------------------------------ reads
    def _others(self, part: str) -> list[tuple[Any, float]]:
        """The unexpired ``(value, expiration)`` of every other peer under ``part``."""
        try:
            found = self.dht.get(run_key(self.run_id, part), latest=True, return_future=True).result(self.timeout)
        except Exception as e:  # cannot check: go on; groups and state downloads check every peer anyway
            logger.warning("could not read the run's %s records (%r): joining without that check", part, e)
            return []
        if found is None or not isinstance(found.value, dict):
            return []
        now = get_dht_time()
        return [(item.value, item.expiration_time) for subkey, item in found.value.items()
                if subkey != self.peer_id and item.expiration_time >= now]

    def check_key(self) -> None:
        """Refuse (JoinRefused) if the run's peers use another run key, or none where this peer has one."""
        ids = {v.get("key_id") for v, _ in self._others("keyid") if isinstance(v, dict)}
        ids = {i for i in ids if isinstance(i, str)}
        if ids and self.key_id not in ids:
            run = f"run '{self.run_id}'"
            if not self.key_id:
                raise JoinRefused(f"refused: {run} requires a run key and this peer has none: pass the run's key "
                                  "file with --run-key-file (or set ODS_NET__RUN_KEY)")
            theirs = sorted(ids - {""})
            if not theirs:
                raise JoinRefused(f"refused: this peer has a run key but {run} runs without one: drop "
                                  "--run-key-file / ODS_NET__RUN_KEY, or use another --run-id")
            raise JoinRefused(f"refused: run key mismatch: {run} uses key {'/'.join(theirs)}, this peer's key is "
                              f"{self.key_id}: get the run's key file from its operator")
        self._announce("keyid", {"key_id": self.key_id})

    def check_fingerprint(self, fields: dict[str, str]) -> None:
        """Refuse (JoinRefused) if the run's fingerprint differs from ``fields``, naming the first field."""
        records = [v for v, _ in self._others("fingerprint")
                   if isinstance(v, dict) and isinstance(v.get("fields"), dict) and isinstance(v.get("since"), float)]
        if records:
            run = min(records, key=lambda v: v["since"])  # the run is what its oldest peer runs
            why = first_difference(fields, run["fields"])
            if why is not None:
                raise JoinRefused(f"refused: {why}")
        self._announce("fingerprint", {"fields": dict(fields), "since": float(get_dht_time())})

    def wait_for_peers(self, count: int, timeout: float, should_stop: Optional[Callable[[], bool]] = None,
                       progress: Optional[Callable[[int, float], None]] = None, poll_s: float = 0.5,
                       progress_every_s: float = 10.0, start_margin_s: float = START_MARGIN_S) -> int:
        """Say this peer is ready to train (a ``ready`` record), then wait until ``count`` peers of the
        run (this one included) are, at most ``timeout`` seconds or until ``should_stop()``. Returns
        the peers ready when it stopped waiting (less than ``count`` after a timeout or a stop).
        ``progress(ready, waited_s)`` is called every ``progress_every_s`` while it waits.

        Peers that were waiting for each other start together: each sees the others' ready records
        at its own next poll (up to ``poll_s`` plus a DHT read apart, a second or more across
        continents, which eager peers would carry as a step lag for the whole run), so all of them
        hold until the same instant, :func:`common_start` of the records (``start_margin_s`` after
        the ``count``-th peer became ready, on the DHT's clock), and ``start_at`` says which. A peer
        that finds the ``count`` peers ready long ago (a running swarm) starts at once."""
        since = float(get_dht_time())
        self._announce("ready", {"since": since})
        start = last = time.monotonic()
        while True:
            others = [v["since"] for v, _ in self._others("ready")
                      if isinstance(v, dict) and isinstance(v.get("since"), float)]
            ready = 1 + len(others)
            waited = time.monotonic() - start
            stopped = should_stop is not None and should_stop()
            if ready >= count and count > 1 and not stopped:
                self.start_at = common_start([since, *others], count, start_margin_s)
                while not (should_stop is not None and should_stop()):
                    hold = min(start_margin_s, self.start_at - float(get_dht_time()))
                    if hold <= 0:
                        break
                    time.sleep(min(hold, poll_s))
                return ready
            if ready >= count or waited >= timeout or stopped:
                return ready
            if progress is not None and time.monotonic() - last >= progress_every_s:
                last = time.monotonic()
                progress(ready, waited)
            time.sleep(min(poll_s, max(0.0, timeout - waited)))

    # ------------------------------------------------------------------ records
    def _store(self, part: str, value: Any) -> bool:
        future = self.dht.store(run_key(self.run_id, part), value, expiration_time=get_dht_time() + self.expiration,
                                subkey=self.peer_id, return_future=True)
        return bool(future.result(timeout=self.timeout))

    def _announce(self, part: str, value: Any) -> None:
        self._records[part] = value
        if not self._store(part, value):  # the first replica's answer: a node without the key refuses it
            logger.info("the DHT did not confirm this peer's %s record (refreshed every %.0f s)", part,
                        self.expiration / 3)
        if self._thread is None:
            self._thread = threading.Thread(target=self._refresh, name="run-gate", daemon=True)
            self._thread.start()

    def _refresh(self) -> None:
        while not self._stop.wait(self.expiration / 3):
            for part, value in list(self._records.items()):
                try:
                    self._store(part, value)
                except Exception as e:  # a DHT hiccup: retried at the next refresh
                    logger.debug("refreshing the %s record: %r", part, e)

    def close(self) -> None:
        """Stop refreshing (the records expire on their own)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
