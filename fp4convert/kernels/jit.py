"""One build spec for fp4convert's lazily compiled libraries: what to compile, how, and where it is cached.

A :class:`BuildSpec` names the sources, the compiler command and its flags, and a target tag; its
:meth:`~BuildSpec.build` returns ``<cache root>/<tag>-<key>/<lib>``, compiling it first if that file is
missing. The key hashes every source and header (name and bytes), the flags, the compiler's identity
(its resolved path, size and mtime: a cache hit runs no subprocess) and any extra identity the caller
adds, so an edited source, another compiler or other flags never load a stale library. Concurrent
builds (threads or processes) serialize on an fcntl lock in the target folder, which the kernel
releases if a builder dies; the library is compiled into a temporary file and renamed into place,
so a reader never sees half a library.

Nothing here runs at import. Used by the three lazy builds: the CPU kernel (:mod:`fp4convert.kernels.cpu_lib`),
the CUDA kernels (:mod:`fp4convert.kernels.cuda.build`) and the public API's C++ glue (:mod:`fp4convert.kernels.cuda.api_ext`).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from fp4convert.errors import BuildFailed

log = logging.getLogger("fp4convert.kernels.jit")


def cache_root() -> Path:
    """``$FP4CONVERT_CACHE_DIR``, else ``$XDG_CACHE_HOME/fp4convert/kernels`` (``~/.cache/...``): the
    CUDA kernels' folder too."""
    env = os.environ.get("FP4CONVERT_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fp4convert" / "kernels"


def cxx() -> list[str] | None:
    """The C++ compiler command: ``$CXX`` (may carry words, e.g. ``ccache g++``), else c++ / g++ on PATH."""
    env = shlex.split(os.environ.get("CXX", ""))
    if env:
        return env
    found = shutil.which("c++") or shutil.which("g++")
    return [found] if found else None


def compiler_identity(command: list[str] | tuple[str, ...]) -> str:
    """The compiler's resolved path, size and mtime (one stat): changes with any install or upgrade.

    For a wrapper command (``ccache g++``) the last word is the compiler. FileNotFoundError when it
    does not exist.
    """
    exe = command[-1]
    path = Path(shutil.which(exe) or exe).resolve(strict=True)
    st = path.stat()
    return f"{' '.join(command)}|{path}:{st.st_size}:{st.st_mtime_ns}"


@dataclass(frozen=True)
class BuildSpec:
    """One library: ``compiler flags -o <lib> sources link`` cached as ``<root>/<tag>-<key>/<lib>``."""

    lib: str  # file name of the built library
    tag: str  # the target (CPU architecture, GPU arch): the folder's prefix, and part of the key
    compiler: tuple[str, ...]
    sources: tuple[Path, ...]  # compiled, in this order
    flags: tuple[str, ...] = ()
    headers: tuple[Path, ...] = ()  # hashed, not compiled
    link: tuple[str, ...] = ()  # after the sources
    identity: tuple[str, ...] = ()  # anything else the library depends on (a torch version, ...)
    what: str = "library"  # for the one log line of a real build
    error: type[Exception] = field(default=BuildFailed, compare=False)
    hint: str = ""  # appended to error messages: what the user can do instead
    root: Path | None = None  # default: cache_root() at build time

    def _fail(self, message: str) -> Exception:
        return self.error(f"{message}; {self.hint}" if self.hint else message)

    def key(self) -> str:
        """Hash of the sources and headers (names and bytes), flags, link flags, compiler and identity.

        The tag is not hashed: it names the folder (``<tag>-<key>``), and what makes one target's
        build differ from another's (-march, -gencode) is in the flags.
        """
        digest = hashlib.sha256()
        for f in (*self.sources, *self.headers):
            digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
        try:
            who = compiler_identity(self.compiler)
        except OSError as exc:
            raise self._fail(f"the compiler {' '.join(self.compiler)!r} was not found ({exc})") from exc
        for part in (" ".join(self.flags), " ".join(self.link), who, *self.identity):
            digest.update(part.encode() + b"\0")
        return digest.hexdigest()[:16]

    def path(self) -> Path:
        """Where the library is (or will be) cached."""
        return (self.root or cache_root()) / f"{self.tag}-{self.key()}" / self.lib

    def build(self) -> Path:
        """The cached library, compiling it first when missing (one build per key across processes)."""
        target = self.path()
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
            if target.is_file():  # another process built it while we waited
                return target
            log.info("building the fp4convert %s (one time)", self.what)
            fd, tmp = tempfile.mkstemp(suffix=Path(self.lib).suffix or ".so", dir=target.parent)
            os.close(fd)
            cmd = [*self.compiler, *self.flags, "-o", tmp, *map(str, self.sources), *self.link]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True)
            except OSError as exc:
                os.unlink(tmp)
                raise self._fail(f"could not run {cmd[0]} ({exc})") from exc
            if proc.returncode != 0:
                os.unlink(tmp)
                raise self.error(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}"[-4000:])
            os.replace(tmp, target)
        return target
