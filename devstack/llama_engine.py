"""A llama.cpp engine process: llama-cpp-python's OpenAI-compatible server on one GGUF file.

The server loads the model before it listens, so a model llama.cpp cannot load never opens the
port: the process exits and the reason is in its stderr, which is what the watcher reads as a
start failure's last error.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import httpx

from devstack import lifetime
from devstack.ports import free_port


class LlamaServerError(RuntimeError):
    """The engine exited or did not become ready; the message carries its stderr tail."""


class LlamaServer:
    """A started `python -m llama_cpp.server` process with its output in files."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        *,
        model_path: Path,
        host: str,
        port: int,
        stdout_path: Path,
        stderr_path: Path,
        ready_path: str = "/v1/models",
    ) -> None:
        self._proc = proc
        self.ready_path = ready_path
        self.model_path = model_path
        self.host = host
        self.port = port
        self.stdout_path = stdout_path
        self.stderr_path = stderr_path

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.poll()

    def stderr_text(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def stderr_tail(self, lines: int = 30) -> str:
        return "\n".join(self.stderr_text().splitlines()[-lines:])

    def wait_ready(self, timeout: float = 60.0) -> LlamaServer:
        """Poll the readiness path until it answers 200: `/v1/models` for llama_cpp.server, which
        has no `/health`, and `/health` for llama.cpp's own llama-server."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                code = self._proc.poll()
                if code is not None:
                    raise LlamaServerError(
                        f"llama.cpp server for {self.model_path} exited with status {code} before it "
                        f"was ready; stderr ({self.stderr_path}) ends:\n{self.stderr_tail()}"
                    )
                try:
                    if client.get(f"{self.url}{self.ready_path}").status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        raise LlamaServerError(
            f"llama.cpp server for {self.model_path} at {self.url} was not ready within {timeout:.0f}s; "
            f"stderr ({self.stderr_path}) ends:\n{self.stderr_tail()}"
        )

    def wait_exit(self, timeout: float = 60.0) -> int:
        """Wait for the process to end by itself and return its exit status."""
        try:
            return self._proc.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            raise LlamaServerError(
                f"llama.cpp server for {self.model_path} (pid {self.pid}) still running after {timeout:.0f}s"
            ) from exc

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit status."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        return self._proc.returncode

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def llama_server_command(
    model_path: str | Path, host: str, port: int, n_ctx: int, extra_args: Sequence[str] = ()
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
        "--n_ctx",
        str(n_ctx),
        *extra_args,
    ]


def start_logged(
    cmd: list[str], name: str, port: int, log_dir: str | Path | None, die_with_parent: bool, tmp_prefix: str
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """Start an engine process in a session of its own, output to `<log_dir>/<name>-<port>.stdout`
    and `.stderr` (log_dir a fresh temporary folder named tmp_prefix... if not given):
    (process, stdout path, stderr path). `die_with_parent` ties its life to this process."""
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=tmp_prefix))
    logs.mkdir(parents=True, exist_ok=True)
    stdout_path = logs / f"{name}-{port}.stdout"
    stderr_path = logs / f"{name}-{port}.stderr"
    with stdout_path.open("wb") as out, stderr_path.open("wb") as err:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
            preexec_fn=lifetime.die_with_parent if die_with_parent else None,
        )
    return proc, stdout_path, stderr_path


def start_llama_server(
    model_path: str | Path,
    port: int | None = None,
    host: str = "127.0.0.1",
    n_ctx: int = 256,
    extra_args: Sequence[str] = (),
    log_dir: str | Path | None = None,
    die_with_parent: bool = False,
) -> LlamaServer:
    """Start the engine and return at once; call `wait_ready()` or `wait_exit()` next.

    Output goes to `log_dir` (a fresh temporary folder if not given) as
    `llama-<port>.stdout` and `llama-<port>.stderr`. `die_with_parent` ties the engine's life
    to this process (for tests).
    """
    model = Path(model_path)
    if port is None:
        port = free_port(host)
    cmd = llama_server_command(model, host, port, n_ctx, extra_args)
    proc, stdout_path, stderr_path = start_logged(
        cmd, "llama", port, log_dir, die_with_parent, "llmgw-llama-"
    )
    return LlamaServer(
        proc, model_path=model, host=host, port=port, stdout_path=stdout_path, stderr_path=stderr_path
    )
