"""Real sources for the fetch tests: an HTTP server that wants a bearer token, honours Range,
counts the bytes it sends and can be throttled or stalled; and moto's S3 server with IAM
credentials enforced, as a process of its own."""

from __future__ import annotations

import os
import re
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import boto3
import requests

from devstack.agent_tls import write_agent_certificates
from devstack.ports import free_port

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


@dataclass
class WeightsServer:
    files: dict[str, bytes]
    token: str = ""
    rate: float | None = None  # bytes per second, None: as fast as it goes
    stall_after: int | None = None  # stop sending (and hold the connection) after this many bytes
    bytes_served: int = 0
    ranges: list[str] = field(default_factory=list)
    requests: int = 0
    port: int = 0
    scheme: str = "http"
    ca: Path | None = None  # the CA that signed an HTTPS server's certificate
    _server: ThreadingHTTPServer | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, path: str) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}{path}"

    def reset_counts(self) -> None:
        with self.lock:
            self.bytes_served, self.ranges, self.requests = 0, [], 0


def _handler(state: WeightsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            with state.lock:
                state.requests += 1
            if state.token and self.headers.get("Authorization") != f"Bearer {state.token}":
                self._answer(401, b"token refused")
                return
            body = state.files.get(self.path)
            if body is None:
                self._answer(404, b"no such file")
                return
            start, status = 0, 200
            wanted = self.headers.get("Range")
            if wanted:
                with state.lock:
                    state.ranges.append(wanted)
                m = _RANGE.fullmatch(wanted)
                start = int(m.group(1)) if m else 0
                if start >= len(body):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(body)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                status = 206
            self.send_response(status)
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
            self.send_header("Content-Length", str(len(body) - start))
            self.end_headers()
            self._send(body[start:])

        def _send(self, data: bytes) -> None:
            step = 16 * 1024 if state.rate is None else max(1, int(state.rate / 10))
            sent_total = 0
            for i in range(0, len(data), step):
                if state.stall_after is not None and sent_total >= state.stall_after:
                    time.sleep(3600)
                chunk = data[i : i + step]
                try:
                    self.wfile.write(chunk)
                    self.wfile.flush()
                except OSError:
                    return
                sent_total += len(chunk)
                with state.lock:
                    state.bytes_served += len(chunk)
                if state.rate is not None:
                    time.sleep(len(chunk) / state.rate)

        def _answer(self, code: int, text: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)

    return Handler


@contextmanager
def weights_server(
    files: dict[str, bytes], tls_dir: Path | None = None, **options: object
) -> Iterator[WeightsServer]:
    """With `tls_dir`, HTTPS with a certificate for 127.0.0.1 from a CA of its own (`.ca`), which
    a client trusts through SSL_CERT_FILE."""
    state = WeightsServer(files, **options)  # type: ignore[arg-type]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    server.daemon_threads = True
    if tls_dir is not None:
        tls = write_agent_certificates(tls_dir, "weights.test")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(tls.cert, tls.key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        state.scheme, state.ca = "https", tls.ca
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class S3:
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str

    def source(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}?region=us-east-1&endpoint={self.endpoint}"


# Requests moto answers before it enforces IAM: create the user, its key and its policy.
_SETUP_REQUESTS = 3


@contextmanager
def moto_s3(objects: dict[str, bytes], bucket: str = "weights") -> Iterator[S3]:
    """moto's S3 in server mode, in a process of its own, with IAM authentication enforced
    (INITIAL_NO_AUTH_ACTION_COUNT): only the access key created here gets in."""
    port = free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(_SETUP_REQUESTS)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-p", str(port), "-H", "127.0.0.1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                requests.get(f"{endpoint}/moto-api/", timeout=1)
                break
            except requests.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise AssertionError("moto server did not start") from None
                time.sleep(0.2)
        boot = {"endpoint_url": endpoint, "region_name": "us-east-1"}
        iam = boto3.client("iam", aws_access_key_id="boot", aws_secret_access_key="boot", **boot)
        iam.create_user(UserName="fetcher")
        key = iam.create_access_key(UserName="fetcher")["AccessKey"]
        iam.put_user_policy(
            UserName="fetcher",
            PolicyName="s3",
            PolicyDocument='{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"s3:*","Resource":"*"}]}',
        )
        s3 = boto3.client(
            "s3",
            aws_access_key_id=key["AccessKeyId"],
            aws_secret_access_key=key["SecretAccessKey"],
            **boot,
        )
        s3.create_bucket(Bucket=bucket)
        for name, body in objects.items():
            s3.put_object(Bucket=bucket, Key=name, Body=body)
        yield S3(endpoint, key["AccessKeyId"], key["SecretAccessKey"], bucket)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
