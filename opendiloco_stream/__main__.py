"""``python -m opendiloco_stream``: the command line, ended without the interpreter's teardown.

Once a command has returned, the interpreter still frees torch's, transformers' and hivemind's
modules one by one: ~1.5 s of CPU (and several seconds on a busy machine) at the end of every peer
and bootstrap, after their work is done and their files are closed. So the exit handler registered
here, first and therefore run last, ends the process at once: the other exit handlers (logging,
multiprocessing's children, the loggers' runs) and the wait for non-daemon threads have run by
then, and stdout/stderr are flushed. A command that raises (a traceback, ``SystemExit``) ends the
usual way.
"""

import atexit
import sys

from opendiloco_stream.net.lifecycle import exit_without_teardown

_returned: list[int] = []  # the command's exit code, once it returned


def _exit_now() -> None:
    if _returned:
        exit_without_teardown(_returned[0])


atexit.register(_exit_now)

from opendiloco_stream.cli import main  # noqa: E402  (after the handler: handlers run last-registered first)

_returned.append(main())
sys.exit(_returned[0])
