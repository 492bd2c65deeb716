"""``infer serve`` flags for API keys, tenants and limits (:class:`AccessSettings`), and the
keyring they build."""

import argparse
import asyncio
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from adapters.storage.keys_file import KeysFileError, load_keyring
from adapters.storage.rate_limits import storage_uri
from adapters.storage.usage_sql import DEFAULT_USAGE_DB, check_usage_target
from application.access.access import Access
from application.access.idempotency import DEFAULT_TTL_S
from application.access.keys import Keyring, hash_key
from application.access.usage_ledger import DEFAULT_RETENTION_DAYS
from application.serving.responses import DEFAULT_MAX_STORED_RESPONSES, DEFAULT_RESPONSES_TTL_S
from domain.errors import InvalidParameterError
from domain.tenancy import DEFAULT_FACES, Tenant
from entrypoints.config.flag_fields import from_flags

log = structlog.get_logger("infer.audit")


@dataclass(frozen=True)
class AccessSettings:
    """The flags of the same names: the keys (``api_keys_file``, or ``--api-key`` /
    ``INFER_API_KEY`` kept hashed as ``api_key_hashes``: the config never holds a key;
    neither: an open server), where limits and idempotent replies are counted
    (``redis_url``; None: in memory), and how long (``idempotency_ttl`` seconds, 0: the
    header is ignored) and how many (``idempotency_max_keys``, in memory) replies are kept;
    how long ``/v1/responses`` keeps finished responses (``responses_ttl`` seconds, 0: none
    are kept) and how many (``responses_max_stored``, in memory; in Redis with
    ``redis_url``); where every API request's usage is recorded (``usage_db``: a SQLite
    file, ``:memory:`` or a ``postgresql://`` URL; None: this process's memory) and for
    how many days (``usage_retention_days``, 0: for ever).
    Checked at construction; :meth:`keyring` reads the keys file."""

    api_keys_file: str | None = None
    api_key_hashes: tuple[str, ...] = ()
    redis_url: str | None = None
    idempotency_ttl: float = DEFAULT_TTL_S
    idempotency_max_keys: int = 10_000
    responses_ttl: float = DEFAULT_RESPONSES_TTL_S
    responses_max_stored: int = DEFAULT_MAX_STORED_RESPONSES
    usage_db: str | None = None
    usage_retention_days: float = DEFAULT_RETENTION_DAYS

    def __post_init__(self) -> None:
        if self.usage_retention_days < 0:
            raise InvalidParameterError("usage_retention_days", "must be 0 (for ever) or more")
        if self.usage_db is not None:
            try:
                check_usage_target(self.usage_db)
            except ValueError as e:
                raise InvalidParameterError("usage_db", str(e)) from e
        if self.idempotency_ttl < 0:
            raise InvalidParameterError("idempotency_ttl", "must be 0 (off) or more")
        if self.idempotency_max_keys < 1:
            raise InvalidParameterError("idempotency_max_keys", "must be at least 1")
        if self.responses_ttl < 0:
            raise InvalidParameterError("responses_ttl", "must be 0 (off) or more")
        if self.responses_max_stored < 1:
            raise InvalidParameterError("responses_max_stored", "must be at least 1")
        try:
            storage_uri(self.redis_url)
        except ValueError as e:
            raise InvalidParameterError("redis_url", str(e)) from e
        if self.api_keys_file is not None and self.api_key_hashes:
            raise InvalidParameterError("api_keys_file", "give either it or --api-key, not both")

    @property
    def keys_source(self) -> str:
        """Where the keys come from (empty: nowhere, an open server)."""
        if self.api_keys_file is not None:
            return self.api_keys_file
        return "--api-key" if self.api_key_hashes else ""

    def keyring(self) -> Keyring | None:
        """The keyring (None: an open server): the keys file read now, or the keys of
        ``--api-key`` for one tenant ``default`` without limits (the operator's: the
        OpenAI endpoints and the ``admin`` face, the console's tenants page)."""
        if self.api_keys_file is not None:
            try:
                return load_keyring(Path(self.api_keys_file).expanduser())
            except KeysFileError as e:
                raise InvalidParameterError("api_keys_file", str(e)) from e
        if self.api_key_hashes:
            tenant = Tenant("default", DEFAULT_FACES - {"tinker"} | {"admin"})
            return Keyring([(hashed, tenant) for hashed in self.api_key_hashes])
        return None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "AccessSettings":
        """``infer serve``'s settings, the keys file read once to check it before the model
        loads."""
        keys = [*(args.api_key or []), *filter(None, [os.environ.get("INFER_API_KEY", "")])]
        hashes = tuple(hash_key(k) for k in dict.fromkeys(keys))
        settings = from_flags(cls, args, api_key_hashes=hashes)
        settings.keyring()
        return settings


def add_access_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("API keys, tenants and limits")
    group.add_argument(
        "--api-keys-file",
        default=None,
        help="tenants, their hashed keys, scopes and limits (TOML, or JSON by suffix); "
        "reloaded on SIGHUP. Without it (and --api-key) the server is open: anyone who "
        "reaches the port may call, without limits",
    )
    group.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="a key the OpenAI endpoints and /v1/generate accept, for one tenant 'default' "
        "without limits (repeatable; also INFER_API_KEY; vLLM's --api-key)",
    )
    group.add_argument(
        "--redis-url",
        default=None,
        help="keep rate-limit counters and idempotent replies in Redis (redis://HOST:6379/0) "
        "so replicas share them; default: in this process's memory",
    )
    group.add_argument(
        "--idempotency-ttl",
        type=float,
        default=DEFAULT_TTL_S,
        help="seconds a reply to an Idempotency-Key request is kept for repeats "
        "(default %(default)s: 24 h; 0: the header is ignored)",
    )
    group.add_argument(
        "--idempotency-max-keys",
        type=int,
        default=10_000,
        help="replies kept in memory at most, the oldest dropped first (default %(default)s)",
    )
    add_responses_args(parser)
    add_usage_args(parser)


def add_usage_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("usage ledger (GET /v1/organization/usage/...)")
    group.add_argument(
        "--usage-db",
        default=DEFAULT_USAGE_DB,
        help="where every API request's usage (tenant, model, tokens, status; never text) "
        "is recorded: a SQLite file (default %(default)s), :memory:, or a PostgreSQL URL "
        "(postgresql://USER@HOST/DB) that every server of a fleet writes to",
    )
    group.add_argument(
        "--usage-retention-days",
        type=float,
        default=DEFAULT_RETENTION_DAYS,
        help="days usage records are kept, older ones pruned hourly (default %(default)s; "
        "0: kept for ever)",
    )


def add_responses_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("stored responses (/v1/responses)")
    group.add_argument(
        "--responses-ttl",
        type=float,
        default=DEFAULT_RESPONSES_TTL_S,
        help="seconds a finished /v1/responses response is kept for previous_response_id "
        "and GET (default %(default)s: 24 h; 0: none are kept, store reads false); in "
        "Redis with --redis-url, else in memory",
    )
    group.add_argument(
        "--responses-max-stored",
        type=int,
        default=DEFAULT_MAX_STORED_RESPONSES,
        help="responses kept in memory at most, the oldest dropped first (default "
        "%(default)s; with --redis-url, Redis's memory policy bounds them)",
    )


def sighup_reloader(access: Access, path: str | None) -> Callable[[], None]:
    """A start-up hook installing the SIGHUP handler that reloads the keys file (a bad
    file is logged and the old keys stay)."""

    def reload() -> None:
        assert path is not None
        try:
            access.replace(load_keyring(Path(path).expanduser()), path)
        except KeysFileError as e:
            log.error("api keys reload failed; the old keys stay", error=str(e))

    def install() -> None:
        if path is not None:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)

    return install
