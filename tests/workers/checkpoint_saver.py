"""Fork server for the kill -9 tests: runs ``fp8ops train MANIFEST --resume --run-dir RUN_DIR``
in child processes that the test SIGKILLs, without paying the imports for every child.

Usage: python checkpoint_saver.py MANIFEST RUN_DIR, then one command a line on stdin:

    start LOG    fork a child that runs the command (stdout and stderr to LOG) in a process
                 group of its own; answers "pid N". Kill it with os.killpg(N, SIGKILL): the
                 group also holds the writer processes and the multiprocessing manager that
                 Megatron's checkpoint writer starts, as a node failure would take them too.
    wait N       reap child N; answers "exit CODE" (negative: the signal that ended it)

End of input ends the server. Importing torch and Megatron takes about 5 s of a child's 6 s
start on 2 cores; forking after the imports keeps a kill-resume loop of several segments
within the test file's time budget. Nothing numeric has run before the fork, so every child
starts as a fresh ``fp8ops`` process would, with torch's default thread count.
"""

import os
import sys


def serve(manifest: str, run_dir: str) -> None:
    # Imported here, not at the top: Megatron's checkpoint writer starts a "spawn"
    # multiprocessing manager, which re-imports this file as its main module.
    import fp8ops.checkpoint.training  # noqa: F401 - imported once, for every child
    import fp8ops.train  # noqa: F401
    from fp8ops.cli import main
    from fp8ops.megatron import build_gpt  # noqa: F401 - Megatron itself

    command = ["train", manifest, "--resume", "--run-dir", run_dir, "--no-progress"]
    for line in sys.stdin:
        verb, argument = line.split(maxsplit=1)
        if verb == "start":
            pid = os.fork()
            if pid == 0:
                os._exit(_child(main, command, argument.strip()))
            _answer(f"pid {pid}")
        elif verb == "wait":
            _, status = os.waitpid(int(argument), 0)
            _answer(f"exit {os.waitstatus_to_exitcode(status)}")


def _child(main, command: list[str], log_path: str) -> int:
    os.setsid()  # a process group of its own, for os.killpg
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        main(command)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a bug: its traceback goes to the log
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code  # os._exit: never back into the server's loop, nor its atexit handlers


def _answer(text: str) -> None:
    print(text, flush=True)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
