"""Hot reload of the policy file.

Polls the file twice a second: where its path resolves to (a Kubernetes ConfigMap volume
swaps a `..data` symlink rather than writing the file), its inode, size and mtime.

A reload is all or nothing. The file is read, validated as a whole (the schema, the
environment it needs, and that it locks nobody out: `config.lockout_errors`), and only
then applied; anything that goes wrong on the way, whatever its type (an unreadable or
non-UTF-8 file, an empty one, YAML that is not a policy, a surprise while applying), is a
refused reload: the policy in force keeps serving, the reason is logged, counted in
`sluice_policy_reloads_total{result="refused"}` and shown by `sluice_policy_last_reload_ok`
(0), and the watcher goes on watching.

Partial writes: a file that appears whole (a rename over it, a ConfigMap's symlink swap:
its inode or real path changes) is read at the next poll; one written in place (same
inode, new size or mtime: an editor, `kubectl cp`, a shell redirection) is read only once
it has stayed unchanged for `SETTLE_S`, so a write in several parts is read once, whole.

Why polling and not inotify (watchfiles): watchfiles runs its watcher in a thread that
competes for the GIL with the event loop, and measured here it raised the gateway's CPU per
proxied request by 25-45% (docs/decisions.md, D2); a stat() twice a second costs nothing."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from sluice.config import ConfigError, Policy, load_policy, lockout_errors, missing_environment

log = logging.getLogger("sluice.reload")
POLL_INTERVAL_S = 0.5
# A file written in place is read once it has not changed for this long.
SETTLE_S = 2.0

_Stamp = tuple[str, int, int, int]  # real path, inode, size, mtime


class PolicyWatcher:
    def __init__(
        self,
        path: str | Path,
        apply: Callable[[Policy], None],
        on_result: Callable[[bool, list[str]], None],
        current: Callable[[], Policy] | None = None,
        *,
        settle_s: float = SETTLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self._apply = apply
        self._on_result = on_result
        self._current = current
        self._settle_s = settle_s
        self._clock = clock
        self._digest = self._read_digest()
        self._stamp = self._read_stamp()
        # an in-place write seen but not yet read: (its stamp, when it was last seen to change)
        self._settling: tuple[_Stamp | None, float] | None = None
        self._task: asyncio.Task[None] | None = None

    def _read_digest(self) -> str | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return None

    def _read_stamp(self) -> _Stamp | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return os.path.realpath(self.path), st.st_ino, st.st_size, st.st_mtime_ns

    def reload(self, force: bool = False) -> tuple[bool, list[str]]:
        """Read, validate and apply the file. Returns (applied, errors)."""
        try:
            digest = self._read_digest()
            if not force and digest == self._digest:
                return False, []
            policy = load_policy(self.path)
            current = self._current() if self._current is not None else None
            if problems := missing_environment(policy) + lockout_errors(policy, current):
                raise ConfigError(str(self.path), problems)
            self._apply(policy)
        except ConfigError as exc:
            return self._refused(exc.errors)
        except Exception as exc:  # a refused reload whatever went wrong; never a dead watcher
            log.exception("reloading policy %s failed", self.path)
            return self._refused([f"(reload): {type(exc).__name__}: {exc}"[:500]])
        self._digest = digest
        log.info("policy %s reloaded", self.path)
        self._on_result(True, [])
        return True, []

    def _refused(self, errors: list[str]) -> tuple[bool, list[str]]:
        log.error(
            "policy %s refused, the previous one stays in force: %s",
            self.path,
            "; ".join(errors),
        )
        self._on_result(False, errors)
        return False, errors

    def poll(self) -> None:
        """One look at the file (the watcher calls it every POLL_INTERVAL_S)."""
        stamp = self._read_stamp()
        now = self._clock()
        if stamp != self._stamp:
            old, self._stamp = self._stamp, stamp
            whole = old is None or stamp is None or old[:2] != stamp[:2]
            if whole:  # appeared whole: a rename, a symlink swap (or it went away)
                self._settling = None
                self.reload()
                return
            self._settling = (stamp, now)
            return
        if self._settling is not None and now - self._settling[1] >= self._settle_s:
            self._settling = None
            self.reload()

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
            try:
                self.poll()
            except Exception:  # never let a surprise stop hot reload for good
                log.exception("watching policy %s failed", self.path)
