"""Running the router under uvicorn, for `llmgw router`."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from nomad_driver.logs import configure_logging
from router.app import RouterApp
from router.config import ConfigError, Limits, RouterConfig, Timeouts, from_env, load_api_keys, parse_listen


def build_config(
    *,
    listen: str,
    api_keys_file: str = "",
    tls_cert: str = "",
    tls_key: str = "",
    models_file: str = "",
    max_body_bytes: int = Limits.max_body_bytes,
    first_byte_timeout_s: float = Timeouts.first_byte_s,
) -> RouterConfig:
    host, port = parse_listen(listen)
    if bool(tls_cert) != bool(tls_key):
        raise ConfigError("--tls-cert and --tls-key go together: give both to serve HTTPS, or neither")
    for flag, path in (("--tls-cert", tls_cert), ("--tls-key", tls_key), ("--models", models_file)):
        if path and not os.path.isfile(path):
            raise ConfigError(f"{flag} {path}: no such file")
    if max_body_bytes <= 0:
        raise ConfigError("--max-body-mib must be positive")
    if first_byte_timeout_s <= 0:
        raise ConfigError("--first-byte-timeout must be positive")
    config = from_env()
    return replace(
        config,
        host=host,
        port=port,
        api_keys=load_api_keys(api_keys_file, os.environ.get("LLMGW_API_KEYS", "")),
        tls_cert=tls_cert,
        tls_key=tls_key,
        models_file=models_file,
        limits=replace(config.limits, max_body_bytes=max_body_bytes),
        timeouts=replace(config.timeouts, first_byte_s=first_byte_timeout_s),
    )


def serve(*, activation: bool = True, log_level: str = "info", **options: object) -> None:
    import uvicorn

    config = build_config(**options)  # type: ignore[arg-type]
    configure_logging(log_level)
    app = RouterApp(config, activation=activation)
    if not config.api_keys:
        logging.getLogger("llmgw.router").warning(
            "no API keys configured: anyone who can reach %s:%d can use every model", config.host, config.port
        )
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        ssl_certfile=config.tls_cert or None,
        ssl_keyfile=config.tls_key or None,
        lifespan="on",
        log_level=log_level,
        # uvicorn's own lines go through the root logger, in the one llmgw format.
        log_config=None,
        # One line per request costs more than the proxying; the metrics count every request.
        access_log=False,
        # Clients such as the openai SDK keep connections open between calls.
        timeout_keep_alive=75,
        h11_max_incomplete_event_size=config.limits.max_header_bytes,
    )
