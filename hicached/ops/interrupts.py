"""Ctrl-C (SIGINT) in the ``hicached`` command: one line on stderr, and the process ends by
SIGINT, at whatever instant it comes (docs/operating.md, "Starting the daemon").

Ending by the signal, not with exit status 130, is what shells expect: a shell that ran the
command from a script stops the script only when its child died by SIGINT (an exit with 130 says
"the program handled Ctrl-C itself", and the script goes on); ``$?`` reads 130 either way. It is
also the one end the process can give at every instant: before Python takes SIGINT the kernel
ends it so, and Python ends so on a KeyboardInterrupt nobody caught.

The handler never raises into code it does not know: a KeyboardInterrupt raised while a C++
extension's Python callback runs (torch's import calls into Python from C++: ``_initExtension``,
``_c10d_init``) aborts the process ("terminate called after throwing an instance of
'pybind11::error_already_set'" or "'python_error'"). What it does depends on the mode the command is in:

    mode     when                                   SIGINT
    END      install() .. the start makes things    the line, then the process ends by SIGINT
             (imports, argument parsing, config;    at once, wherever the main thread is:
             every admin command throughout)        nothing raised, nothing made to undo
    RECORD   ``serve``, from just before the state  remembered only; the start calls check()
             lock until its own handlers are in     between its steps (``phases.py``) and
             place                                  raises there, undoes what it made, and the
                                                    CLI writes the line and calls end()
    RAISE    the demo (an engine: its cleanup is    KeyboardInterrupt, as Python's default
             in ``finally`` blocks)                 handler, and remembered (check() raises it
                                                    again if a library swallowed it)

After the daemon is ready its own handler takes over (``serve.py``): it records the signal and
stops the daemon in order ("hicached stopped"); the CLI then ends by SIGINT with no more words.
Before ``install`` runs, SIGINT is Python's (its traceback, or its "Fatal Python error" while
its own start imports ``site``): no code of ours runs there.
"""

from __future__ import annotations

import os
import signal
import sys

END, RECORD, RAISE = "end", "record", "raise"
LINE = "hicached: interrupted"

_mode = END
_seen = False
_previous: object = None  # the handler install() replaced (put back by uninstall)


def install(mode: str = END) -> bool:
    """Take SIGINT in ``mode``, unless SIGINT is ignored (a background job's) or already handled
    by someone else (an embedding program). Main thread only. Returns whether it has SIGINT
    (again: ``python -m hicached`` takes it before it imports the CLI, whose main takes it too).
    No more imports than this module's: the sooner it runs, the shorter Python's window."""
    global _previous
    current = signal.getsignal(signal.SIGINT)
    if current is _on_sigint:
        switch(mode)
        return True
    if current is not signal.default_int_handler:
        return False
    _previous = signal.signal(signal.SIGINT, _on_sigint)
    switch(mode)
    return True


def uninstall() -> None:
    """Put back the handler ``install`` replaced (main thread only; nothing if none)."""
    global _previous
    if _previous is not None and signal.getsignal(signal.SIGINT) is _on_sigint:
        signal.signal(signal.SIGINT, _previous)
    _previous = None


def switch(mode: str) -> None:
    """Handle the next SIGINT in ``mode`` (END, RECORD or RAISE: the module docstring)."""
    global _mode
    if mode not in (END, RECORD, RAISE):
        raise ValueError(f"interrupt mode must be one of {END!r}, {RECORD!r}, {RAISE!r}, "
                         f"got {mode!r}")
    _mode = mode


def _on_sigint(signum, frame) -> None:
    global _seen
    _seen = True
    if _mode == END:
        _write_line()
        _die()
    if _mode == RAISE:
        raise KeyboardInterrupt
    # RECORD: the start raises at its next check()


def record() -> None:
    """Remember a SIGINT another handler took (``serve``'s, once the daemon is up)."""
    global _seen
    _seen = True


def pressed() -> bool:
    """Whether SIGINT came since ``install`` (or ``record`` was called)."""
    return _seen


def check() -> None:
    """KeyboardInterrupt if SIGINT came: the start's safe points call it (RECORD), and it raises
    again one that a library swallowed (RAISE: torch, aiohttp catch ``BaseException``)."""
    if _seen:
        raise KeyboardInterrupt


def end(line: bool = True) -> None:
    """End the process by SIGINT, after ``LINE`` on stderr when ``line`` (main thread only);
    never returns.
    Output still buffered is written first; nothing else runs (no ``atexit``): call it once
    whatever must be undone is undone."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that left, a closed stream: nothing to keep
            pass
    if line:
        _write_line()
    _die()


def _write_line() -> None:
    # os.write, not print: the handler may run inside a write to sys.stderr (a reentrant call
    # into a buffered stream raises)
    try:
        os.write(2, f"\n{LINE}\n".encode())
    except OSError:
        pass


def _die() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)  # delivered before kill returns: the process is gone
    os._exit(128 + signal.SIGINT)  # only if something blocks SIGINT in every thread
