"""Exceptions of the secure-aggregation protocol.

Every message names the session phase, the clients involved and what to do next. The hierarchy lets a
caller catch one family:

- :class:`SecAggConfigError`: the session parameters are unsafe or inconsistent (fix the configuration).
- :class:`SecAggRefusal`: a *client* refuses a server request because it would weaken its privacy
  (the round must be abandoned; a site never answers a session it refused).
- :class:`SecAggAbort`: too few clients are left to finish the round (start a new session, fresh keys).
- :class:`SecAggProtocolError`: a message is out of order, malformed or from an unexpected sender.
- :class:`SecAggIntegrityError`: authenticated decryption failed or secret shares are inconsistent.
- :class:`SecAggInputError`: the local update vector is not usable (shape, dtype, NaN/Inf).
"""

from __future__ import annotations

from fedclinic.errors import ConfigError, FedclinicError, IntegrityError, PolicyError


class SecAggError(FedclinicError):
    """Base class of every secure-aggregation error."""


class SecAggConfigError(SecAggError, ConfigError):
    """Session parameters that would be unsafe or could not work (threshold, cohort, overflow, lengths)."""


class SecAggRefusal(SecAggError, PolicyError):
    """A client refuses a request from the server because answering it could reveal its update.

    After a refusal the client session is dead: every later call raises again. The aggregator must
    abandon the round and start a new session (fresh keys, fresh session id).
    """


class SecAggAbort(SecAggError):
    """The round cannot complete: fewer clients than the threshold are left for some secret.

    The aggregator must start a new session with fresh keys; it must never re-run unmasking of this
    session with a different survivor set.
    """


class SecAggProtocolError(SecAggError):
    """A message arrived in the wrong phase, twice with different content, from an unknown sender, or
    with the wrong session id or shape."""


class SecAggIntegrityError(SecAggError, IntegrityError):
    """Authenticated decryption failed (tampered ciphertext, wrong key or associated data), or the
    revealed secret shares do not lie on one polynomial / do not match a committed public key."""


class SecAggInputError(SecAggError, ValueError):
    """The update vector given to a client is not a finite 1-D float vector of the session's length."""
