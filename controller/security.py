"""Where the controller may listen, and ZeroMQ CURVE when it listens elsewhere.

Telemetry and decisions are not authenticated by themselves: whoever can reach
the socket can steer the speculation depth of every connected server and read
their load. So ``specctl-serve`` binds only to ``ipc://`` paths (file
permissions protect them) or loopback TCP, unless CURVE keys are configured;
then every connection is encrypted and, with ``authorized_clients_dir``, only
listed client keys may connect.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


class UnsafeEndpointError(ValueError):
    """The endpoint would expose the controller without CURVE; the message says why."""


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


def apply_curve_server(sock: zmq.Socket, context: zmq.Context,
                       curve: CurveConfig) -> ThreadAuthenticator | None:
    """Make ``sock`` a CURVE server; returns the authenticator to stop on close (if any)."""
    public, secret = zmq.auth.load_certificate(curve.secret_key_file)
    if secret is None:
        raise UnsafeEndpointError(f"curve.secret_key_file {curve.secret_key_file}: no secret key")
    auth = None
    if curve.authorized_clients_dir:
        auth = ThreadAuthenticator(context)
        auth.start()
        auth.configure_curve(domain="*", location=curve.authorized_clients_dir)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return auth
