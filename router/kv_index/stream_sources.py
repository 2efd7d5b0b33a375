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
is *found* when the same other source is heard again *after* the followed one was heard
since its previous heartbeat: both run now. From then on the stream sticks to the source
it follows (:meth:`held`): a new epoch is taken only once the followed source has gone
silent, and the restart of a worker without a conflict is taken at once, as before.

Found is not reported. A surge rollout (Kubernetes' ``maxSurge``: the new server
heartbeats while the old one drains, both under the id) looks exactly like a conflict
for a while, then its old engine stops for good. So a conflict is *reported* (the owner
warns once, views and the gauge show it: :meth:`current`) only once the two were heard
side by side for ``confirm_s``. Until then it ends when the other source has been silent
for its liveness window (counted, ``id_conflicts_unconfirmed``); reported, it is held
while the other was heard within ``hold_s``, longer than a server's restart, so the
other server restarting does not end it. Before, every rollout was reported, and held
for ``hold_s`` (10 min). A rollout's old engine does not come back; a misconfigured
server restarting does, at its own address: a heartbeat naming the address of the other
source of a conflict that ended unreported, within ``hold_s`` of its last beat, is
refused, and the conflict found again at once, its batches held off too
(:meth:`came_back`; no swap at each restart of a server that never stays up
``confirm_s``), as found when the overlap it left was: it is reported once that was
``confirm_s`` ago, a restart no new overlap. Not at once: the server that came back may
be a rollout's new pod whose container restarted before it was ready (the old one serves
meanwhile, and the stream fell back to it), and that overlap ends as any rollout's.

While a conflict is held, a new epoch refused is either the other server restarting or
the followed one's own restart (its old engine not yet silent for its window). Where the
heartbeats' ``http_url`` tells the two servers apart (the new epoch names the followed
engine's address, which no other source shares: :meth:`same_server`), it is
the followed server's restart: one address is served by one process, so its old engine
has stopped; the stream takes it at once, as without a conflict. Before, it waited for
the old engine's liveness window (the worker declared dead and purged meanwhile). The
other server's restart names its own address and stays refused (no flip-flop); once a
source naming the followed engine's address is heard beside it (an old engine heard
again at the address taken over), that address is shared: the rule no longer applies.

Otherwise (no address, or one shared: two servers behind one Service URL) nothing tells
them apart until the new source is heard again after the followed source spoke since.
Until then it is only ``pending``: it does not replace the other source, and if the
stream takes it (the followed source went silent: a restart) the other source stays
what it was. Before, it replaced the other source at once, and the followed server's own
dead engine became "the other engine", the hold running from its last beat.

Time comes from the caller; nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhint.router.kv_index.stream_types import StreamCounters


@dataclass(slots=True)
class OtherSource:
    """The last source heard under the worker's id besides the one followed."""

    epoch: str
    heard: float             # when its last heartbeat came (the owner's clock)
    window_s: float          # its own liveness window (its interval times the misses)
    status: object | None    # its last heartbeat (a WorkerStatus for the service)
    url: str | None = None   # the address its heartbeat names (None: none)


@dataclass(frozen=True, slots=True)
class IdConflict:
    """A conflict reported and held (see the module doc), for views."""

    since: float             # when it was found
    other: OtherSource


class SourceConflict:
    """One worker's record of other sources under its id (module doc). Counts the
    heartbeats refused, the conflicts reported and those that ended unreported in
    ``counters``."""

    def __init__(self, hold_s: float, confirm_s: float, counters: StreamCounters) -> None:
        self.hold_s = hold_s
        self.confirm_s = confirm_s
        self._counters = counters
        self.other: OtherSource | None = None
        # While a conflict is held: a new source refused, not yet heard beside the one
        # followed (the module doc).
        self.pending: OtherSource | None = None
        self._since: float | None = None  # when the conflict held now was found
        self._reported = False
        # A source heard beside the followed one named its address: addresses do not
        # tell the servers apart (same_server no longer applies) until the conflict ends.
        self._shared_url = False
        # The other source of the last conflict that ended unreported (came_back), and
        # when that conflict was found: a server that came back resumes its count.
        self._left: OtherSource | None = None
        self._left_since: float | None = None

    def held(self, now: float) -> bool:
        """Whether a conflict is held: found, and the other source heard within hold_s
        (reported) or within its own liveness window (not yet)."""
        other = self.other
        if self._since is None or other is None:
            return False
        return now - other.heard <= (self.hold_s if self._reported else other.window_s)

    def current(self, now: float) -> IdConflict | None:
        """The conflict held, once reported (None before: it may be a rollout)."""
        if not self._reported or not self.held(now):
            return None
        assert self._since is not None and self.other is not None
        return IdConflict(self._since, self.other)

    def same_server(self, url: str | None, followed_url: str | None) -> bool:
        """Whether a heartbeat naming ``url`` is the followed server's own (its restart):
        the followed engine's address, one no other source was heard at."""
        other = self.other
        return (url is not None and url == followed_url and not self._shared_url
                and (other is None or other.url != url))

    def came_back(self, url: str | None, followed_url: str | None, now: float) -> bool:
        """Whether a heartbeat naming ``url`` is of the server that was the other source
        of a conflict ended unreported, within hold_s of its last beat (module doc)."""
        left = self._left
        return (url is not None and left is not None and url == left.url
                and url != followed_url and now - left.heard <= self.hold_s)

    def followed_at(self, url: str | None) -> None:
        """The stream took a heartbeat of the engine it follows, naming ``url``. The
        server that left an overlap and is followed now (the engine followed went silent,
        or it was a rollout's new pod that restarted) came back to no other: it leaves
        the record, and its next rollout's overlap is a rollout's like any other."""
        if url is not None and self._left is not None and self._left.url == url:
            self._left = self._left_since = None

    def refused(self, heard: OtherSource, followed_heard: float | None,
                followed_url: str | None, stale: bool) -> bool:
        """A heartbeat the stream refused (``heard``: its epoch, when, window, status and
        address), while the source it follows, at ``followed_url``, was last heard at
        ``followed_heard``: counted as ``stale_status`` (a retired or older epoch) or
        ``other_source_dropped`` (one held off). True when it reports a conflict (once
        per conflict)."""
        if stale:
            self._counters.stale_status += 1
        else:
            self._counters.other_source_dropped += 1
        now = heard.heard
        self.expire(now)
        back = self.came_back(heard.url, followed_url, now)
        other = self.other
        if other is not None and other.epoch == heard.epoch:
            # Heard before; the followed source spoke since: both run now.
            self.other = heard
            if followed_heard is None or followed_heard <= other.heard:
                return False
            return self._beside(heard, followed_url)
        if self._since is None:
            # A source not heard before: nothing proves yet that it runs beside the
            # followed one; but a server that came back is found at once, so that its
            # batches (which name no address) are held off too, and as found when the
            # overlap it left was: its restart is no new overlap (module doc).
            self.other = heard
            if back:
                self._since = self._left_since
            return False
        # A new source while a conflict is held: the other server restarted, or the
        # followed one did. Pending until heard beside the followed one (module doc).
        pending = self.pending
        if (pending is not None and pending.epoch == heard.epoch
                and followed_heard is not None and followed_heard > pending.heard):
            self.other, self.pending = heard, None
            return self._beside(heard, followed_url)
        self.pending = heard
        return False

    def adopted(self, epoch: str, left: OtherSource | None) -> None:
        """The stream follows ``epoch`` now, the source it followed (``left``: its epoch,
        last heard, window, heartbeat and address; None: none) having gone silent or
        restarted. While a conflict is held, the source left becomes the other one if
        ``epoch`` was (it may come back: the hold runs from its last heartbeat); else
        ``epoch`` is simply no other source. A pending source taken (the followed one's
        restart, as far as anyone can tell) leaves the other source as it was."""
        if self.pending is not None and self.pending.epoch == epoch:
            self.pending = None
            return
        if self.other is None or self.other.epoch != epoch:
            return
        if self._since is not None and left is not None:
            self.other = left
        else:
            self._end()

    def expire(self, now: float) -> None:
        """Forget a conflict no longer held (past its hold, or never reported and the
        other source silent for its window), and an other source without a conflict once
        it has been silent for its liveness window (a restart's last beat)."""
        pending = self.pending
        if pending is not None and now - pending.heard > pending.window_s:
            self.pending = None  # silent for its window: never heard beside the followed one
        if self._left is not None and now - self._left.heard > self.hold_s:
            self._left = self._left_since = None
        other = self.other
        if other is None:
            return
        if self._since is not None:
            if not self.held(now):
                self._end()
        elif now - other.heard > other.window_s:
            self.other = None

    def _beside(self, heard: OtherSource, followed_url: str | None) -> bool:
        """``heard`` was heard beside the followed source: a conflict is found (if none
        was), and reported once it was found confirm_s ago (for a server that came back,
        since the overlap it left was found). True when reported now."""
        now = heard.heard
        if self._since is None:
            self._since = now
        if heard.url is not None and heard.url == followed_url:
            self._shared_url = True
        if self._reported or now - self._since < self.confirm_s:
            return False
        self._reported = True
        self._counters.id_conflicts += 1
        return True

    def _end(self) -> None:
        if self._since is not None and not self._reported:
            self._counters.id_conflicts_unconfirmed += 1  # a rollout's overlap, most likely
            self._left, self._left_since = self.other, self._since
        self.other, self.pending, self._since = None, None, None
        self._reported = self._shared_url = False
