"""Where Consul and Nomad are and how to speak TLS to them, read the way HashiCorp's own tools
read it, so that a shell that works with `nomad` and `consul` works with llmgw.

Nomad's CLI (hashicorp/nomad api/api.go, `DefaultConfig`): `NOMAD_CACERT`, `NOMAD_CAPATH`,
`NOMAD_CLIENT_CERT`, `NOMAD_CLIENT_KEY`, `NOMAD_TLS_SERVER_NAME` (the name the server's
certificate is verified against, and the SNI), `NOMAD_SKIP_VERIFY` (a Go boolean; true skips
verification). Consul's (hashicorp/consul api/api.go, `defaultConfig` and `SetupTLSConfig`):
`CONSUL_HTTP_SSL` (https for an address without a scheme; an `http://` address stays https
when it is set), `CONSUL_CACERT`, `CONSUL_CAPATH`, `CONSUL_CLIENT_CERT`, `CONSUL_CLIENT_KEY`,
`CONSUL_TLS_SERVER_NAME` (its host part: a port is dropped), `CONSUL_HTTP_SSL_VERIFY` (false
skips verification). An empty variable is unset, as in both. Flags, where llmgw has them, win
over the variables, as the CLIs' flags do.

One difference, on purpose: a value that is not a Go boolean is an error naming the variable.
Nomad ignores it silently and Consul's client turns verification *off* for it; neither is what
someone who wrote `CONSUL_HTTP_SSL_VERIFY=no` meant.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass

# strconv.ParseBool's spellings.
_GO_TRUE = ("1", "t", "T", "TRUE", "true", "True")
_GO_FALSE = ("0", "f", "F", "FALSE", "false", "False")


class TLSConfigError(ValueError):
    """A TLS setting that cannot work; the message names the variable."""


def go_bool(name: str, value: str) -> bool:
    if value in _GO_TRUE:
        return True
    if value in _GO_FALSE:
        return False
    raise TLSConfigError(f"{name}={value!r} is not a boolean: use true or false (or 1, 0, t, f)")


@dataclass(frozen=True)
class TLSSettings:
    cacert: str = ""
    capath: str = ""
    client_cert: str = ""
    client_key: str = ""
    # The name to verify the server's certificate against (and send as SNI); empty: the host
    # of the address.
    server_name: str = ""
    skip_verify: bool = False


def nomad_tls(env: Mapping[str, str] | None = None) -> TLSSettings:
    env = os.environ if env is None else env
    skip = env.get("NOMAD_SKIP_VERIFY", "")
    return TLSSettings(
        cacert=env.get("NOMAD_CACERT", ""),
        capath=env.get("NOMAD_CAPATH", ""),
        client_cert=env.get("NOMAD_CLIENT_CERT", ""),
        client_key=env.get("NOMAD_CLIENT_KEY", ""),
        server_name=env.get("NOMAD_TLS_SERVER_NAME", ""),
        skip_verify=go_bool("NOMAD_SKIP_VERIFY", skip) if skip else False,
    )


def _host_part(server: str) -> str:
    # Consul's SetupTLSConfig: a port after the last ':' (outside IPv6 brackets) is dropped.
    if server.rfind(":") > server.rfind("]"):
        server = server.rsplit(":", 1)[0]
    return server.strip("[]")


def consul_tls(env: Mapping[str, str] | None = None) -> TLSSettings:
    env = os.environ if env is None else env
    verify = env.get("CONSUL_HTTP_SSL_VERIFY", "")
    return TLSSettings(
        cacert=env.get("CONSUL_CACERT", ""),
        capath=env.get("CONSUL_CAPATH", ""),
        client_cert=env.get("CONSUL_CLIENT_CERT", ""),
        client_key=env.get("CONSUL_CLIENT_KEY", ""),
        server_name=_host_part(env.get("CONSUL_TLS_SERVER_NAME", "")),
        skip_verify=not go_bool("CONSUL_HTTP_SSL_VERIFY", verify) if verify else False,
    )


def normalise_addr(addr: str, ssl_flag: str = "") -> str:
    """`127.0.0.1:8500` (how CONSUL_HTTP_ADDR is often written) becomes a URL; `ssl_flag` is
    CONSUL_HTTP_SSL's value, which also keeps an `http://` address on https, as Consul's client
    does ("never revert to http if TLS was explicitly requested")."""
    addr = addr.strip().rstrip("/")
    wants_tls = go_bool("CONSUL_HTTP_SSL", ssl_flag) if ssl_flag else False
    if "://" in addr:
        if wants_tls and addr.startswith("http://"):
            return "https://" + addr[len("http://") :]
        return addr
    return f"{'https' if wants_tls else 'http'}://{addr}"


def ssl_context(addr: str, tls: TLSSettings) -> ssl.SSLContext | None:
    """None for a plain `http://` address; else a context that verifies as the CLIs do, with
    the client pair loaded when a certificate is given. The server name is not in the context:
    a caller passes `tls.server_name` with each connection (aiohttp's `server_hostname`)."""
    if not addr.startswith("https://"):
        return None
    if bool(tls.client_cert) != bool(tls.client_key):
        # Both CLIs refuse one without the other: "both client cert and client key must be provided".
        raise TLSConfigError("a client certificate and its key go together: set both, or neither")
    ctx = ssl.create_default_context(cafile=tls.cacert or None, capath=tls.capath or None)
    if tls.skip_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if tls.client_cert:
        ctx.load_cert_chain(tls.client_cert, tls.client_key)
    return ctx


def client_ssl_context(
    addr: str, cacert: str = "", cert: str = "", key: str = "", *, skip_verify: bool = False
) -> ssl.SSLContext | None:
    """`ssl_context` from its parts, for settings read elsewhere (the router's)."""
    return ssl_context(
        addr, TLSSettings(cacert=cacert, client_cert=cert, client_key=key, skip_verify=skip_verify)
    )
