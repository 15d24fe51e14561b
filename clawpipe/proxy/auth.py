"""Which rollout a request belongs to: its rollout key (:mod:`clawpipe.keys`), checked against the proxy's secret.

The key comes in the path (``/r/<key>/v1/...``, the base URL a harness is given) or as its API key (a bearer
token or ``x-api-key``). A request without a valid key belongs to no rollout and is answered 401 uncaptured.
"""

from __future__ import annotations

from clawpipe.errors import KeyVerificationError
from clawpipe.keys import RolloutKey, verify_key
from clawpipe.proxy import wire

_MAX_CACHED = 200_000  # verified keys remembered (a key is checked once, then looked up)


class RolloutKeys:
    """Verifies rollout keys with one secret, remembering the keys it has verified."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._known: dict[str, RolloutKey] = {}

    def authorize(self, req: wire.Request) -> tuple[RolloutKey | None, str]:
        """(the request's rollout or None, its path after the rollout prefix)."""
        path = req.path
        if path.startswith("/r/"):
            slash = path.find("/", 3)
            if slash < 0:
                return None, path
            return self.verify(path[3:slash]), path[slash:]
        # a bearer token or x-api-key: the first that is a rollout key (a harness may carry a stray token too)
        auth = req.headers.get(b"authorization")
        if auth is not None and auth[:7].lower() == b"bearer ":
            att = self.verify(auth[7:].strip().decode("latin-1"))
            if att is not None:
                return att, path
        xkey = req.headers.get(b"x-api-key")
        return (self.verify(xkey.strip().decode("latin-1")) if xkey is not None else None), path

    def verify(self, key: str) -> RolloutKey | None:
        """The rollout ``key`` names, or None when it is empty, malformed or not signed with this secret."""
        if not key:
            return None
        hit = self._known.get(key)
        if hit is not None:
            return hit
        try:
            att = verify_key(self._secret, key)
        except KeyVerificationError:
            return None
        if len(self._known) > _MAX_CACHED:
            self._known.clear()
        self._known[key] = att
        return att
