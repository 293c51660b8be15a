"""Building the native kernels' library: ``engine/csrc/*.c`` compiled once per source version, compiler
flags and CPU into ``$PDKV_CACHE_DIR/native/<digest>/libpdkv_native.so`` (about a second with gcc) and
reused by every later process.  ``engine/native.py`` loads it and wraps each kernel."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from engine.cpu_features import cpu_flags
from engine.model.embedded import cache_dir

CSRC = Path(__file__).with_name("csrc")
SOURCES = (
    CSRC / "paged_decode.c",
    CSRC / "paged_prefill.c",
    CSRC / "lora.c",
    CSRC / "quant.c",
    CSRC / "bf16_linear.c",
    CSRC / "decode_layer.c",
)
# every header, so that a change to any of them is a new build (a list by hand once missed a new one)
HEADERS = tuple(sorted(CSRC.glob("*.h")))
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=c11",
    "-fno-math-errno",
    "-ffp-contract=off",
)


def build_library(extra_flags: tuple[str, ...] = ()) -> Path:
    """The library's path, built first if this cache has no build for these sources, flags and CPU.
    ``extra_flags`` follow ``FLAGS`` (``-mno-...``: a build of another instruction form on this CPU, which
    the tests compare with the native one: engine/native.py, ``load_bf16_form``).

    Raises ``RuntimeError`` (no compiler, a failed build) or ``subprocess.SubprocessError``."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    source = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    # -march=native: a cache folder shared by different CPUs (a network home, a volume) keeps one build
    # per CPU, never one that would stop another with an illegal instruction.
    key = " ".join((compiler, *FLAGS, *extra_flags, *sorted(cpu_flags())))
    digest = hashlib.sha256(source + key.encode()).hexdigest()[:16]
    folder = cache_dir() / "native" / digest
    target = folder / "libpdkv_native.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: processes that start together never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, *extra_flags, *map(str, SOURCES), "-o", tmp, "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
