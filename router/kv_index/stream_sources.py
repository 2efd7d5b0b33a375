"""Two engines publishing under one worker id (pure; part of :mod:`.stream`).

A worker id names one engine at a time: a new epoch is that engine restarted. Two
servers that call themselves the same (the plugin's default ``w<rank>`` on two
single-rank servers, or one id configured twice) break that: each heartbeats with its
own epoch. The stream follows one of them (the newer epoch, or the one it took first)
and refuses the other's messages; before, nothing said so, and each restart of either
server swapped the source the index followed, with a purge and a snapshot each time.

:class:`SourceConflict` tells such a conflict from a restart. A heartbeat the stream
refuses (a retired or older epoch) is "another source"; one such heartbeat proves
nothing (the old engine's last beat, a clock stepped back before a restart). A conflict
is found when the same other source is heard again *after* the followed one was heard
since its previous heartbeat: both run now. Found once per conflict (the owner warns
once); it is held while the other source was heard within ``hold_s``, longer than a
server's restart, so the other server restarting does not end it. While it is held the
stream sticks to the source it follows (:meth:`held`): a new epoch is taken only once
the followed source has gone silent, and the restart of a worker without a conflict is
taken at once, as before.

While a conflict is held, a new epoch refused is either the other server restarting or
the followed one's own restart (its old engine not yet silent for its window): nothing
tells them apart until it is heard again after the followed source spoke since. Until
then it is only ``pending``: it does not replace the other source, and if the stream
takes it (the followed source went silent: a restart) the other source stays what it
was. Before, it replaced the other source at once, and the followed server's own dead
engine became "the other engine", the hold running from its last beat.

Time comes from the caller; nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class OtherSource:
    """The last source heard under the worker's id besides the one followed."""

    epoch: str
    heard: float             # when its last heartbeat came (the owner's clock)
    window_s: float          # its own liveness window (its interval times the misses)
    status: object | None    # its last heartbeat (a WorkerStatus for the service)


@dataclass(frozen=True, slots=True)
class IdConflict:
    """A conflict held (see the module doc), for views."""

    since: float             # when it was found
    other: OtherSource


class SourceConflict:
    """One worker's record of other sources under its id (module doc)."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.other: OtherSource | None = None
        # While a conflict is held: a new source refused, not yet heard beside the one
        # followed (the module doc).
        self.pending: OtherSource | None = None
        self._since: float | None = None  # when the conflict held now was found

    def held(self, now: float) -> bool:
        """Whether a conflict is held: found, and the other source heard within hold_s."""
        return (self._since is not None and self.other is not None
                and now - self.other.heard <= self.hold_s)

    def current(self, now: float) -> IdConflict | None:
        if not self.held(now):
            return None
        assert self._since is not None and self.other is not None
        return IdConflict(self._since, self.other)

    def refused(self, epoch: str, now: float, followed_heard: float | None, window_s: float,
                status: object | None) -> bool:
        """A heartbeat of ``epoch`` the stream refused, while the source it follows was
        last heard at ``followed_heard``. True when it begins a conflict (once per
        conflict)."""
        self.expire(now)
        other = self.other
        began = False
        if other is not None and other.epoch == epoch:
            # Heard before; the followed source spoke since: both run now.
            if (self._since is None and followed_heard is not None
                    and followed_heard > other.heard):
                self._since = now
                began = True
            other.heard, other.window_s, other.status = now, window_s, status
        elif self._since is not None:
            # A new source while a conflict is held: the other server restarted, or the
            # followed one did. Pending until heard beside the followed one (module doc).
            pending = self.pending
            if pending is None or pending.epoch != epoch:
                self.pending = OtherSource(epoch, now, window_s, status)
            elif followed_heard is not None and followed_heard > pending.heard:
                self.other, self.pending = OtherSource(epoch, now, window_s, status), None
            else:
                pending.heard, pending.window_s, pending.status = now, window_s, status
        else:
            # A source not heard before: nothing proves yet that it runs beside the
            # followed one.
            self.other = OtherSource(epoch, now, window_s, status)
        return began

    def adopted(self, epoch: str, left: OtherSource | None) -> None:
        """The stream follows ``epoch`` now, the source it followed (``left``: its epoch,
        last heard, window and heartbeat; None: none) having gone silent. While a
        conflict is held, the source left becomes the other one (it may come back: the
        hold runs from its last heartbeat); else ``epoch`` is simply no other source. A
        pending source taken (the followed one's restart, as far as anyone can tell)
        leaves the other source as it was."""
        if self.pending is not None and self.pending.epoch == epoch:
            self.pending = None
            return
        if self.other is None or self.other.epoch != epoch:
            return
        self.other = left if self._since is not None and left is not None else None
        if self.other is None:
            self._since = None

    def expire(self, now: float) -> None:
        """Forget a conflict past its hold, and an other source without a conflict once
        it has been silent for its liveness window (a restart's last beat)."""
        pending = self.pending
        if pending is not None and now - pending.heard > pending.window_s:
            self.pending = None  # silent for its window: never heard beside the followed one
        other = self.other
        if other is None:
            return
        if self._since is not None:
            if now - other.heard > self.hold_s:
                self._since, self.other, self.pending = None, None, None
        elif now - other.heard > other.window_s:
            self.other = None
