"""Hot reload of the policy file.

Polls the file twice a second: where its path resolves to (a Kubernetes ConfigMap volume
swaps a `..data` symlink rather than writing the file), its size and its mtime; a change
re-reads the file, which is applied only if it validates and its content differs from the
policy in force. An invalid file is refused: the old policy keeps serving, the errors are
logged and counted.

Why polling and not inotify (watchfiles): watchfiles runs its watcher in a thread that
competes for the GIL with the event loop, and measured here it raised the gateway's CPU per
proxied request by 25-45% (docs/decisions.md, D2); a stat() twice a second costs nothing."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from sluice.config import ConfigError, Policy, load_policy, missing_environment

log = logging.getLogger("sluice.reload")
POLL_INTERVAL_S = 0.5


class PolicyWatcher:
    def __init__(
        self,
        path: str | Path,
        apply: Callable[[Policy], None],
        on_result: Callable[[bool, list[str]], None],
    ) -> None:
        self.path = Path(path)
        self._apply = apply
        self._on_result = on_result
        self._digest = self._read_digest()
        self._stamp = self._read_stamp()
        self._task: asyncio.Task[None] | None = None

    def _read_digest(self) -> str | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return None

    def _read_stamp(self) -> tuple[str, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return os.path.realpath(self.path), st.st_size, st.st_mtime_ns

    def reload(self, force: bool = False) -> tuple[bool, list[str]]:
        """Read, validate and apply the file. Returns (applied, errors)."""
        digest = self._read_digest()
        if not force and digest == self._digest:
            return False, []
        try:
            policy = load_policy(self.path)
            if missing := missing_environment(policy):
                raise ConfigError(str(self.path), missing)
        except ConfigError as exc:
            log.error(
                "policy %s refused, the previous one stays in force: %s",
                self.path,
                "; ".join(exc.errors),
            )
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
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(POLL_INTERVAL_S)
            stamp = self._read_stamp()
            if stamp != self._stamp:
                self._stamp = stamp
                self.reload()
