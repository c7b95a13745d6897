"""The persistent XLA compilation cache, on by default.

JAX can keep every compiled program on disk, keyed by the program, its devices, the compile options and
the XLA flags (``jax_compilation_cache_dir``); a second launch of the same experiment then loads its
programs instead of compiling them again. dtx turns it on for every run (``config.compilation_cache``):

* ``"auto"`` (the default): the user's cache folder, ``$DTX_COMPILATION_CACHE`` if set (set empty: off),
  else ``$XDG_CACHE_HOME/dtx/jax`` or ``~/.cache/dtx/jax``;
* a folder: that folder (created if missing);
* ``""``: off (nothing is read or written).

Small programs are cached too (JAX's default skips programs that compiled in under a second, which on
the emulated CPU mesh is nearly every program dtx compiles). A program read back is the program that
was compiled: its text, cost and memory analyses are the compiled program's (what ``--verify`` and the
accountant read).

The folder is not capped: JAX's cap (``jax_compilation_cache_max_size``) rescans the whole folder at
every write, which a test suite writing thousands of programs pays for by the minute, and it breaks on
a folder written without it. Delete the folder to reclaim the space; it refills as runs compile. Several
processes may share one folder (the suite's, a job's on one host): a program another process is still
writing fails to read, and JAX warns and compiles it.

Compile times are JAX's own: :class:`CompileClock` listens to JAX's monitoring events and splits the
time spent in tracing, lowering, XLA compiling and reading the cache; a run records its start-up's
(``startup_compile_s``, ``startup_compiles``, ``startup_cache_hits`` in its first record).
"""

from __future__ import annotations

import dataclasses
import os

import jax
from jax.experimental.compilation_cache import compilation_cache

ENV = "DTX_COMPILATION_CACHE"  # overrides "auto": one folder shared by a job's processes, a CI cache, ...


class CacheError(ValueError):
    """A compilation-cache setting that cannot be used; the message says how to fix it."""


def default_dir() -> str:
    """Where ``compilation_cache="auto"`` keeps programs ("" when ``$DTX_COMPILATION_CACHE`` is set empty:
    off, for the commands that take no config, such as ``dtx simulate --verify``)."""
    if ENV in os.environ:
        return os.path.expanduser(os.environ[ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dtx", "jax")


def resolve(setting: str) -> str:
    """The folder ``setting`` names ("" when the cache is off)."""
    if not isinstance(setting, str):
        raise CacheError(f"compilation_cache={setting!r} must be a string: 'auto', a folder, or '' (off)")
    if setting == "":
        return ""
    if setting == "auto":
        return default_dir()
    return os.path.abspath(os.path.expanduser(setting))


def enable(setting: str = "auto") -> str:
    """Point JAX's persistent compilation cache at ``setting``'s folder (see the module docstring);
    returns the folder, or "" when ``setting`` turns the cache off. Safe to call again with another folder
    (a notebook, a test): the next compile uses the new one."""
    directory = resolve(setting)
    if directory:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise CacheError(f"compilation_cache={setting!r}: cannot create {directory!r} ({e.strerror}); give a "
                             f"writable folder (--config.compilation_cache=/path) or turn the cache off "
                             f"(--config.compilation_cache='')") from None
        if not os.access(directory, os.W_OK):
            raise CacheError(f"compilation_cache={setting!r}: {directory!r} is not writable; give a writable "
                             "folder (--config.compilation_cache=/path) or turn the cache off "
                             "(--config.compilation_cache='')")
    if (jax.config.jax_compilation_cache_dir or "") != directory:
        jax.config.update("jax_compilation_cache_dir", directory or None)
        # JAX opens its cache once, at the first compile, and keeps that folder: forget it, so that the
        # next compile opens the new one (or none).
        compilation_cache.reset_cache()
    # Cache every program: dtx's programs on the CPU mesh compile in well under JAX's 1 s threshold.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


# JAX's monitoring events: one per traced function, lowered module, executable (XLA compile or cache
# read: the backend event spans both) and cache read.
_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "backend_s",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read_s",
}
_HIT = "/jax/compilation_cache/cache_hits"
_clocks: list[CompileClock] = []
_listening = False


@dataclasses.dataclass(eq=False)  # clocks are told apart by identity: two may hold equal figures
class CompileClock:
    """Seconds JAX reports while this clock runs (``with CompileClock() as clock: ...``).

    ``backend_s`` is the time to get executables (XLA compiling the misses plus reading the hits back),
    ``cache_read_s`` the reading part; ``trace_s`` and ``lower_s`` are the Python tracing and MLIR
    lowering, which the cache does not save. ``programs`` executables were asked for, ``hits`` of them
    came from the cache.
    """
    trace_s: float = 0.0
    lower_s: float = 0.0
    backend_s: float = 0.0
    cache_read_s: float = 0.0
    programs: int = 0
    hits: int = 0

    @property
    def compile_s(self) -> float:
        """XLA compiling alone (the misses)."""
        return max(self.backend_s - self.cache_read_s, 0.0)

    @property
    def compiles(self) -> int:
        """Programs XLA compiled (not read from the cache)."""
        return self.programs - self.hits

    def __enter__(self) -> CompileClock:
        _listen()
        _clocks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _clocks.remove(self)

    def record(self, prefix: str = "") -> dict:
        """The figures a run records (``startup_compile_s`` ...): ``compile_s`` is the time to get the
        executables, compiled or read back; seconds rounded to the millisecond."""
        return {f"{prefix}compile_s": round(self.backend_s, 3), f"{prefix}trace_s": round(self.trace_s + self.lower_s, 3),
                f"{prefix}compiles": self.compiles, f"{prefix}cache_hits": self.hits}


def _on_duration(name: str, seconds: float, **_) -> None:
    field = _EVENTS.get(name)
    for clock in _clocks if field else ():
        setattr(clock, field, getattr(clock, field) + seconds)
        if field == "backend_s":
            clock.programs += 1


def _on_event(name: str, **_) -> None:
    for clock in _clocks if name == _HIT else ():
        clock.hits += 1


def _listen() -> None:
    global _listening
    if not _listening:  # JAX keeps listeners for the process's life: register once
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        jax.monitoring.register_event_listener(_on_event)
        _listening = True
