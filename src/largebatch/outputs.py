"""The commands' output files and user errors: :func:`atomic_write` (a file replaced whole or
not at all), :func:`lock_folder` (one run per folder), :class:`CommandError` (one line,
exit status 2), :func:`figure` and :func:`rounded` (a number as a header shows it). Imports no
framework (docs/design.md §6).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "LOCK_NAME",
    "CommandError",
    "atomic_write",
    "figure",
    "lock_folder",
    "plot_or_warn",
    "remove_stale_temporaries",
    "require",
    "rounded",
    "writable_folder",
]

LOCK_NAME = ".lock"
_TMP_SUFFIX = ".tmp"


def rounded(value: float) -> str:
    """``value`` as a header or a table shows it: as given when 5 significant digits hold
    it (a recipe's 24.699, 0.0625), else to 4 (a computed 16 * 1024 / 1536 is 10.67, a
    2-epoch warmup scaled to 3 of 30 epochs 0.2, to 1 of 30 0.06667)."""
    exact = f"{value:.5g}"
    return exact if float(exact) == value else f"{value:.4g}"


class CommandError(SystemExit):
    """A user error of ``largebatch COMMAND``: ``str()`` is the one-line message, exit status 2."""

    def __init__(self, command: str, message: str) -> None:
        super().__init__(2)
        self.message = f"largebatch {command}: {' '.join(str(message).split())}"

    def __str__(self) -> str:
        return self.message


def require(command: str, modules: tuple[str, ...], extra: str = "recipes") -> None:
    """A :class:`CommandError` naming the install command when any of ``modules`` cannot be
    imported, checked before the command does any work (nothing is imported here)."""
    import importlib.util

    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    if missing:
        raise CommandError(
            command, f"needs {', '.join(missing)}, not installed: pip install 'largebatch[{extra}]'"
        )


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, data: bytes | str | Callable[[IO[bytes]], object]) -> None:
    """Replace ``path`` with ``data`` (bytes, text as UTF-8, or a function writing to a binary
    file) all at once: temporary file in the same folder, fsync, ``os.replace``, fsync of the
    folder. On any error the temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=_TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 -> what open() would have made
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (POSIX)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def remove_stale_temporaries(folder: str | os.PathLike, names: Iterable[str]) -> list[Path]:
    """Delete the temporary files that a killed :func:`atomic_write` of ``FOLDER/NAME``
    left behind, for each of ``names`` (call it only while holding the folder's lock).
    Returns the removed paths."""
    removed = []
    for name in names:
        for tmp in Path(folder).glob(f".{name}.*{_TMP_SUFFIX}"):
            with contextlib.suppress(OSError):
                tmp.unlink()
                removed.append(tmp)
    return removed


def writable_folder(folder: str | os.PathLike, command: str, flag: str = "--out") -> Path:
    """Create ``folder`` (and parents) and check that files can be made in it; a
    :class:`CommandError` naming the folder otherwise."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CommandError(command, f"cannot create {flag} {folder}: {err.strerror or err}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CommandError(command, f"cannot write to {flag} {folder}: permission denied")
    return folder


@contextlib.contextmanager
def lock_folder(folder: str | os.PathLike, command: str, flag: str = "--out") -> Iterator[Path]:
    """Hold an exclusive lock on ``folder`` (``flock`` on ``FOLDER/.lock``) for the ``with``
    block; a :class:`CommandError` if another process holds it or the folder is not writable.
    The lock goes with the process, so a killed run leaves no stale lock behind."""
    import fcntl

    folder = writable_folder(folder, command, flag)
    lock = folder / LOCK_NAME
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as err:
        raise CommandError(command, f"cannot write to {flag} {folder}: {err.strerror or err}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            raise CommandError(
                command,
                f"{flag} {folder} is in use by another run"
                + (f" (process {holder})" if holder.isdigit() else "")
                + f"; wait for it to end or choose another {flag}",
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield folder
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@contextlib.contextmanager
def figure(path: str | os.PathLike, *grid: int, **subplots: Any) -> Iterator[tuple[Any, Any]]:
    """``(fig, axes)`` of a new matplotlib figure (Agg backend; ``grid`` and ``subplots``
    go to ``plt.subplots``); when the ``with`` block ends without an error the figure
    replaces ``path`` atomically as a PNG. The figure is closed either way. matplotlib is
    imported here, when a plot is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*grid, **subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=80))
    finally:
        plt.close(fig)


def plot_or_warn(command: str, path: str | os.PathLike, plot: Callable[[], object], note: str = "") -> bool:
    """Run ``plot`` (which writes ``path``); any failure, matplotlib missing included, is a
    one-line warning of ``largebatch COMMAND`` and costs the plot only. Returns whether
    the plot was written."""
    try:
        plot()
    except Exception as err:  # noqa: BLE001 -- any plotting failure only costs the plot
        reason = " ".join(f"{type(err).__name__}: {err}".split())
        print(
            f"largebatch {command}: warning: no plot written to {path} ({reason}){note}",
            file=sys.stderr,
            flush=True,
        )
        return False
    return True
