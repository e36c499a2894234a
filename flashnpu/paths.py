"""Files the sub-commands read and write: checked before any work, written whole.

Every sub-command that writes a file names it through ``output_file`` (or a
report folder through ``output_dir``) before it starts working, and every
file it reads through ``input_file``.  The rules, one place for all of them:

* an output file is a path to a regular file or to nothing: not a folder,
  not a device; its folder must exist (the default paths under ``build/``
  are the callers' to create, with ``make_parent=True``); its suffix is one
  the command writes; it is not one of the command's input files, nor
  another of its outputs (the same file under two names counts);
* an output folder is a folder or nothing, below a folder (or nothing) -- a
  missing folder is created when the command writes;
* an input file exists, is a regular file, and starts with the signature of
  the format it claims (``.npz`` = a zip archive, ``.gguf`` = ``GGUF``).

A file is written whole or not at all (``atomic_write``: a temporary file in
the same folder, then ``os.replace``), so an interrupted or failed run never
leaves half a file, and it gets the mode a plain ``open`` would give it: the
process umask applied to 0o666.

Every check raises ``flashnpu.errors.UsageError`` with one line naming the
option and the value.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
import threading
from pathlib import Path

from flashnpu.errors import UsageError

__all__ = ["output_file", "output_dir", "input_file", "atomic_write", "write_text", "current_umask",
           "SIGNATURES"]

#: Leading bytes of each input format ``input_file`` can check.
SIGNATURES = {
    "npz": ((b"PK\x03\x04", b"PK\x05\x06"), "an .npz archive (zip)"),
    "gguf": ((b"GGUF",), "a GGUF model file"),
}

_UMASK_LOCK = threading.Lock()


def _label(option: str, path) -> str:
    return f"{option} {str(path)!r}" if option else repr(str(path))


def _same(a: Path, b: Path) -> bool:
    """Whether two paths name one file (existing or not)."""
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return a.resolve() == b.resolve()


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and not p.is_symlink() and p != p.parent:
        p = p.parent
    return p


def output_file(path, option: str = "", suffixes=(), inputs=(), outputs=(), make_parent: bool = False) -> Path:
    """Check an output file before any work starts; return it as a ``Path``.

    Parameters
    ----------
    path : str or Path
    option : the command-line option that named it (for the message)
    suffixes : the suffixes allowed (``(".npz",)``); empty = any
    inputs : (option, path) pairs of the command's input files
    outputs : (option, path) pairs of the command's other output files
    make_parent : the caller creates a missing folder (default paths): the
        check is then only that it can be created

    Raises
    ------
    UsageError
        an empty name, a folder or other non-regular file at the path, a
        suffix not in ``suffixes``, a missing (unless ``make_parent``) or
        unwritable folder, or the path of an input or another output.
    """
    if path is None or str(path) == "":
        raise UsageError(f"{option or 'output'} needs a file name")
    p = Path(path)
    what = _label(option, path)
    if p.is_dir():
        raise UsageError(f"{what} is a folder: name a file inside it")
    if p.exists() and not p.is_file():
        raise UsageError(f"{what} exists and is not a regular file")
    for kind, pairs in (("input", inputs), ("output", outputs)):
        for opt, other in pairs:
            if other is not None and str(other) != "" and _same(p, Path(other)):
                raise UsageError(f"{what} is also the {kind} {_label(opt, other)}: "
                                 + ("it would be overwritten" if kind == "input" else "name two files"))
    if suffixes and p.suffix.lower() not in suffixes:
        raise UsageError(f"{what} must end in {' or '.join(suffixes)}")
    parent = p.parent
    if parent.exists() and not parent.is_dir():
        raise UsageError(f"{what}: {str(parent)!r} is not a folder")
    if not parent.exists():
        if not make_parent:
            raise UsageError(f"{what}: folder {str(parent)!r} does not exist")
        anc = _existing_ancestor(parent)
        if not anc.is_dir():
            raise UsageError(f"{what}: {str(anc)!r} is not a folder")
        parent = anc
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{what}: folder {str(parent)!r} is not writable")
    return p


def output_dir(path, option: str = "") -> Path:
    """Check an output folder (created later by the command); return it.

    Raises
    ------
    UsageError
        something that is not a folder at the path or above it, or a folder
        the command cannot write into.
    """
    if path is None or str(path) == "":
        raise UsageError(f"{option or 'output folder'} needs a folder name")
    p = Path(path)
    what = _label(option, path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{what} exists and is not a folder")
    anc = _existing_ancestor(p)
    if not anc.is_dir():
        raise UsageError(f"{what}: {str(anc)!r} is not a folder")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise UsageError(f"{what}: folder {str(anc)!r} is not writable")
    return p


def input_file(path, option: str = "", kind: str | None = None) -> Path:
    """Check an input file: it exists, is a regular readable file and (with
    ``kind``, a key of ``SIGNATURES``) starts as that format does.

    Raises
    ------
    UsageError naming the option, the path and what is wrong.
    """
    if path is None or str(path) == "":
        raise UsageError(f"{option or 'input'} needs a file name")
    p = Path(path)
    what = _label(option, path)
    if not p.exists():
        raise UsageError(f"{what} does not exist")
    if p.is_dir():
        raise UsageError(f"{what} is a folder, not a file")
    if not p.is_file():
        raise UsageError(f"{what} is not a regular file")
    try:
        with open(p, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise UsageError(f"cannot read {what}: {e.strerror}") from None
    if kind is not None:
        magics, name = SIGNATURES[kind]
        if not any(head.startswith(m) for m in magics):
            found = [n for ms, n in SIGNATURES.values() if any(head.startswith(m) for m in ms)]
            found = found[0] if found else "a .npy array" if head.startswith(b"\x93NUMPY") else (
                "an empty file" if not head else f"bytes {head[:4]!r}")
            raise UsageError(f"{what} is not {name}: it holds {found}")
    return p


def current_umask() -> int:
    """The process umask (read without changing it for other threads' files)."""
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_write(path, mode: str = "wb", make_parent: bool = False):
    """Open a temporary file beside ``path`` for writing; on success it
    replaces ``path`` in one step, on any error it is removed and ``path``
    is left as it was.

    The file gets mode ``0o666 & ~umask`` (an existing file's mode is kept),
    as a plain ``open(path, "w")`` would give it.  ``make_parent`` creates a
    missing folder first.
    """
    p = Path(path)
    if make_parent:
        p.parent.mkdir(parents=True, exist_ok=True)
    try:
        keep = stat.S_IMODE(os.stat(p).st_mode) if p.is_file() else None
    except OSError:
        keep = None
    fd, tmp = tempfile.mkstemp(dir=p.parent if str(p.parent) else ".", prefix=f".{p.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, keep if keep is not None else 0o666 & ~current_umask())
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text(path, text: str, make_parent: bool = False) -> Path:
    """Write ``text`` to ``path`` whole (see ``atomic_write``); return the path."""
    with atomic_write(path, "w", make_parent=make_parent) as f:
        f.write(text)
    return Path(path)
