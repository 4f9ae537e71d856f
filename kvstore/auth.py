"""The cluster secret, and the challenge by which the two ends of a control-plane link
prove they hold it.

Every link of the control plane — a frontend's channel to a worker, a KV transfer's
connection, the internal HTTP listener — is authenticated with one shared secret (the
cluster secret; ``--cluster-secret`` or ``FERRY_CLUSTER_SECRET``, else one a frontend
makes up for the workers it spawns). A link opens with a mutual challenge: each side
sends a fresh random nonce and answers the other's with an HMAC-SHA256 over both nonces,
its role and the link's name; the answers are compared in constant time. Nothing of the
secret crosses the wire, and an answer cannot be replayed on another link or in the
other direction.

What it protects against: anyone who can reach a port but does not hold the secret
(another host, another user of this host, a client of the public API) can neither join
as a worker nor pose as a frontend to one, nor write into a KV cache, nor receive a
prompt. What it does not: it does not encrypt (prompts and KV travel in the clear —
keep the control plane on a private network, or tunnel it), and it authenticates the
start of a connection, not each message, so an attacker who can inject packets into an
established TCP connection on the path is not stopped.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

NONCE_BYTES = 16
PROOF_BYTES = 32


class AuthError(ConnectionError):
    """The peer did not prove it holds the cluster secret."""


def make_secret() -> str:
    """A fresh random secret (for a frontend that was given none)."""
    return secrets.token_hex(32)


def key_of(secret: str | bytes) -> bytes:
    """The HMAC key of a secret given as text or bytes."""
    raw = secret.encode() if isinstance(secret, str) else secret
    if not raw:
        raise ValueError("the cluster secret is empty")
    return hashlib.sha256(b"ferry-cluster-secret\0" + raw).digest()


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(key: bytes, role: bytes, link: bytes, mine: bytes, theirs: bytes) -> bytes:
    """What ``role`` answers on ``link`` to the peer's nonce ``theirs``, having sent
    ``mine``."""
    return hmac.new(key, b"\0".join((role, link, theirs, mine)), hashlib.sha256).digest()


def check(key: bytes, role: bytes, link: bytes, theirs: bytes, mine: bytes,
          answer: bytes) -> None:  # fmt: skip
    """Raise ``AuthError`` unless ``answer`` is the peer's (playing ``role``) proof for
    ``mine``, given that it sent ``theirs``."""
    expected = proof(key, role, link, theirs, mine)
    if len(answer) != PROOF_BYTES or not hmac.compare_digest(answer, expected):
        raise AuthError(f"the peer did not prove the cluster secret ({role.decode()} side)")


def bearer_token(secret: str | bytes) -> str:
    """The token a worker presents to a frontend's internal HTTP listener
    (``Authorization: Bearer``): derived from the secret, never the secret itself."""
    return hmac.new(key_of(secret), b"ferry-control-api", hashlib.sha256).hexdigest()


def token_matches(secret: str | bytes, presented: str) -> bool:
    """Whether ``presented`` is ``bearer_token(secret)``, compared in constant time."""
    return hmac.compare_digest(presented.encode(), bearer_token(secret).encode())
