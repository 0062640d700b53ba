"""A rendezvous store in a process of its own, so that no seed or clone takes it down with it.

FlashClone's records live in a ``torch.distributed.TCPStore``. When the seed hosts it (the
default when nothing listens at ``--store``), the seed's death ends the store, and every clone
still talking to it loses its state: a clone mid-transfer cannot find another source, a later
clone cannot find the clones that hold the image. A store hosted by a long-lived process that
does nothing else (``flashboot store HOST:PORT``, or :class:`StoreServer` / :func:`serve_store`
from Python) outlives any seed or clone: seeds and clones given its address join it as clients.

Any TCPStore the caller already runs serves the same purpose: torchrun's store at
``MASTER_ADDR:MASTER_PORT``, or a ``TCPStore(host, port, is_master=True)`` of a launcher.
FlashBoot writes its keys under ``flashboot/v1/<namespace>/`` there.

The store itself holds no secret: every record in it is authenticated (and the fields that grant
access to memory are sealed) with the token that seeds and clones share, which the store never
sees. Whoever reaches the port can still delete or overwrite keys (a denial of service, never a
forged record): keep it on a network only the participants reach.
"""

from __future__ import annotations

import datetime
import errno
import os
import threading

from .rendezvous import DEFAULT_TIMEOUT_S, STORE_SERVER_KEY, host_tcpstore, parse_address
from ..service_loop import Service
from ..errors import RendezvousError
from ..units import check_timeout


class StoreServer(Service):
    """A TCPStore hosted by this process until :meth:`close` (or until :meth:`serve_forever`
    is stopped by SIGTERM/SIGINT or ``stop``).

    ``address``: ``HOST:PORT``; port 0 lets the kernel pick one (:attr:`address` says which).
    An IP literal is listened on alone (127.0.0.1 stays local; 0.0.0.0 for every interface); a
    name (``$(hostname)``, a cluster name) on every interface, since what it resolves to here
    (127.0.1.1 for a Debian machine's own name) may not be where others reach it. :attr:`address`
    reports it to clients. Raises RendezvousError when the port is taken, or HOST is not an
    address of this machine, or it cannot be bound otherwise.
    """

    def __init__(self, address: str, *, timeout_s: float = DEFAULT_TIMEOUT_S):
        host, port = parse_address(address, any_port=True)
        timeout_s = check_timeout(timeout_s, "store timeout_s", RendezvousError)
        from torch.distributed import DistError

        try:
            self._store = host_tcpstore(host, port, datetime.timedelta(seconds=float(timeout_s)))
        except OSError as exc:
            why = ("the port is taken (EADDRINUSE: address already in use)" if exc.errno == errno.EADDRINUSE
                   else f"{host} is not an address of this machine (EADDRNOTAVAIL); use 0.0.0.0:{port} to listen "
                        "on every interface" if exc.errno == errno.EADDRNOTAVAIL
                   else exc.strerror or str(exc))
            raise RendezvousError(f"cannot host a store at {address}: {why}") from None
        except DistError as exc:
            raise RendezvousError(f"cannot host a store at {address}: {str(exc).splitlines()[0]}") from None
        # marks the store as one hosted for its own sake: a seed that lost it waits for it to come
        # back rather than host one there itself (see Seed.host_store)
        self._store.set(STORE_SERVER_KEY, str(os.getpid()))
        self.host = host
        self.port = int(self._store.port)
        self.pid = os.getpid()
        self._stop = threading.Event()

    @property
    def address(self) -> str:
        """``HOST:PORT`` that clients connect to (the real port when 0 was asked for)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def closed(self) -> bool:
        return self._store is None

    def close(self) -> None:
        """Stop serving (idempotent): the port closes, and clients' next calls fail."""
        self._stop.set()
        self._store = None  # the server thread ends with the last reference to the master store

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"listening at {self.address}"
        return f"StoreServer({state}, pid {self.pid})"


def serve_store(address: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> StoreServer:
    """Host a rendezvous store at ``address`` in this process (see :class:`StoreServer`); it
    serves in the background until ``close()``. ``serve_forever()`` on the result blocks until
    SIGTERM/SIGINT."""
    return StoreServer(address, timeout_s=timeout_s)


__all__ = ["StoreServer", "serve_store"]
