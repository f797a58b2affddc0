"""Files the command line reads and writes: bad paths refused before any work, outputs that
never collide with the input or with each other, and every output of a command written at
its end, all or none.

Each output is written to a temporary file beside it and renamed into place only once every
output of the command has been written (:class:`Staged`); on any failure the temporaries are
removed and nothing the user had is replaced. A new file gets the mode the umask gives
(``0o666 & ~umask``, as ``open`` would); a file replaced keeps its mode.
"""
from __future__ import annotations

import os
import tempfile


class UsageError(Exception):
    """Bad input: reported on stderr with exit code 2."""


def check_output(path: str | None) -> None:
    """Refuse, before anything is written, an output path that cannot be written."""
    if path is None:
        return
    if os.path.isdir(path):
        raise UsageError(f"{path} is a directory, not a file to write")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"output folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and
                                          not os.access(path, os.W_OK)):
        raise UsageError(f"{path}: permission denied")


def check_distinct(inputs: dict, outputs: dict) -> None:
    """``{option: path}`` of the files a command reads and writes: no output may be an
    input (through a link too) or another output."""
    seen: dict[str, str] = {}
    for opt, path in inputs.items():
        if path is not None:
            seen.setdefault(os.path.realpath(path), opt)
    for opt, path in outputs.items():
        if path is None:
            continue
        real = os.path.realpath(path)
        if real in seen:
            raise UsageError(f"{opt} {path} is the same file as {seen[real]}: each output "
                             f"needs a file of its own, and an input is never overwritten")
        seen[real] = opt


def load(path: str) -> bytes:
    """The bytes of an input file, or a :class:`UsageError` saying why not."""
    if os.path.isdir(path):
        raise UsageError(f"{path} is a directory, not a file")
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such file")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise UsageError(f"{path}: {e.strerror}") from None


def _new_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


class Staged:
    """The outputs of one command: :meth:`add` writes each to a temporary file beside its
    path, :meth:`commit` renames them all into place; leaving the ``with`` block without
    committing (an error) removes the temporaries."""

    def __init__(self):
        self._files: list[tuple[str, str]] = []

    def __enter__(self) -> "Staged":
        return self

    def __exit__(self, *exc) -> None:
        for tmp, _ in self._files:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self._files = []

    def add(self, path: str, data) -> None:
        check_output(path)
        folder = os.path.dirname(os.path.abspath(path))
        try:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".hlofold-", suffix=".tmp")
        except OSError as e:
            raise UsageError(f"{path}: {e.strerror}") from None
        self._files.append((tmp, path))
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data.encode() if isinstance(data, str) else data)
            os.chmod(tmp, os.stat(path).st_mode & 0o7777 if os.path.exists(path)
                     else _new_mode())
        except OSError as e:
            raise UsageError(f"{path}: {e.strerror}") from None

    def commit(self) -> None:
        """Rename every output into place; if one rename fails, those done are undone (the
        files they replaced put back) before the error is raised."""
        done: list[tuple[str, str | None]] = []        # (path, the old file moved aside)
        try:
            for tmp, path in self._files:
                old = None
                if os.path.exists(path):
                    old = tmp + ".old"
                    os.replace(path, old)
                done.append((path, old))
                os.replace(tmp, path)
        except OSError as e:
            for path, old in reversed(done):
                if old is not None:
                    os.replace(old, path)
                elif os.path.exists(path):
                    os.unlink(path)
            raise UsageError(f"{e.filename}: {e.strerror}") from None
        for _, old in done:
            if old is not None:
                os.unlink(old)
        self._files = []
