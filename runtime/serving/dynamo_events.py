"""Where the KV event plane of kvexport's Dynamo workers listens, and a broker that listens only
where the operator says.

A worker publishes two event streams for the KV router: its KV events (blocks stored and removed,
with their hashes) and its load (KV blocks in use). Dynamo 1.6.1 carries them over NATS or ZMQ
(`DYN_EVENT_PLANE`; unset: ZMQ with file or mem discovery, NATS with etcd or Kubernetes):

    direct ZMQ (Dynamo's default on one machine): every publisher BINDS a PUB socket on
        tcp://0.0.0.0:0 (every interface, a random port; fixed in Dynamo's core, whatever
        DYN_EVENT_PLANE_HOST says: that only sets the address advertised in discovery)
    brokered ZMQ (DYN_ZMQ_BROKER_URL="xsub=tcp://H:P , xpub=tcp://H:Q"): publishers CONNECT to the
        broker's XSUB, subscribers (the frontend's router) to its XPUB; the worker binds nothing
        for its events, and the broker binds where it is told (`EventBroker`, `kvexport
        dynamo-broker`; loopback unless told otherwise)
    NATS: publishers and subscribers connect to the NATS server

`check_event_plane` reads the environment the worker's Dynamo runtime will read and refuses direct
ZMQ on one machine (file or mem discovery) unless the operator opted into it (`--public-event-plane`);
across machines it warns: docs/DEPLOYMENT.md, "What the event plane exposes, and where".
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
from dataclasses import dataclass
from typing import Mapping

from kvexport.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"  # the broker's address unless the operator names another
PUBLIC_ENV = "KVEXPORT_DYNAMO_PUBLIC_EVENT_PLANE"  # set (1/true/yes): the operator accepts direct ZMQ
_TRUTHY = ("1", "true", "yes", "on")
BROKER_HINT = ("run `kvexport dynamo-broker` (it binds 127.0.0.1 unless given --host) and export the "
               "DYN_ZMQ_BROKER_URL it prints to the frontend and every worker")


@dataclass(frozen=True, slots=True)
class EventPlane:
    """How this worker's events travel: `transport` is "nats", "zmq-broker" or "zmq-direct";
    `where` says where (the broker's endpoints, or that Dynamo binds every interface)."""

    transport: str
    where: str

    @property
    def binds_all_interfaces(self) -> bool:
        return self.transport == "zmq-direct"


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in _TRUTHY


def parse_broker_url(url: str) -> tuple[list[str], list[str]]:
    """DYN_ZMQ_BROKER_URL ("xsub=EP[;EP...] , xpub=EP[;EP...]", Dynamo's format) as its XSUB and XPUB
    endpoint lists. Raises ConfigError naming the variable (Dynamo's own error is a bare exception
    raised when the first publisher is made, after the engine has loaded)."""
    parts = [p.strip() for p in url.split(",")]
    xsub: list[str] = []
    xpub: list[str] = []
    for part in parts:
        key, _, eps = part.partition("=")
        found = [e.strip() for e in eps.split(";") if e.strip()]
        if key.strip() == "xsub":
            xsub = found
        elif key.strip() == "xpub":
            xpub = found
        else:
            xsub = xpub = []
            break
    bad = [e for e in xsub + xpub if not e.startswith(("tcp://", "ipc://"))]
    if len(parts) != 2 or not xsub or not xpub or bad:
        raise ConfigError(f"DYN_ZMQ_BROKER_URL={url!r} is not 'xsub=tcp://HOST:PORT , xpub=tcp://HOST:PORT' "
                          f"(';' between several brokers' endpoints): {BROKER_HINT}")
    return xsub, xpub


def check_event_plane(discovery: str, public_ok: bool, env: Mapping[str, str] | None = None) -> EventPlane:
    """The event plane the worker's Dynamo runtime will use, read from `env` (default: os.environ)
    as Dynamo 1.6.1 reads it. Direct ZMQ (its PUB sockets on every interface) with single-machine
    discovery is refused with a ConfigError saying what to do, unless `public_ok` (--public-event-plane,
    or $KVEXPORT_DYNAMO_PUBLIC_EVENT_PLANE set); otherwise it is logged as a warning."""
    env = os.environ if env is None else env
    kind = (env.get("DYN_EVENT_PLANE") or "").strip().lower() or ("zmq" if discovery in ("file", "mem") else "nats")
    if kind not in ("zmq", "nats"):
        raise ConfigError(f"DYN_EVENT_PLANE={env.get('DYN_EVENT_PLANE')!r}: Dynamo's event plane is 'zmq' or 'nats'")
    if kind == "nats":
        return EventPlane("nats", env.get("NATS_SERVER") or "the NATS server (NATS_SERVER, else nats://localhost:4222)")
    url = env.get("DYN_ZMQ_BROKER_URL")
    if url is not None:
        xsub, xpub = parse_broker_url(url)
        return EventPlane("zmq-broker", f"broker XSUB {';'.join(xsub)}, XPUB {';'.join(xpub)}")
    if _truthy(env.get("DYN_ZMQ_BROKER_ENABLED")):
        return EventPlane("zmq-broker", "the brokers registered in discovery (DYN_ZMQ_BROKER_ENABLED)")
    plane = EventPlane("zmq-direct", "Dynamo binds one ZMQ PUB socket per event stream on tcp://0.0.0.0 "
                                     "(every interface), random ports")
    said = env.get("DYN_EVENT_PLANE_HOST")
    # NOTE: refused on one machine only (file/mem discovery), where loopback is the right answer and a broker
    # costs one process; across machines (etcd, Kubernetes) direct ZMQ is how Dynamo reaches other hosts'
    # frontends: there it is the operator's network policy, so it is served with the warning below
    if discovery in SINGLE_MACHINE and not (public_ok or _truthy(env.get(PUBLIC_ENV))):
        raise ConfigError(
            "this worker's KV events and load would be published on every network interface: Dynamo 1.6.1's "
            "direct ZMQ event plane binds tcp://0.0.0.0 on random ports"
            + (f" whatever DYN_EVENT_PLANE_HOST says (it is {said!r})" if said else "")
            + f", where anyone who reaches this machine can subscribe without a password. Either {BROKER_HINT}; "
            "or use NATS (DYN_EVENT_PLANE=nats); or, on a network you trust, pass --public-event-plane "
            f"(or set {PUBLIC_ENV}=1). docs/DEPLOYMENT.md, \"What the event plane exposes, and where\"")
    log.warning("event plane: %s: anyone who reaches this host can subscribe (restrict it with a firewall or "
                "network policy, or use a broker or NATS: docs/DEPLOYMENT.md)%s", plane.where,
                f"; DYN_EVENT_PLANE_HOST={said} only sets the address advertised in discovery" if said else "")
    return plane


SINGLE_MACHINE = ("file", "mem")  # discovery backends whose workers and frontend share one machine
# where Dynamo 1.6.1 binds a worker's other listeners when nothing says: the request plane's server, the
# response streams' server (both: the machine's address), the system server (/health, /metrics: 0.0.0.0)
HOST_VARIABLES = ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_SYSTEM_HOST")


def loopback_defaults(discovery: str, env: dict | None = None) -> list[str]:
    """With single-machine discovery (file, mem), set every HOST_VARIABLES the operator left unset
    to 127.0.0.1 in `env` (default: os.environ, which the worker's Dynamo runtime reads when it is
    made); returns the names set. Other backends span machines: their defaults are left alone."""
    env = os.environ if env is None else env
    if discovery not in SINGLE_MACHINE:
        return []
    unset = [name for name in HOST_VARIABLES if not env.get(name)]
    for name in unset:
        env[name] = DEFAULT_HOST
    if unset:
        log.info("%s discovery (one machine): %s=%s", discovery, "=".join(unset), DEFAULT_HOST)
    return unset


def _endpoint(host: str, port: int) -> str:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"tcp://{host}:{port}"  # a host name: ZMQ resolves it
    return f"tcp://[{ip}]:{port}" if ip.version == 6 else f"tcp://{ip}:{port}"


class EventBroker:
    """A ZMQ XSUB/XPUB forwarder for Dynamo's brokered event plane: workers' PUB sockets connect to
    its XSUB, the frontends' SUB sockets to its XPUB. It binds `host` only (ports 0: free ones).
    `url` is the DYN_ZMQ_BROKER_URL value for the frontend and the workers. `start()` forwards on a
    thread until `close()`.
    NOTE: the broker authenticates nobody either: on loopback every local user can subscribe (and
    publish); bind it where only the frontend and the workers reach it."""

    def __init__(self, host: str = DEFAULT_HOST, xsub_port: int = 0, xpub_port: int = 0):
        import zmq

        for name, port in (("xsub_port", xsub_port), ("xpub_port", xpub_port)):
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
                raise ConfigError(f"{name} must be a TCP port in [0, 65535] (0: a free one), got {port!r}")
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._xsub, self._xpub = self._ctx.socket(zmq.XSUB), self._ctx.socket(zmq.XPUB)
        self._control = self._ctx.socket(zmq.PAIR)  # TERMINATE stops the proxy (proxy_steerable)
        self._control_peer = self._ctx.socket(zmq.PAIR)
        self._thread: threading.Thread | None = None
        try:
            for sock, port in ((self._xsub, xsub_port), (self._xpub, xpub_port)):
                sock.setsockopt(zmq.LINGER, 0)
                sock.bind(_endpoint(host, port))
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ConfigError(f"the event broker cannot listen on {host} (ports {xsub_port}, {xpub_port}): {e}; "
                              "give --host an address of this machine and free ports") from None
        ctl = f"inproc://kvexport-event-broker-{id(self)}"
        self._control.bind(ctl)
        self._control_peer.connect(ctl)
        self.xsub_endpoint = self._xsub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.xpub_endpoint = self._xpub.getsockopt(zmq.LAST_ENDPOINT).decode()

    @property
    def url(self) -> str:
        return f"xsub={self.xsub_endpoint} , xpub={self.xpub_endpoint}"

    def _forward(self) -> None:
        try:
            self._zmq.proxy_steerable(self._xsub, self._xpub, None, self._control)
        except self._zmq.ZMQError as e:  # the context ended under it: closing
            log.debug("event broker stopped: %s", e)

    def start(self) -> "EventBroker":
        self._thread = threading.Thread(target=self._forward, name="kvexport-event-broker", daemon=True)
        self._thread.start()
        return self

    def _close_sockets(self) -> None:
        for sock in (self._xsub, self._xpub, self._control, self._control_peer):
            sock.close(linger=0)
        self._ctx.term()

    def close(self) -> None:
        if self._thread is not None:
            self._control_peer.send(b"TERMINATE")
            self._thread.join(timeout=5)
            self._thread = None
        self._close_sockets()

    def __enter__(self) -> "EventBroker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
