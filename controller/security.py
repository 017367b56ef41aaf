"""Where the controller may listen, who may connect, and ZeroMQ CURVE elsewhere.

Telemetry and decisions are not authenticated by themselves: whoever can reach
the socket can steer the speculation depth of the servers it feeds (its own
streams only: see :mod:`controller.streams`) and load the daemon. So
``specctl-serve`` binds only to ``ipc://`` paths or loopback TCP, unless CURVE
keys are configured; then every connection is encrypted and, with
``authorized_clients_dir``, only listed client keys may connect.

On ``ipc://`` endpoints a ZAP handler also checks the connecting process's user
(``SO_PEERCRED``, which ZeroMQ passes to ZAP): only the daemon's own uid (and
``allowed_uids``) may connect. File permissions alone protect a filesystem path,
but an abstract socket (``ipc://@name``) has none: any local user could connect.
Loopback TCP cannot tell users apart: use ``ipc://`` where other users share the host.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

#: The ZAP domain of the daemon's socket (ZeroMQ consults ZAP for NULL only with one).
ZAP_DOMAIN = "specctl"


class UnsafeEndpointError(ValueError):
    """The endpoint would expose the controller, or cannot be used; the message says why."""


@dataclass(frozen=True)
class CurveConfig:
    """Server key pair file (``zmq.auth.create_certificates``) and optional client allow-list."""

    secret_key_file: str
    authorized_clients_dir: str | None = None


def is_local(endpoint: str) -> bool:
    """True for ``ipc://``/``inproc://`` endpoints and TCP on a loopback address."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name or a host name
        return False


def check_endpoint(endpoint: str, curve: CurveConfig | None) -> None:
    """Raise :class:`UnsafeEndpointError` unless binding ``endpoint`` is safe."""
    if not endpoint.startswith(("ipc://", "inproc://", "tcp://")):
        raise UnsafeEndpointError(f"endpoint {endpoint!r}: expected ipc://PATH or tcp://HOST:PORT")
    if is_local(endpoint) or curve is not None:
        return
    raise UnsafeEndpointError(
        f"endpoint {endpoint!r} is reachable from other hosts, and decisions are not "
        "authenticated: anyone who can connect could set the speculation depth of every "
        "connected server and read its load. Bind to ipc:// or 127.0.0.1, or configure "
        "curve.secret_key_file (and curve.authorized_clients_dir) to use ZeroMQ CURVE."
    )


def check_ipc_free(endpoint: str) -> None:
    """Refuse an ``ipc://`` path another process is listening on.

    ZeroMQ unlinks and rebinds an existing socket file silently: a second daemon
    would take the path over from a running one. A path nobody answers on (left
    by a crashed daemon) is fine. Abstract names (``@name``) fail to bind instead.
    """
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return
    path = endpoint[len("ipc://"):]
    if not os.path.exists(path):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return  # stale: nobody listens
            raise UnsafeEndpointError(f"endpoint {endpoint!r}: cannot check the path ({exc})") \
                from exc
    raise UnsafeEndpointError(
        f"endpoint {endpoint!r}: another process (a running specctl-serve?) is listening "
        "on this path; stop it or choose another endpoint"
    )


def bind(sock: zmq.Socket, endpoint: str) -> None:
    """``sock.bind(endpoint)``, with ZeroMQ's errors turned into :class:`UnsafeEndpointError`."""
    check_ipc_free(endpoint)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        hint = " (already in use)" if exc.errno == errno.EADDRINUSE else ""
        raise UnsafeEndpointError(f"endpoint {endpoint!r}: cannot bind{hint}: {exc}") from exc


class PeerAuthenticator(ThreadAuthenticator):
    """ZAP handler: CURVE keys as :class:`ThreadAuthenticator` checks them and, for
    NULL connections over ``ipc://``, the peer's uid.

    ZeroMQ hands ZAP an ipc peer's address as ``NAME:UID:GID:PID``; an address
    without that (no ``SO_PEERCRED``) is refused: fail closed.
    """

    def __init__(self, context: zmq.Context, allowed_uids: Iterable[int] | None = None,
                 check_uid: bool = False) -> None:
        super().__init__(context)
        self.check_uid = check_uid
        self.allowed_uids = {os.getuid(), *(allowed_uids or ())}
        self.refused = 0

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        """Refuse ipc peers of other users, then defer to pyzmq's checks."""
        if self.check_uid and len(msg) >= 6 and msg[5] == b"NULL":
            uid = peer_uid(msg[3].decode("utf-8", "replace"))
            if uid not in self.allowed_uids:
                self.refused += 1
                log.warning("refused an ipc connection from uid %s (allowed: %s)", uid,
                            sorted(self.allowed_uids))
                # pyzmq's reply helper: the same frames its own refusals send.
                self._send_zap_reply(msg[1], b"400", b"uid not allowed")
                return
        await super().handle_zap_message(msg)


def peer_uid(address: str) -> int | None:
    """The uid in a ZAP address ``NAME:UID:GID:PID`` of an ipc peer; None if absent."""
    parts = address.rsplit(":", 3)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    return int(parts[1])


def secure_socket(sock: zmq.Socket, context: zmq.Context, endpoint: str,
                  curve: CurveConfig | None,
                  allowed_uids: Iterable[int] = ()) -> PeerAuthenticator | None:
    """Set up who may connect to ``sock`` (before binding); returns the ZAP handler to stop.

    CURVE: the server keys, and a ZAP handler admitting the listed client keys (any
    key without a list: the handler then still tags every message with the client's
    key, its ``User-Id``, which :mod:`controller.streams` binds streams to).
    ``ipc://`` without CURVE: a ZAP handler admitting only ``allowed_uids`` and our uid.
    """
    check_ipc = endpoint.startswith("ipc://") and curve is None
    if curve is None and not check_ipc:
        return None
    keys = load_curve_keys(curve) if curve is not None else None
    auth = PeerAuthenticator(context, allowed_uids, check_uid=check_ipc)
    auth.start()
    if curve is not None:
        location = curve.authorized_clients_dir or zmq.auth.CURVE_ALLOW_ANY
        auth.configure_curve(domain=ZAP_DOMAIN, location=location)
        sock.curve_publickey, sock.curve_secretkey = keys
        sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()
    return auth


def load_curve_keys(curve: CurveConfig) -> tuple[bytes, bytes]:
    """The server's (public, secret) key, checking the files first; clear errors, no tracebacks.

    A secret key readable by others is served (it may be deliberate) with a warning.
    """
    path = Path(curve.secret_key_file)
    if not path.is_file():
        raise UnsafeEndpointError(f"curve.secret_key_file {path}: no such file")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        log.warning("curve.secret_key_file %s has mode %04o: other users can read or change "
                    "the server's secret key (chmod 600 it)", path, mode)
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise UnsafeEndpointError(f"curve.secret_key_file {path}: not a certificate ({exc})") \
            from exc
    if secret is None:
        raise UnsafeEndpointError(f"curve.secret_key_file {path}: no secret key")
    allowed = curve.authorized_clients_dir
    if allowed:
        directory = Path(allowed)
        if not directory.is_dir():
            raise UnsafeEndpointError(
                f"curve.authorized_clients_dir {directory}: no such directory"
            )
        if not any(directory.glob("*.key")):
            raise UnsafeEndpointError(
                f"curve.authorized_clients_dir {directory}: no client certificates (*.key); "
                "the daemon would serve nobody"
            )
    return public, secret
