"""Hot reload of the policy file.

Watches the file's folder (a Kubernetes ConfigMap volume swaps a `..data` symlink rather
than writing the file, so watching the file itself would miss the change), re-reads the
file when anything there changes, and applies it only if it validates and differs from the
policy in force. An invalid file is refused: the old policy keeps serving, the errors are
logged and counted."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

from watchfiles import awatch

from sluice.config import ConfigError, Policy, load_policy

log = logging.getLogger("sluice.reload")


class PolicyWatcher:
    def __init__(self, path: str | Path, apply: Callable[[Policy], None],
                 on_result: Callable[[bool, list[str]], None]) -> None:
        self.path = Path(path)
        self._apply = apply
        self._on_result = on_result
        self._digest = self._read_digest()
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    def _read_digest(self) -> str | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return None

    def reload(self, force: bool = False) -> tuple[bool, list[str]]:
        """Read, validate and apply the file. Returns (applied, errors)."""
        digest = self._read_digest()
        if not force and digest == self._digest:
            return False, []
        try:
            policy = load_policy(self.path)
        except ConfigError as exc:
            log.error("policy %s refused, the previous one stays in force: %s",
                      self.path, "; ".join(exc.errors))
            self._on_result(False, exc.errors)
            return False, exc.errors
        self._digest = digest
        self._apply(policy)
        log.info("policy %s reloaded", self.path)
        self._on_result(True, [])
        return True, []

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="policy-watch")

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _watch(self) -> None:
        # The folder, not the file's target: a ConfigMap's target folder is replaced whole.
        folder = self.path.absolute().parent
        async for _changes in awatch(folder, stop_event=self._stop, debounce=100,
                                     step=50, recursive=False):
            self.reload()
