"""Run authorization: one shared run key, and an HMAC proof at every door a peer could come in by.

hivemind 1.1's p2pd has no libp2p private-network (pre-shared key) option: anyone who can reach
a peer's port can connect to it. So the key works one level up (threat model: docs/security.md):

* **DHT records** (:class:`RunKeyValidator`): a keyed node signs every record it stores (an
  HMAC-SHA256 over key, subkey, value and expiration) and rejects unsigned or foreign-signed ones,
  both when asked to store them and in answers to its lookups. Only key holders write the run's
  keys: metrics, state donors, fingerprints, the rounds' matchmaking announcements (whose keys
  cannot be listed in advance, hence every record). One key is exempt: the run's public key-id
  header (``train/join.py``), so that a peer with a wrong key or none learns why it is refused.
* **Groups** (:class:`Admission`): each member's gathered metadata carries a proof bound to its
  peer id (which libp2p authenticates) and to the round; a leader refuses a follower without a
  valid one, and every member checks the whole group before reducing anything.
* **State download**: joiner and donor each prove the key, bound to both peer ids.

The key comes from ``net.run_key_file`` (``--run-key-file``) or ``net.run_key``
(``ODS_NET__RUN_KEY`` / TOML); :func:`load_run_key` reads and checks it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from pathlib import Path
from typing import Any, Optional, Sequence

import msgpack
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord

from opendiloco_stream.config import ConfigError, NetConfig
from opendiloco_stream.net.keys import run_key

MIN_KEY_BYTES = 16
KEYGEN = "python -c 'import secrets; print(secrets.token_urlsafe(32))' > run.key"
_MAGIC = b"ODSHMAC1"
_MAC_BYTES = 32
_SUFFIX = len(_MAGIC) + _MAC_BYTES


def load_run_key(net: NetConfig) -> Optional[bytes]:
    """The run key of ``net`` (surrounding whitespace removed), None if it sets none; a missing,
    unreadable or too short key raises ConfigError (one line, exit 2)."""
    if net.run_key is not None:
        raw, where = net.run_key.get_secret_value().encode(), "the run key (net.run_key / ODS_NET__RUN_KEY)"
    elif net.run_key_file:
        path = Path(net.run_key_file).expanduser()
        where = f"run key file {net.run_key_file}"
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise ConfigError(f"{where} does not exist: ask the run's operator for it, or create one with "
                              f"{KEYGEN}") from None
        except OSError as e:
            raise ConfigError(f"cannot read {where}: {e.strerror}") from None
    else:
        return None
    key = raw.strip()
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"{where} holds {len(key)} bytes; a run key needs at least {MIN_KEY_BYTES} "
                          f"(create one with {KEYGEN})")
    return key


def _encode(parts: Sequence[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)  # length-prefixed: no two inputs collide


class RunAuth:
    """Proofs of holding the run key: ``mac(purpose, *parts)`` and ``verify(mac, purpose, *parts)``.

    ``key_id`` names the key without revealing it (the first 8 hex digits of an HMAC of a label):
    peers publish it so that a peer with another key can be told which one the run uses.
    """

    def __init__(self, secret: bytes):
        self._key = hmac.new(bytes(secret), b"opendiloco-stream run key v1", hashlib.sha256).digest()
        self.key_id = self.mac("key-id").hex()[:8]

    @classmethod
    def from_config(cls, net: NetConfig) -> Optional["RunAuth"]:
        key = load_run_key(net)
        return None if key is None else cls(key)

    def mac(self, purpose: str, *parts: bytes) -> bytes:
        return hmac.new(self._key, _encode([purpose.encode(), *parts]), hashlib.sha256).digest()

    def verify(self, mac: Any, purpose: str, *parts: bytes) -> bool:
        return isinstance(mac, bytes) and hmac.compare_digest(mac, self.mac(purpose, *parts))


# ---------------------------------------------------------------------------------------- DHT records
def open_keys(run_id: str) -> set[bytes]:
    """The DHT key ids a :class:`RunKeyValidator` leaves unsigned: the run's public key-id header."""
    return {DHTID.generate(source=run_key(run_id, "keyid")).to_bytes()}


class RunKeyValidator:
    """Signs every DHT record with the run key and accepts only records signed with it.

    Applied last when signing and first when validating (highest priority), so it wraps what the
    metrics' RSA and schema validators produce. Records under :func:`open_keys` pass unsigned.
    A record validator as ``hivemind.DHT(record_validators=...)`` takes them: it has the interface
    of hivemind's ``RecordValidatorBase`` (validate, sign_value, strip_value, priority, merge_with)
    without subclassing it.
    """

    def __init__(self, auth: RunAuth, run_id: str):
        self._auth, self._open = auth, open_keys(run_id)

    def _mac(self, record: DHTRecord, value: bytes) -> bytes:
        return self._auth.mac("dht", record.key, record.subkey, value, struct.pack("<d", record.expiration_time))

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.key in self._open:
            return record.value
        return record.value + _MAGIC + self._mac(record, record.value)

    def validate(self, record: DHTRecord) -> bool:
        if record.key in self._open:
            return True
        value = record.value
        if len(value) < _SUFFIX or value[-_SUFFIX:-_MAC_BYTES] != _MAGIC:
            return False
        return hmac.compare_digest(value[-_MAC_BYTES:], self._mac(record, value[:-_SUFFIX]))

    def strip_value(self, record: DHTRecord) -> bytes:
        value = record.value
        if record.key in self._open or len(value) < _SUFFIX or value[-_SUFFIX:-_MAC_BYTES] != _MAGIC:
            return value
        return value[:-_SUFFIX]

    @property
    def priority(self) -> int:
        return 1000  # outermost: after RSASignatureValidator (10) and the schema validators (0)

    def merge_with(self, other: Any) -> bool:
        return False  # applied on its own, with every other validator


def run_validators(net: NetConfig) -> list:
    """The record validators a DHT node of ``net``'s run needs: the run key's, if it has one."""
    auth = RunAuth.from_config(net)
    return [] if auth is None else [RunKeyValidator(auth, net.run_id)]


# ---------------------------------------------------------------------------------------- groups, state
def _canonical(meta: dict) -> bytes:
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


class Admission:
    """What this peer requires of its groupmates, state donors and joiners: a proof of the run key
    (when it has one) and, once known, the same run fingerprint (``train/join.py``).

    The averaging service reads it at every round, so a ``fingerprint`` set late applies from
    the next round on. Every ``check_*`` returns None when all is well, else why not.
    """

    def __init__(self, auth: Optional[RunAuth] = None, fingerprint: str = ""):
        self.auth, self.fingerprint = auth, fingerprint

    # matchmaking and groups: the metadata each member gathers to the others
    def seal(self, meta: Any, peer_id: bytes) -> dict:
        """``meta`` (a member's metadata) with this peer's fingerprint and proof added."""
        out = {**(meta or {}), "fp": self.fingerprint}
        out.pop("auth", None)
        if self.auth is not None:
            out["auth"] = self.auth.mac("member", peer_id, _canonical(out))
        return out

    def check_member(self, user: Any, peer_id: bytes) -> Optional[str]:
        if not isinstance(user, dict):
            return "its metadata is not a record"
        if self.auth is not None:
            rest = {k: v for k, v in user.items() if k != "auth"}
            try:
                proof_ok = self.auth.verify(user.get("auth"), "member", peer_id, _canonical(rest))
            except (TypeError, ValueError):
                proof_ok = False
            if not proof_ok:
                return "it has no valid proof of the run key"
        if self.fingerprint and user.get("fp") != self.fingerprint:
            return f"its run fingerprint {str(user.get('fp'))[:12]!r} is not this peer's {self.fingerprint[:12]!r}"
        return None

    def check_gathered(self, blob: bytes, peer_id: bytes) -> Optional[str]:
        """Check one member's gathered bytes (msgpack of its sealed metadata, ``matchmaking.pack_meta``)."""
        try:
            user = msgpack.unpackb(blob, raw=False, strict_map_key=False)
        except Exception:
            return "its metadata is unreadable"
        return self.check_member(user, peer_id)

    def check_group(self, peer_ids: Sequence[Any], gathered: Sequence[bytes]) -> Optional[str]:
        """Why the group ``peer_ids`` (hivemind PeerIDs) with their ``gathered`` bytes is refused, if it is."""
        for i, (peer, blob) in enumerate(zip(peer_ids, gathered)):
            why = self.check_gathered(blob, peer.to_bytes())
            if why is not None:
                return f"member {i} ({str(peer)[-8:]}) is refused: {why}"
        return None

    # state download: each side proves the key to the other, bound to both peer ids
    def state_proof(self, role: str, sender: bytes, receiver: bytes) -> dict:
        proof = {"fp": self.fingerprint}
        if self.auth is not None:
            proof["auth"] = self.auth.mac(f"state-{role}", sender, receiver, self.fingerprint.encode())
        return proof

    def check_state_proof(self, proof: Any, role: str, sender: bytes, receiver: bytes) -> Optional[str]:
        proof = proof if isinstance(proof, dict) else {}
        fp = proof.get("fp") if isinstance(proof.get("fp"), str) else ""
        if self.auth is not None and not self.auth.verify(proof.get("auth"), f"state-{role}", sender, receiver,
                                                           fp.encode()):
            return "no valid proof of the run key"
        if self.fingerprint and fp and fp != self.fingerprint:
            return "another run fingerprint"
        return None
