"""``asyncclcache run``: a program with every ``pyopencl.Program`` build cached, unchanged.

::

    asyncclcache run [--dir DIR] [--strategy S] [--stats] script.py ARGS...
    asyncclcache run [...] - ARGS...                  (the script on stdin)
    asyncclcache run [...] -m package.module ARGS...
    asyncclcache run [...] -- COMMAND ARGS...

The first three run the program in this process, as ``python script.py``,
``python -`` and ``python -m module`` would (``runpy``, as ``coverage run`` does): ``sys.argv``,
``sys.path[0]``, ``__main__``, exceptions and the exit status are the program's own,
so ``mpiexec -n N python -m asyncclcache run driver.py`` works. The options become
``ASYNCCLCACHE_*`` variables of this process (so processes it starts inherit them),
and :mod:`._startup` installs the cache when the program imports pyopencl.

``-- COMMAND`` replaces this process with any command (a job script, ``mpiexec``, a
program that starts Python itself) whose environment has ``ASYNCCLCACHE_INSTALL=1``
and the options: every Python process under it with this package installed activates.
"""

from __future__ import annotations

import os
import runpy
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .errors import UsageError

__all__ = ["USAGE", "RunArgs", "main", "parse"]

USAGE = """\
usage: asyncclcache run [--dir DIR] [--strategy S] [--stats] script.py [ARGS...]
       asyncclcache run [--dir DIR] [--strategy S] [--stats] - [ARGS...]
       asyncclcache run [--dir DIR] [--strategy S] [--stats] -m MODULE [ARGS...]
       asyncclcache run [--dir DIR] [--strategy S] [--stats] -- COMMAND [ARGS...]

Run a program with every pyopencl.Program build going through the cache.

options:
  --dir DIR       cache directory (ASYNCCLCACHE_DIR)
  --strategy S    auto, kcache or thread (ASYNCCLCACHE_STRATEGY)
  --stats         one summary line per process at exit (ASYNCCLCACHE_STATS=1)
  -               read the script from stdin, as python - does
  -m MODULE       run a module, as python -m does
  -- COMMAND      run any command with ASYNCCLCACHE_INSTALL=1 in its environment
"""

EXIT_USAGE = 2


@dataclass
class RunArgs:
    """A parsed ``run`` command line: exactly one of ``script``, ``module``, ``command``."""

    directory: str | None = None
    strategy: str | None = None
    stats: bool = False
    script: str | None = None
    module: str | None = None
    command: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)


def parse(argv: Sequence[str]) -> RunArgs:
    """Options up to the program; everything after it is the program's own."""
    from .config import RETIRED_STRATEGIES, STRATEGIES

    out = RunArgs()
    argv = list(argv)
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            out.command = argv[i + 1 :]
            if not out.command:
                raise UsageError("run: -- needs a command")
            return out
        if a == "--stats":
            out.stats = True
        elif a in ("--dir", "--strategy", "-m") or a.startswith(("--dir=", "--strategy=")):
            name, eq, value = a.partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise UsageError(f"run: {name} needs a value")
                i += 1
                value = argv[i]
            if name == "--dir":
                out.directory = value
            elif name == "--strategy":
                if value not in STRATEGIES and value not in RETIRED_STRATEGIES:  # retired: warned at use
                    raise UsageError(f"run: --strategy must be one of {', '.join(STRATEGIES)}, got {value!r}")
                out.strategy = value
            else:
                out.module, out.args = value, argv[i + 1 :]
                return out
        elif a.startswith("-") and a != "-":
            raise UsageError(f"run: unknown option {a!r} (options go before the program)")
        else:
            out.script, out.args = a, argv[i + 1 :]
            return out
        i += 1
    raise UsageError("run: which program? (script.py, -m MODULE or -- COMMAND)")


def _environment(r: RunArgs) -> dict[str, str]:
    from .config import absolute_path

    env = {"ASYNCCLCACHE_INSTALL": "1"}
    if r.directory is not None:
        try:
            env["ASYNCCLCACHE_DIR"] = absolute_path(r.directory, "run: --dir")
        except ValueError as e:
            raise UsageError(str(e)) from None
    if r.strategy is not None:
        env["ASYNCCLCACHE_STRATEGY"] = r.strategy
    if r.stats:
        env["ASYNCCLCACHE_STATS"] = "1"
    return env


def main(argv: Sequence[str]) -> int:
    """``asyncclcache run ARGV``; returns the exit status (or raises the program's
    ``SystemExit``, as the interpreter would see it)."""
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE, end="")
        return 0
    try:
        r = parse(argv)
        env = _environment(r)
    except UsageError as e:
        sys.stderr.write(f"{USAGE}asyncclcache: {e}\n")
        return EXIT_USAGE
    os.environ.update(env)
    from .config import get_config

    get_config.cache_clear()  # the options above are this process's settings now
    try:
        get_config()  # a bad setting is said here, for a command too, before anything runs
    except ValueError as e:
        sys.stderr.write(f"asyncclcache: {e}\n")
        return EXIT_USAGE
    if r.command:
        return _exec(r.command)
    from . import _startup

    _startup.activate()
    module = r.module
    if module is not None:
        return _run(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True),
                    [module, *r.args], os.getcwd(), None)
    assert r.script is not None
    if r.script == "-":  # as `python -`: argv[0] '-', sys.path[0] '' (the working directory)
        return _run(_run_stdin, ["-", *r.args], "", _STDIN)
    if not os.path.exists(r.script):
        sys.stderr.write(f"asyncclcache: run: can't open file {r.script!r}: no such file\n")
        return EXIT_USAGE
    script = r.script
    return _run(lambda: runpy.run_path(script, run_name="__main__"),
                [script, *r.args], os.path.dirname(os.path.abspath(script)), os.path.abspath(script))


_STDIN = "<stdin>"


def _run_stdin() -> None:
    """The script on stdin, run as ``python -`` runs it: read to the end, then executed
    as ``__main__`` with ``__file__`` ``<stdin>`` (coding cookies honoured)."""
    import builtins
    from importlib.machinery import BuiltinImporter

    code = compile(sys.stdin.buffer.read(), _STDIN, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=_STDIN, __cached__=None, __builtins__=builtins, __loader__=BuiltinImporter,
                         __annotations__={})
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main  # as runpy.run_path does, restored afterwards
    try:
        exec(code, main.__dict__)  # noqa: S102 - the user's program, as python - runs it
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _run(call: Callable[[], object], argv: list[str], path0: str, filename: str | None) -> int:
    # As the interpreter sets them for `python script.py` / `python -` / `python -m module`.
    sys.argv[:] = argv
    if sys.path and sys.path[0] != path0:
        sys.path[0] = path0
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the program's; SystemExit and KeyboardInterrupt pass
        # What the interpreter prints, without runpy's and our frames above the program's;
        # none at all when the program never ran (a SyntaxError shows its own location).
        tb = e.__traceback__
        while tb is not None and not _is_program_frame(tb.tb_frame.f_code.co_filename, filename):
            tb = tb.tb_next
        if tb is None and isinstance(e, ImportError):
            # runpy found no module (-m), or no __main__ in a directory or zip: one line,
            # as the interpreter prints it.
            sys.stderr.write(f"{sys.executable}: {e}\n")
            return 1
        e.__traceback__ = tb
        sys.excepthook(type(e), e, e.__traceback__)
        return 1
    return 0


def _is_program_frame(co_filename: str, filename: str | None) -> bool:
    if filename is not None:
        return co_filename == filename or os.path.abspath(co_filename) == filename
    here = os.path.dirname(os.path.abspath(__file__))
    return not (co_filename.startswith(here) or "runpy" in os.path.basename(co_filename)
                or co_filename.startswith("<frozen runpy"))


def _exec(command: list[str]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(command[0], command)  # noqa: S606 - the user's command, as given
    except FileNotFoundError:
        sys.stderr.write(f"asyncclcache: run: {command[0]}: command not found\n")
        return 127
    except OSError as e:
        sys.stderr.write(f"asyncclcache: run: {command[0]}: {e.strerror or e}\n")
        return 126
    return 0  # not reached: exec does not return
