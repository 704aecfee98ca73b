"""Who belongs to a live job: a shared secret between the store service and its replicas.

The store service (``hexagram elastic-store``) is a plain c10d ``TCPStore``: any process that
reaches its port can read and write keys, so without a token a stray or misconfigured
process could join a membership, vote on commits or heal from the replicas. With a job token
(:data:`ENV_TOKEN`, or ``--token-file`` on both commands):

- the job's keys live under a prefix derived from the token (an HMAC of the job name), so a
  process without it cannot find, read or write any key of the job: it cannot join, vote,
  heartbeat or heal;
- the service publishes, under the job's public prefix, whether a token is required and a
  salted check of it (never the token), so a replica without the token, or with another,
  fails at once with a clear error instead of waiting for a membership that never forms.

The token is never logged nor shown in a ``repr``. It guards against stray processes and
port scanners, not against an attacker on the network path: the store speaks plain TCP
(no TLS), so run it on a private network.

Example:
    >>> a, b = job_prefix("exp", None), job_prefix("exp", "s3cret")
    >>> a
    'hexagram/live/exp/'
    >>> b.startswith(a) and "s3cret" not in b and len(b) == len(a) + 33
    True
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist

from hexagram.errors import ConfigError

__all__ = ["AUTH_KEY", "ENV_TOKEN", "auth_record", "check_token", "job_prefix", "read_token"]

ENV_TOKEN = "HEXAGRAM_TOKEN"
#: the key, under the job's public prefix, that says whether the job needs a token
AUTH_KEY = "auth"


def _mac(token: str, message: str) -> str:
    return hmac.new(token.encode(), message.encode(), hashlib.sha256).hexdigest()


def public_prefix(job: str) -> str:
    """The job's public key space: the auth record (and every key, without a token)."""
    return f"hexagram/live/{job}/"


def job_prefix(job: str, token: str | None) -> str:
    """Where the job's keys live: the public prefix, or below it a name only the token's
    holders can derive."""
    base = public_prefix(job)
    return base if not token else f"{base}{_mac(token, 'prefix:' + job)[:32]}/"


def auth_record(token: str | None) -> str:
    """The JSON the service publishes at :data:`AUTH_KEY`: a random salt and the token's
    HMAC over it (nothing from which the token can be recovered)."""
    if not token:
        return json.dumps({"token": False})
    salt = secrets.token_hex(16)
    return json.dumps({"token": True, "salt": salt, "check": _mac(token, "check:" + salt)})


def read_token(env: Mapping[str, str] | None = None, path: str | None = None) -> str | None:
    """The job token: the first line of ``path`` if given, else :data:`ENV_TOKEN`, else None.

    Raises:
        ConfigError: the file cannot be read or is empty.
    """
    if path is not None:
        try:
            text = Path(path).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the job token file {path!r}: {exc.strerror}; "
                              f"pass a readable file or set {ENV_TOKEN}") from None
        if not text:
            raise ConfigError(f"the job token file {path!r} is empty")
        return text.splitlines()[0]
    value = (os.environ if env is None else env).get(ENV_TOKEN, "")
    return value or None


def check_token(root: dist.Store, job: str, token: str | None) -> None:
    """Refuse to take part in ``job`` unless ``token`` matches what its service requires.

    ``root``: a client of the store service (no prefix). Reads the public auth record if the
    service published one (a store hosted by something else has none: nothing to check).

    Raises:
        ConfigError: the service needs a token and none or another was given, or this
            replica has a token and the service needs none (a mismatched setup).
    """
    key = public_prefix(job) + AUTH_KEY
    if not root.check([key]):
        return
    try:
        record = json.loads(root.get(key).decode())
        needed = bool(record["token"])
        salt, check = (str(record["salt"]), str(record["check"])) if needed else ("", "")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise ConfigError(f"the store service's auth record for job {job!r} is malformed; "
                          "restart `hexagram elastic-store`") from None
    if needed and not token:
        raise ConfigError(f"the store service of job {job!r} requires the job token: set "
                          f"{ENV_TOKEN} or pass --token-file to `hexagram elastic-run`")
    if needed and not hmac.compare_digest(_mac(str(token), "check:" + salt), check):
        raise ConfigError(f"wrong job token for job {job!r}: this process is not part of it "
                          f"(check {ENV_TOKEN} or --token-file)")
    if not needed and token:
        raise ConfigError(f"this replica has a job token but the store service of job "
                          f"{job!r} was started without one: start `hexagram elastic-store` "
                          f"with the same token, or unset {ENV_TOKEN}")
