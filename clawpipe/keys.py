"""Per-rollout keys: unguessable, and verifiable by the proxy alone (no shared store).

A key is ``cp1.<payload>.<mac>`` where payload is base64url of ``run_id \\x1f iteration \\x1f rollout_id``
and mac is the first 16 bytes of HMAC-SHA256(secret, payload), base64url. The sandbox runner mints a
key per rollout; the proxy verifies it and reads the attribution out of it. A harness that knows its
own key learns nothing about another rollout's key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from dataclasses import dataclass

from clawpipe.capture import INT32_MAX, RUN_ID_MAX, SAFE_RUN_ID
from clawpipe.errors import KeyVerificationError

PREFIX = "cp1"
_SEP = "\x1f"


@dataclass(frozen=True, slots=True)
class RolloutKey:
    run_id: str
    iteration: int
    rollout_id: str


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(secret: bytes, payload: str) -> str:
    return _b64(hmac.new(secret, payload.encode(), hashlib.sha256).digest()[:16])


def mint_key(secret: bytes, *, run_id: str, iteration: int, rollout_id: str) -> str:
    """Return the key that attributes calls to this rollout. Refuses what landing would reject (a run id
    too long to name a partition, an iteration outside its column), so such a rollout fails before any of
    its calls is captured rather than after."""
    for name, value in (("run_id", run_id), ("rollout_id", rollout_id)):
        if not value or _SEP in value or "/" in value:
            raise KeyVerificationError(f"{name}={value!r} must be non-empty without '/' or \\x1f")
    if not re.match(SAFE_RUN_ID, run_id):
        raise KeyVerificationError(f"run_id={run_id!r} must be letters, digits and ._:@+- (it names a lake partition)")
    if len(run_id) > RUN_ID_MAX:
        raise KeyVerificationError(f"run_id is {len(run_id)} characters long; at most {RUN_ID_MAX} name a partition")
    if isinstance(iteration, bool) or not 0 <= int(iteration) <= INT32_MAX:
        raise KeyVerificationError(f"iteration={iteration!r} must be an integer in [0, {INT32_MAX}]")
    payload = _b64(_SEP.join((run_id, str(int(iteration)), rollout_id)).encode())
    return f"{PREFIX}.{payload}.{_mac(secret, payload)}"


def verify_key(secret: bytes, key: str) -> RolloutKey:
    """Return the attribution a key carries, or raise KeyVerificationError if it is forged or malformed."""
    parts = key.split(".")
    if len(parts) != 3 or parts[0] != PREFIX or not key.isascii():
        raise KeyVerificationError("malformed rollout key: expected cp1.<payload>.<mac> from the rollout's base URL")
    payload, mac = parts[1], parts[2]
    if not hmac.compare_digest(_mac(secret, payload), mac):
        raise KeyVerificationError("rollout key does not verify: it was not minted by this proxy's secret")
    try:
        run_id, iteration, rollout_id = _unb64(payload).decode().split(_SEP)
        return RolloutKey(run_id=run_id, iteration=int(iteration), rollout_id=rollout_id)
    except ValueError as exc:  # a verified mac over a bad payload means a bug in minting
        raise KeyVerificationError(f"rollout key payload is unreadable: {exc}") from exc
