"""Where the endpoint listens: a light module, so an agent can check its host where FastAPI is not loaded."""

import socket


def listen_address(host: str) -> tuple:
    """getaddrinfo's entry (family, type, proto, canonname, sockaddr) for listening on `host` (an IPv4 or IPv6
    address, or a name) on a port the system picks; ValueError naming the host if it cannot be resolved."""
    try:
        return socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"the endpoint's host {host!r} cannot be resolved: {e.strerror}") from None
