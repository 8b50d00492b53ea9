"""Fork server for tests/test_checkpoint_faults.py: runs ``fp8ops`` commands in child processes
that the test kills with SIGKILL, without paying the imports for every child.

Usage: python checkpoint_saver.py, then one command a line on stdin (arguments split as a
shell would, by shlex):

    start LOG ARG...   fork a child that runs ``fp8ops ARG...`` (stdout and stderr appended to
                       LOG) in a process group of its own; answers "pid N"
    wait N             reap child N; answers "exit CODE" (negative: the signal that ended it)

End of input ends the server. Kill a child with ``os.killpg(N, signal.SIGKILL)``: its group
also holds the writer processes and the multiprocessing manager that Megatron's checkpoint
writer starts, which a node failure would take down with it.

Why a fork server: importing torch and Megatron is about 5 s of a fresh ``fp8ops`` process's
6 s start on 2 cores; forking after the imports keeps a kill-and-resume loop of several
processes within the test file's time budget. Nothing has computed anything before the fork (no
thread pool started), so each child trains exactly as a fresh ``fp8ops`` process does: the
test compares its losses bit for bit with a run in the pytest process.
"""

import os
import shlex
import sys
from typing import NoReturn


def serve() -> None:
    # Imported once, before the forks: every forked trainer starts with them loaded.
    import fp8ops.checkpoint.training
    import fp8ops.train  # noqa: F401
    from fp8ops.cli import main
    from fp8ops.megatron import build_gpt  # noqa: F401 - Megatron itself

    for line in sys.stdin:
        verb, *arguments = shlex.split(line)
        if verb == "start":
            pid = os.fork()
            if pid == 0:
                _child(main, log_path=arguments[0], command=arguments[1:])  # exits
            _answer(f"pid {pid}")
        elif verb == "wait":
            _, status = os.waitpid(int(arguments[0]), 0)
            _answer(f"exit {os.waitstatus_to_exitcode(status)}")
        else:
            _answer(f"error: unknown command {verb!r}")


def _child(main, *, log_path: str, command: list[str]) -> NoReturn:
    os.setsid()  # a process group of its own, for os.killpg
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        main(command)
    except SystemExit as exc:  # how main ends, on success and on user errors
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a bug: its traceback goes to the log
        import traceback

        traceback.print_exc()
        code = 1
    else:
        code = 0
    # Out of the server's loop and through the interpreter's exit, as a real process ends: the
    # exit handlers shut down the multiprocessing manager Megatron's writer started (os._exit
    # would leave it running, orphaned).
    sys.exit(code)  # nothing in serve() catches it


def _answer(text: str) -> None:
    print(text, flush=True)


if __name__ == "__main__":
    serve()
