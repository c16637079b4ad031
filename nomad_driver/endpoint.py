"""Where Consul and Nomad are and how to speak TLS to them, read the way HashiCorp's own tools
read it: `127.0.0.1:8500` is a URL too, a CA file verifies the server, a client certificate and
key are for mutual TLS, and all of it only for `https://`."""

from __future__ import annotations

import ssl


def normalise_addr(addr: str, ssl_flag: str = "") -> str:
    """`127.0.0.1:8500` (how CONSUL_HTTP_ADDR is often written) becomes a URL; `ssl_flag` is
    CONSUL_HTTP_SSL's value."""
    addr = addr.strip().rstrip("/")
    if "://" in addr:
        return addr
    scheme = "https" if ssl_flag.lower() in ("1", "true", "yes") else "http"
    return f"{scheme}://{addr}"


def client_ssl_context(addr: str, cacert: str = "", cert: str = "", key: str = "") -> ssl.SSLContext | None:
    """None for a plain `http://` address; else a verifying context, with the client pair loaded
    when a certificate is given."""
    if not addr.startswith("https://"):
        return None
    ctx = ssl.create_default_context(cafile=cacert or None)
    if cert:
        ctx.load_cert_chain(cert, key or None)
    return ctx
