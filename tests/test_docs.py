"""Every fenced code block of ``README.md`` and ``docs/*.md`` is run here or marked as not run,
with the reason: a new example cannot slip past, and an example that stops working fails here.

Each block has a marker, an HTML comment on the last non-blank line before its fence (the
grammar, docs/development.md "Code blocks in the docs"):

    <!-- doc: run -->          python: run with this interpreter; sh: run with ``bash -e``
    <!-- doc: file NAME -->    written to NAME in the doc's working directory (a later run
                               block runs it, as a user would)
    <!-- doc: daemon -->       a one-line ``hicached serve ...``: started in the background with
                               ``--l2-size 128MiB`` added, waited for until it listens, stopped
                               after the doc's last block
    <!-- doc: output OPTIONS --> what the run block just before it prints, compared (below)
    <!-- doc: shown REASON --> not run (an install, systemd, a GPU, a 3FS mount, SGLang's
                               server, a diagram, a fragment): ``test_shown_block`` lists each
                               as skipped, with its reason

A doc's blocks run in order in a working directory of their own, with ``XDG_RUNTIME_DIR`` and
``XDG_STATE_HOME`` in it (the daemon's defaults land there), ``hicached`` and ``python`` on the
``PATH`` and in ``.venv/bin/`` (the README's paths) running this interpreter on this tree. A run
block that comes before any daemon block gets a daemon on its defaults, started as a daemon
block would be. Output is compared line by line after trailing spaces are cut; the options, ``;``
apart: ``trimmed`` (the doc's lines appear in order, others may come between),
``XDG_RUNTIME_DIR=PATH`` (the run's runtime directory is shown as PATH), ``varies PHRASE`` (the
numbers of PHRASE may be any: it is matched with each number masked, e.g. ``varies 3 pages
stored`` while an L3 write-through is still under way). "1 pages" and "1 page" are taken as one
(the CLI's plural was being fixed as this test was written).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOC_L2_SIZE = "128MiB"  # the arena of the daemons started here (the README says so)
READY_S = 90.0  # a daemon's start on a loaded 2-core machine (torch's import, the arena)
BLOCK_S = 90.0  # one run block

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*doc:\s*(?P<kind>\w+)\s*(?P<args>.*?)\s*-->\s*$")
KINDS = ("run", "file", "daemon", "output", "shown")
NUMBER = re.compile(r"\d+(?:\.\d+)?")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block of a doc: where it is, its marker, its language and text."""

    doc: str  # path relative to the repository
    line: int  # 1-based line of its opening fence
    kind: str  # one of KINDS, "" when unmarked
    args: str  # the marker's rest
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[Block]:
    """The fenced blocks of the Markdown file at ``path``, with their markers (``doc``: the
    path relative to ``root``)."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m.group("fence"), len(m.group("indent"))
        end = i + 1
        while end < len(lines) and not re.match(rf"^ *{re.escape(fence)}\s*$", lines[end]):
            end += 1
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(before)
        body = "\n".join(line[indent:] if line[:indent].isspace() else line
                         for line in lines[i + 1:end])
        found.append(Block(str(path.relative_to(root)), i + 1,
                           marker.group("kind") if marker else "",
                           marker.group("args") if marker else "",
                           m.group("lang"), body + "\n"))
        i = end + 1
    return found


ALL = [b for path in DOCS for b in blocks(path)]


def problems(found: list[Block]) -> list[str]:
    """What is wrong with the markers of ``found`` (the blocks of docs, in order)."""
    bad = []
    for k, b in enumerate(found):
        prev = found[k - 1] if k and found[k - 1].doc == b.doc else None
        if b.kind not in KINDS:
            bad.append(f"{b.where}: no marker <!-- doc: run | file NAME | daemon | output | "
                       f"shown REASON --> on the line before the block" if not b.kind else
                       f"{b.where}: unknown marker kind {b.kind!r} (one of {', '.join(KINDS)})")
        elif b.kind == "run" and b.lang not in ("python", "sh"):
            bad.append(f"{b.where}: a run block is python or sh, this one is {b.lang!r}")
        elif b.kind == "file" and not re.fullmatch(r"[\w.-]+", b.args):
            bad.append(f"{b.where}: file needs a plain file name, got {b.args!r}")
        elif b.kind == "daemon" and (len(b.text.strip().splitlines()) != 1
                                     or "hicached serve" not in b.text):
            bad.append(f"{b.where}: a daemon block is one line running `hicached serve`")
        elif b.kind == "output" and (prev is None or prev.kind != "run"):
            bad.append(f"{b.where}: an output block follows a run block")
        elif b.kind == "output":
            try:
                output_options(b.args)
            except ValueError as e:
                bad.append(f"{b.where}: {e}")
        elif b.kind == "shown" and not b.args:
            bad.append(f"{b.where}: shown needs a reason (<!-- doc: shown REASON -->)")
    return bad


def test_every_code_block_is_marked():
    assert len(ALL) > 20 and any(b.doc == "README.md" for b in ALL)  # the parser finds them
    assert problems(ALL) == []


def test_an_unmarked_block_is_named(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("Text.\n\n```sh\nls\n```\n\n<!-- doc: output -->\n```\nx\n```\n")
    assert problems(blocks(doc, tmp_path)) == [
        "x.md:3: no marker <!-- doc: run | file NAME | daemon | output | shown REASON --> on "
        "the line before the block",
        "x.md:8: an output block follows a run block"]


@pytest.mark.parametrize("block", [b for b in ALL if b.kind == "shown"], ids=lambda b: b.where)
def test_shown_block(block):
    pytest.skip(f"{block.where} not run: {block.args}")


# ---------------------------------------------------------------- output


def output_options(args: str) -> tuple[bool, str, list[str]]:
    """(trimmed, XDG_RUNTIME_DIR shown, phrases whose numbers vary) of an output marker."""
    trimmed, runtime, varies = False, "", []
    for option in filter(None, (o.strip() for o in args.split(";"))):
        if option == "trimmed":
            trimmed = True
        elif option.startswith("XDG_RUNTIME_DIR="):
            runtime = option.split("=", 1)[1]
        elif option.startswith("varies ") and NUMBER.search(option):
            varies.append(option[len("varies "):])
        else:
            raise ValueError(f"output option {option!r} is not trimmed, XDG_RUNTIME_DIR=PATH "
                             "or varies PHRASE-WITH-A-NUMBER")
    return trimmed, runtime, varies


def normalized(text: str, varies: list[str]) -> list[str]:
    text = re.sub(r"\b1 pages\b", "1 page", text)
    for phrase in varies:
        pattern = "".join(r"\d+(?:\.\d+)?" if NUMBER.fullmatch(part) else re.escape(part)
                          for part in re.split(f"({NUMBER.pattern})", phrase))
        text = re.sub(pattern, phrase, text)
    return [line.rstrip() for line in text.strip("\n").splitlines()]


def compare(expected: Block, actual: str, runtime_dir: str) -> None:
    trimmed, runtime, varies = output_options(expected.args)
    if runtime:
        actual = actual.replace(runtime_dir, runtime)
    want, got = normalized(expected.text, varies), normalized(actual, varies)
    if not trimmed:
        assert got == want, f"{expected.where}: the output differs"
        return
    rest = iter(got)  # each line of the doc's, in order, among the actual lines
    missing = next((line for line in want if not any(line == g for g in rest)), None)
    assert missing is None, (f"{expected.where}: {missing!r} is not in the output (after the "
                             "lines before it)\noutput:\n" + "\n".join(got))


def test_output_comparison():
    out = Block("x.md", 1, "output", "trimmed; XDG_RUNTIME_DIR=/run/user/1000; varies 3 stored",
                "", "at /run/user/1000/s: ok\n  3 stored, 1 pages\n")
    compare(out, "at /tmp/r/s: ok  \nother\n  0 stored, 1 page\n", "/tmp/r")
    with pytest.raises(AssertionError, match="'  3 stored, 1 page' is not in the output"):
        compare(out, "  0 stored, 1 page\nat /tmp/r/s: ok\n", "/tmp/r")  # order matters
    with pytest.raises(AssertionError, match="'  3 stored, 1 page' is not in the output"):
        compare(out, "at /tmp/r/s: ok\n  3 written, 1 page\n", "/tmp/r")  # only the phrase
    exact = dataclasses.replace(out, args="")
    compare(exact, "at /run/user/1000/s: ok\n  3 stored, 1 page\n", "")
    with pytest.raises(AssertionError, match="differs"):
        compare(exact, "at /run/user/1000/s: ok\n  3 stored, 1 page\nmore\n", "")
    with pytest.raises(ValueError, match="is not trimmed"):
        output_options("trimmed; sorted")


# ---------------------------------------------------------------- running a doc


class DocRun:
    """A doc's working directory, environment and daemon (at most one at a time)."""

    def __init__(self, tmp: pathlib.Path):
        self.cwd = tmp
        self.runtime = str(tmp / "run")
        os.mkdir(self.runtime)
        os.mkdir(tmp / "state")
        bin_dir = tmp / ".venv" / "bin"
        bin_dir.mkdir(parents=True)
        for name, line in (("hicached", f'exec "{sys.executable}" -m hicached "$@"'),
                           ("python", f'exec "{sys.executable}" "$@"')):
            (bin_dir / name).write_text(f"#!/bin/sh\n{line}\n")
            (bin_dir / name).chmod(0o755)
        env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
        env.update(XDG_RUNTIME_DIR=self.runtime, XDG_STATE_HOME=str(tmp / "state"),
                   PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH"))
                                              if p))
        self.env = env
        self.daemon: subprocess.Popen | None = None
        self.daemon_log = tmp / "daemon.log"

    def start_daemon(self, command: str, where: str) -> None:
        self.stop_daemon()
        log = open(self.daemon_log, "w")
        self.daemon = subprocess.Popen(
            ["bash", "-c", f"exec {command.strip()} --l2-size {DOC_L2_SIZE}"], cwd=self.cwd,
            env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + READY_S
        while "hicached listening on" not in self.daemon_log.read_text():
            assert self.daemon.poll() is None, \
                f"{where}: the daemon exited with {self.daemon.returncode}:\n" + \
                self.daemon_log.read_text()
            assert time.monotonic() < deadline, f"{where}: the daemon did not listen within " \
                f"{READY_S:g} s:\n" + self.daemon_log.read_text()
            time.sleep(0.05)

    def stop_daemon(self) -> None:
        if self.daemon is None:
            return
        self.daemon.send_signal(signal.SIGTERM)
        try:
            code = self.daemon.wait(30)
        except subprocess.TimeoutExpired:
            self.daemon.kill()
            code = self.daemon.wait()
        self.daemon = None
        assert code == 0, f"the daemon stopped with {code}:\n" + self.daemon_log.read_text()

    def run(self, block: Block) -> str:
        """What the run block prints (stdout); fails on a non-zero exit."""
        if self.daemon is None:  # run blocks talk to a daemon on its defaults
            self.start_daemon("hicached serve", block.where)
        if block.lang == "python":
            argv = [sys.executable, "-c", block.text]
        else:
            argv = ["bash", "-e", "-o", "pipefail", "-c", block.text]
        done = subprocess.run(argv, cwd=self.cwd, env=self.env, capture_output=True,
                              text=True, timeout=BLOCK_S)
        assert done.returncode == 0, (f"{block.where}: exit status {done.returncode}\n"
                                      f"{block.text}stdout:\n{done.stdout}stderr:\n"
                                      f"{done.stderr}")
        return done.stdout


RUN_DOCS = sorted({b.doc for b in ALL if b.kind in ("run", "daemon", "file")})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("doc", RUN_DOCS)
def test_doc_runs(doc, tmp_path):
    """The doc's run, file and daemon blocks in order, against one daemon, with the output its
    output blocks show."""
    todo = [b for b in ALL if b.doc == doc]
    assert not problems(todo)
    run = DocRun(tmp_path)
    printed = ""
    try:
        for b in todo:
            if b.kind == "daemon":
                run.start_daemon(b.text, b.where)
            elif b.kind == "file":
                (tmp_path / b.args).write_text(b.text)
            elif b.kind == "run":
                printed = run.run(b)
            elif b.kind == "output":
                compare(b, printed, run.runtime)
    finally:
        run.stop_daemon()


# ---------------------------------------------------------------- the install


def test_a_script_beside_a_clone_folder_imports_the_installed_package(tmp_path):
    """A script saved next to a clone (a folder named ``hicached``, no ``__init__.py`` at its
    top) must import the installed package, not the folder as an empty namespace package
    (``cannot import name 'Client' from 'hicached' (unknown location)``): the editable install
    puts the clone on ``sys.path`` (pyproject's ``package-dir``), and a regular package found
    anywhere on the path wins over a namespace folder found first. (Run with ``PYTHONPATH``
    naming the tree, as in a development run, it holds whatever the install.)"""
    (tmp_path / "hicached" / "docs").mkdir(parents=True)  # the clone, as far as imports go
    script = tmp_path / "first.py"
    script.write_text(textwrap.dedent("""\
        import importlib.util
        print(importlib.util.find_spec("hicached").origin)  # what `import hicached` would load
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(ROOT / "hicached" / "__init__.py")  # not None: a folder
