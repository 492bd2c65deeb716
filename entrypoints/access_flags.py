"""``infer serve`` flags for API keys, tenants and limits, and the keyring they build."""

import argparse
import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path

import structlog

from adapters.storage.keys_file import KeysFileError, load_keyring
from adapters.storage.rate_limits import storage_uri
from application.access import Access
from application.idempotency import DEFAULT_TTL_S
from application.keys import Keyring, hash_key
from domain.errors import InvalidParameterError
from domain.tenancy import DEFAULT_FACES, Tenant

log = structlog.get_logger("infer.audit")


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


def keyring_from_args(args: argparse.Namespace) -> tuple[Keyring | None, str]:
    """The keyring the flags name (None: an open server) and where it came from."""
    keys = [*(args.api_key or []), *filter(None, [os.environ.get("INFER_API_KEY", "")])]
    if args.idempotency_ttl < 0:
        raise InvalidParameterError("idempotency_ttl", "must be 0 (off) or more")
    if args.idempotency_max_keys < 1:
        raise InvalidParameterError("idempotency_max_keys", "must be at least 1")
    try:
        storage_uri(args.redis_url)
    except ValueError as e:
        raise InvalidParameterError("redis_url", str(e)) from e
    if args.api_keys_file is not None and keys:
        raise InvalidParameterError("api_keys_file", "give either it or --api-key, not both")
    if args.api_keys_file is not None:
        try:
            return load_keyring(Path(args.api_keys_file).expanduser()), args.api_keys_file
        except KeysFileError as e:
            raise InvalidParameterError("api_keys_file", str(e)) from e
    if keys:
        tenant = Tenant("default", DEFAULT_FACES - {"tinker"})
        return Keyring([(hash_key(k), tenant) for k in dict.fromkeys(keys)]), "--api-key"
    return None, ""


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
