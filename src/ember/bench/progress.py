"""A rich progress bar on stderr while requests run; silent when quiet or not a terminal."""

from __future__ import annotations

import sys
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from ember.bench.record import RequestRecord


class BenchProgress:
    """One bar per phase (``phase(...)``), advanced by ``on_record`` with a running error count.

    Disabled (every call a no-op) with ``quiet=True`` or when stderr is not a
    terminal, so logs and CI output stay clean.
    """

    def __init__(self, *, quiet: bool = False) -> None:
        console = Console(stderr=True)
        self.quiet = quiet
        self.enabled = not quiet and sys.stderr.isatty()
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("errors {task.fields[errors]}"),
            TimeElapsedColumn(),
            console=console,
            disable=not self.enabled,
            transient=False,
        )
        self._task: TaskID | None = None
        self._errors = 0

    def __enter__(self) -> BenchProgress:
        self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._progress.stop()

    def phase(self, description: str, total: int | None) -> None:
        """Start a new bar; ``total=None`` for a run bounded by time only."""
        if self._task is not None:
            self._progress.stop_task(self._task)
        self._errors = 0
        self._task = self._progress.add_task(description, total=total, errors=0)

    def on_record(self, record: RequestRecord) -> None:
        """Count one finished request (pass as a runner's ``on_record``)."""
        if self._task is None:
            return
        if not record.ok:
            self._errors += 1
        self._progress.update(self._task, advance=1, errors=self._errors)

    def log(self, message: str) -> None:
        """Print a line to stderr (above the bars when they run); nothing when quiet."""
        if not self.quiet:
            self._progress.console.print(message, highlight=False)
