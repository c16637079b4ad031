"""What a GPU node has on disk: engine installs and model weights.

An engine directory that exists is not an engine that runs: a half-copied install or one built
against another CUDA would be advertised in node meta, jobs would be placed on the node, and
each would fail at start. So every install is verified by running its own version command, and
only verified versions are published.

The agent runs in llmgw's container, which has NVML but not the host's CUDA runtime libraries
(libcudart, libcublas) nor, often, its glibc; a CUDA build of an engine cannot even load there,
though it runs on the host. When the version command fails for that reason alone (the dynamic
loader's words, nothing else), the install is verified without running it: by its
`SHA256SUMS`, which the build recipe writes (`make cuda-engines`) and which must list the
engine's program. Every listed file must be there with its checksum, so a half-copied install
is still refused; an install without the file, or with any other failure, is refused as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from nomad_driver import engines

log = logging.getLogger("llmgw.node_agent.inventory")

VERSION_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class EngineInstall:
    engine: str
    version: str
    path: Path


CHECKSUMS_FILE = "SHA256SUMS"
# What the dynamic loader (or Python's ctypes, quoting it) says when a library the program needs
# is not in this container, or is older than the one it was built against.
_LOADER_FAILURE = re.compile(
    r"error while loading shared libraries: \S+|(\S+\.so[.\d]*): cannot open shared object file"
    r"|version `GLIBC_[\d.]+' not found"
)


def loader_failure(output: str) -> str:
    """The loader's line when that is why the program could not start here, else ''."""
    for line in output.splitlines():
        if _LOADER_FAILURE.search(line):
            return line.strip()
    return ""


def sealed(install: EngineInstall) -> str:
    """'' when every file the install's SHA256SUMS lists is there with its checksum and the
    engine's program is among them; otherwise why not."""
    listing = install.path / CHECKSUMS_FILE
    try:
        lines = listing.read_text().splitlines()
    except OSError:
        return f"no {CHECKSUMS_FILE} to verify it by"
    listed: dict[str, str] = {}
    for line in lines:
        digest, _, name = line.strip().partition(" ")
        if line.strip():
            listed[name.strip().lstrip("*").removeprefix("./")] = digest.lower()
    # The program the engine runs, which a listing must cover.
    main = engines.get(install.engine).main_program
    if main not in listed:
        return f"{CHECKSUMS_FILE} does not list {main}"
    for name, digest in listed.items():
        path = install.path / name
        try:
            with path.open("rb") as f:
                actual = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError:
            return f"{name} listed in {CHECKSUMS_FILE} is missing"
        if actual != digest:
            return f"{name} does not match its checksum in {CHECKSUMS_FILE}"
    return ""


class EngineScanner:
    """Scans `<engines_dir>/<engine>/<version>/`. Verification results are cached by the
    directory's mtime, so a node agent running every few seconds does not start a Python
    interpreter per engine per pass."""

    def __init__(self, engines_dir: Path) -> None:
        self.engines_dir = engines_dir
        self._verified: dict[Path, tuple[float, bool]] = {}
        self._reported_bad: set[Path] = set()

    def _verify(self, install: EngineInstall) -> bool:
        engine = engines.get(install.engine)
        command = engine.version_command(install.path)
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=VERSION_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self._report_bad(install, str(exc))
            return False
        output = (done.stdout or "") + (done.stderr or "")
        if done.returncode == 0 and engine.version_matches(install.version, output):
            return True
        loader = loader_failure(output) if done.returncode != 0 else ""
        if loader:
            why_not = sealed(install)
            if not why_not:
                log.info(
                    "engine install verified by its %s, as it cannot load here: engine=%s version=%s "
                    "path=%s: %s",
                    CHECKSUMS_FILE,
                    install.engine,
                    install.version,
                    install.path,
                    loader,
                )
                return True
            self._report_bad(install, f"exit {done.returncode}: {loader}; {why_not}")
            return False
        tail = output.strip().splitlines()[-1:] or ["no output"]
        self._report_bad(install, f"exit {done.returncode}: {tail[0]}")
        return False

    def _report_bad(self, install: EngineInstall, detail: str) -> None:
        if install.path not in self._reported_bad:
            self._reported_bad.add(install.path)
            log.warning(
                "engine install not usable, not advertised: engine=%s version=%s path=%s: %s",
                install.engine,
                install.version,
                install.path,
                detail,
            )

    def scan(self) -> list[EngineInstall]:
        found: list[EngineInstall] = []
        if not self.engines_dir.is_dir():
            return found
        for engine_dir in sorted(self.engines_dir.iterdir()):
            if engines.find(engine_dir.name) is None or not engine_dir.is_dir():
                continue
            for version_dir in sorted(engine_dir.iterdir()):
                if not version_dir.is_dir():
                    continue
                install = EngineInstall(engine_dir.name, version_dir.name, version_dir)
                mtime = version_dir.stat().st_mtime
                cached = self._verified.get(version_dir)
                if cached is None or cached[0] != mtime:
                    ok = self._verify(install)
                    self._verified[version_dir] = (mtime, ok)
                    if ok:
                        self._reported_bad.discard(version_dir)
                if self._verified[version_dir][1]:
                    found.append(install)
        return found


def cached_models(models_dir: Path) -> list[str]:
    """Models whose weights are already on local disk, so a replica there starts without a
    download: a directory `<models_dir>/<model>/` that `llmgw fetch` completed (its `.complete`
    record), or, put there by hand, one holding a file that is neither a fetch's unfinished
    `.part` nor its bookkeeping."""
    if not models_dir.is_dir():
        return []
    present = []
    for entry in sorted(models_dir.iterdir()):
        if not entry.is_dir():
            continue
        if (entry / ".complete").is_file():
            present.append(entry.name)
            continue
        with os.scandir(entry) as files:
            if any(not f.name.startswith(".") and not f.name.endswith(".part") for f in files):
                present.append(entry.name)
    return present
