"""Learned statistics the hint planner predicts from: plain data, persisted by the caller.

- Gap histograms: how long a session stays away between a response and its next turn,
  per *gap kind* (a tool name, or :data:`USER_GAP` for a response that ended with
  ``stop``) and per session depth bucket. Heavy-tailed, so the histogram is over
  log-spaced buckets (0.25 s x sqrt(2)^k) and gives quantiles and survival directly.
- Return counts: per depth bucket, how many turns ended and how many of those were
  followed by another turn (DESIGN §6: a first turn continues ~30%, a sixth ~75%).

Counts decay (``decay`` per observation, i.e. an effective window of ~1/(1-decay)
observations per key) so the statistics follow a drifting workload.

The planner only *reads* a :class:`LearnedStats`; it returns observations
(:class:`GapObserved`, :class:`ReturnObserved`) that the caller applies with
:meth:`LearnedStats.apply` and persists with :meth:`LearnedStats.to_dict` /
:meth:`LearnedStats.from_dict` (JSON-safe). No I/O here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

USER_GAP = "@user"
"""Gap kind for a response that ended with ``stop`` (the user, not a tool, comes back)."""

ANY_TOOL = "@tool"
"""Pooled gap kind over every tool name (fallback for a tool not seen yet)."""

# A user gap is refined by the session's tempo, its previous user gap: in the Mooncake
# conversation trace a session whose last gap was under a minute comes back within five
# minutes about twice as often as one whose last gap was over five minutes. Each tempo
# kind learns its own gaps and returns and falls back to the pooled USER_GAP.
_TEMPO_LIMITS_S = ((60.0, "fast"), (300.0, "mid"))
# ... and by whether the turn brought a long user message (a pasted document): there a
# second turn whose prompt grew by 3,000+ tokens comes back within ten minutes less than
# half as often as one that added a short message (0.20 vs 0.48; the threshold is
# PlannerConfig.long_message_tokens).
LONG_MESSAGE = "long"


def user_gap_kind(previous_gap_s: float | None, long_message: bool = False) -> str:
    """The gap kind of a ``stop`` response, given the session's previous user gap (None:
    no earlier gap) and whether the turn added a long user message. Neither: the pooled
    :data:`USER_GAP`."""
    parts = [USER_GAP]
    if previous_gap_s is not None:
        parts.append(next((name for limit, name in _TEMPO_LIMITS_S if previous_gap_s < limit),
                          "slow"))
    if long_message:
        parts.append(LONG_MESSAGE)
    return ":".join(parts)


def is_user_kind(kind: str) -> bool:
    return kind == USER_GAP or kind.startswith(USER_GAP + ":")

STATS_VERSION = 1

# Tool names come from the model's output: a fleet may see any number of them, of any
# length. The bounds are per LearnedStats, i.e. per tenant (tenant_stats.TenantStats), so
# one tenant's names never use another's room. Past these bounds a tool's gaps are learnt only under ANY_TOOL (which every
# tool name also feeds, and predictions fall back to), so the statistics, and the store
# row they are saved in, stay bounded.
MAX_GAP_KEYS = 4096
MAX_KIND_CHARS = 128
_BASE_S = 0.25
_STEP = math.sqrt(2.0)
_BUCKETS = 44  # 0.25 s .. ~0.25 * 2**21.5 s (about 2 months)
_MAX_DEPTH_BUCKET = 8
# Memoised hit densities kept between observations (idle reviews use many idle times).
_DENSITY_MEMO_MAX = 4096


def depth_bucket(depth: int) -> int:
    """Depth (turns completed, >= 1) -> bucket 1..8; 8 means "8 or more"."""
    return max(1, min(depth, _MAX_DEPTH_BUCKET))


def _bucket_of(seconds: float) -> int:
    if seconds <= _BASE_S:
        return 0
    return min(int(math.log(seconds / _BASE_S, _STEP)) + 1, _BUCKETS - 1)


def _bucket_upper(index: int) -> float:
    return _BASE_S * _STEP**index


# _bucket_upper of every bucket, the same expression evaluated once (a constant, read by
# GapHistogram.survival: hit densities evaluate it ~13 times per idle review).
_UPPERS = tuple(_BASE_S * _STEP**index for index in range(_BUCKETS))


@dataclass(frozen=True, slots=True)
class GapObserved:
    """A session came back after ``seconds`` from a response of gap kind ``kind``."""

    kind: str
    depth: int
    seconds: float


@dataclass(frozen=True, slots=True)
class ReturnObserved:
    """A response at ``depth`` of gap kind ``kind`` was (``returned``) or was not
    followed by another turn. Tool kinds are pooled (:data:`ANY_TOOL`) for returns."""

    depth: int
    returned: bool
    kind: str = USER_GAP


@dataclass(frozen=True, slots=True)
class CompletionReadObserved:
    """A session's next turn, routed to the worker that still held its whole previous
    prompt, did (``read``) or did not read KV beyond that prompt, i.e. the blocks of the
    previous response. Whether it does is the workload's: a chat template that renders
    an assistant message back into the same tokens the model produced lets the next turn
    read them; one that re-renders tool calls or strips reasoning, or a trace whose
    block ids say the output is not reused (the Mooncake format), does not."""

    read: bool


Observation = GapObserved | ReturnObserved | CompletionReadObserved


@dataclass(slots=True)
class GapHistogram:
    counts: list[float] = field(default_factory=lambda: [0.0] * _BUCKETS)
    total: float = 0.0

    def add(self, seconds: float, decay: float) -> None:
        if decay < 1.0:
            self.counts = [c * decay for c in self.counts]
            self.total *= decay
        self.counts[_bucket_of(seconds)] += 1.0
        self.total += 1.0

    def quantile(self, q: float) -> float:
        """Upper edge of the bucket holding quantile ``q`` (conservative)."""
        target = q * self.total
        running = 0.0
        for index, count in enumerate(self.counts):
            running += count
            if running >= target and count > 0:
                return _bucket_upper(index)
        return _bucket_upper(_BUCKETS - 1)

    def survival(self, seconds: float) -> float:
        """P(gap > seconds), interpolated inside the bucket on a log scale."""
        if self.total <= 0:
            return 1.0
        index = _bucket_of(seconds)
        above = sum(self.counts[index + 1 :])
        lower = _UPPERS[index - 1] if index > 0 else 0.0
        upper = _UPPERS[index]
        if index == 0 or seconds <= lower:
            frac_above = 1.0 if index > 0 else max(0.0, 1.0 - seconds / upper)
        else:
            frac_above = 1.0 - math.log(seconds / lower) / math.log(upper / lower)
        return min(1.0, (above + self.counts[index] * frac_above) / self.total)


@dataclass(slots=True)
class ReturnCount:
    finished: float = 0.0
    returned: float = 0.0


@dataclass(slots=True)
class LearnedStats:
    """Per-(gap kind, depth bucket) gap histograms and per-depth return counts.

    Predictions fall back from the most specific key to pooled ones, and finally to the
    configured priors, so a fresh router still plans sensibly.
    """

    gaps: dict[str, GapHistogram] = field(default_factory=dict)
    # key "<USER_GAP|ANY_TOOL>|<depth bucket>"
    returns: dict[str, ReturnCount] = field(default_factory=dict)
    decay: float = 0.999
    min_samples: float = 8.0
    # Priors: return probability by depth (DESIGN §6 figures) and a gap median.
    prior_return: tuple[float, ...] = (0.30, 0.45, 0.55, 0.62, 0.68, 0.72, 0.74, 0.75)
    prior_tool_return: float = 0.95
    prior_strength: float = 10.0
    prior_gap_s: float = 60.0
    tail_prior_weight: float = 1.0
    # Next turns seen reading (``returned``) the previous response's KV, out of those
    # observed (``finished``); the prior assumes they do (vLLM caches output blocks).
    completion_reads: ReturnCount = field(default_factory=ReturnCount)
    prior_completion_read: float = 1.0
    # hit_density's results since the last apply(), by (kind, depth bucket, idle,
    # horizon): a pure function of the statistics and those. The shared-prefix scan values
    # every in-flight session at idle 0 every 10 s, which without this cost ~0.2 ms each
    # (about a second for 5,000 sessions, on the live router's event loop).
    _densities: dict[tuple[str, int, float, float], float] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    # -- reading -------------------------------------------------------------------------

    def _gap_histogram(self, kind: str, depth: int) -> GapHistogram | None:
        bucket = depth_bucket(depth)
        pooled = USER_GAP if is_user_kind(kind) else ANY_TOOL
        for key in (f"{kind}|{bucket}", f"{kind}|*", f"{pooled}|{bucket}", f"{pooled}|*"):
            hist = self.gaps.get(key)
            if hist is not None and hist.total >= self.min_samples:
                return hist
        return None

    def gap_quantile(self, kind: str, depth: int, q: float) -> float:
        """Predicted gap (seconds) not exceeded with probability ``q``."""
        hist = self._gap_histogram(kind, depth)
        if hist is None:
            # Log-normal-ish prior: median prior_gap_s, heavy tail.
            return self.prior_gap_s * math.exp(1.5 * _normal_ppf(q))
        return hist.quantile(q)

    def gap_survival(self, kind: str, depth: int, seconds: float) -> float:
        """P(gap > seconds | the session returns). The histogram is blended with a broad
        log-normal around its own median (weight ``tail_prior_weight`` observations), so
        the survival never drops to exactly 0 past the longest gap seen: a session that
        stays away longer than ever before is unlikely, not impossible, to come back."""
        return self._survival_curve(kind, depth)(seconds)

    def _survival_curve(self, kind: str, depth: int) -> Callable[[float], float]:
        """:meth:`gap_survival` for one (kind, depth), with the histogram lookup and its
        median done once (callers evaluate it at many times)."""
        hist = self._gap_histogram(kind, depth)
        if hist is None:
            prior_gap = self.prior_gap_s
            return lambda seconds: _lognormal_survival(seconds, prior_gap, 1.5)
        weight = self.tail_prior_weight
        total = hist.total
        median = hist.quantile(0.5)
        return lambda seconds: (total * hist.survival(seconds)
                                + weight * _lognormal_survival(seconds, median, 1.5)) / (
            total + weight)

    def return_probability(self, depth: int, kind: str = USER_GAP) -> float:
        """P(another turn follows a response at ``depth`` of gap ``kind``), smoothed
        toward the prior."""
        bucket = depth_bucket(depth)
        if kind != USER_GAP and is_user_kind(kind):
            prior = self.return_probability(depth, USER_GAP)  # the pooled user figure
        elif kind == USER_GAP:
            prior = self.prior_return[min(bucket, len(self.prior_return)) - 1]
        else:
            prior = self.prior_tool_return
        count = self.returns.get(f"{_return_class(kind)}|{bucket}")
        if count is None:
            return prior
        return (count.returned + prior * self.prior_strength) / (
            count.finished + self.prior_strength
        )

    def return_within(self, kind: str, depth: int, idle_s: float, horizon_s: float) -> float:
        """P(the session's next turn arrives within ``horizon_s`` from now, given it has
        been idle ``idle_s`` since its response at ``depth``): Bayes over "returns at all"
        and the gap distribution."""
        p = self.return_probability(depth, kind)
        survival = self._survival_curve(kind, depth)
        s_now = survival(idle_s)
        s_later = survival(idle_s + horizon_s)
        alive = p * s_now + (1.0 - p)
        if alive <= 0:
            return 0.0
        return p * max(s_now - s_later, 0.0) / alive

    def hit_density(self, kind: str, depth: int, idle_s: float, horizon_s: float) -> float:
        """Expected hits per second of cache occupancy for a session idle ``idle_s``
        (Beckmann et al.'s "hit density", LHD, NSDI'18): P(next turn within the horizon)
        over the expected time it still occupies the cache until that turn or the horizon,
        ``E[min(R, H)] = integral_0^H P(R > s) ds`` with the remaining time R drawn from
        the return-probability / gap-distribution mixture given the idle time so far."""
        key = (kind, depth_bucket(depth), idle_s, horizon_s)
        density = self._densities.get(key)
        if density is None:
            if len(self._densities) >= _DENSITY_MEMO_MAX:
                self._densities.clear()
            density = self._densities[key] = self._hit_density(kind, depth, idle_s, horizon_s)
        return density

    def _hit_density(self, kind: str, depth: int, idle_s: float, horizon_s: float) -> float:
        p = self.return_probability(depth, kind)
        survival = self._survival_curve(kind, depth)
        s_now = survival(idle_s)
        alive = p * s_now + (1.0 - p)
        if alive <= 0 or horizon_s <= 0:
            return 0.0
        hit = p * max(s_now - survival(idle_s + horizon_s), 0.0) / alive
        # Trapezoid over log-spaced points (the survival changes fastest early on).
        points = [0.0] + [horizon_s * 2.0 ** (-k) for k in range(10, -1, -1)]
        occupancy = 0.0
        previous_t, previous_v = 0.0, 1.0
        for t in points[1:]:
            value = (p * survival(idle_s + t) + (1.0 - p)) / alive
            occupancy += 0.5 * (value + previous_v) * (t - previous_t)
            previous_t, previous_v = t, value
        return hit / max(occupancy, 1e-9)

    def completion_read_probability(self) -> float:
        """P(a session's next turn reads the KV of its previous response), smoothed toward
        ``prior_completion_read`` with ``prior_strength`` observations' weight."""
        count = self.completion_reads
        return (count.returned + self.prior_completion_read * self.prior_strength) / (
            count.finished + self.prior_strength)

    # -- learning ------------------------------------------------------------------------

    def apply(self, observation: Observation) -> None:
        """Fold one observation in (the caller's job; the planner never mutates stats)."""
        self._densities.clear()
        if isinstance(observation, CompletionReadObserved):
            count = self.completion_reads
            count.finished = count.finished * self.decay + 1.0
            count.returned = count.returned * self.decay + (1.0 if observation.read else 0.0)
            return
        if isinstance(observation, GapObserved):
            bucket = depth_bucket(observation.depth)
            kind = observation.kind
            kinds = [kind] if self._learns_kind(kind, bucket) else []
            if kind != USER_GAP:
                kinds.append(USER_GAP if is_user_kind(kind) else ANY_TOOL)
            for kind in kinds:
                for key in (f"{kind}|{bucket}", f"{kind}|*"):
                    self.gaps.setdefault(key, GapHistogram()).add(observation.seconds, self.decay)
            return
        classes = {_return_class(observation.kind)}
        if is_user_kind(observation.kind):
            classes.add(USER_GAP)  # a tempo kind also feeds the pooled user counts
        for return_class in sorted(classes):
            key = f"{return_class}|{depth_bucket(observation.depth)}"
            count = self.returns.setdefault(key, ReturnCount())
            count.finished = count.finished * self.decay + 1.0
            count.returned = count.returned * self.decay + (
                1.0 if observation.returned else 0.0)

    def _learns_kind(self, kind: str, bucket: int) -> bool:
        """Whether ``kind``'s own histograms are kept (pooled and user kinds always; a
        tool name while under :data:`MAX_GAP_KEYS` and :data:`MAX_KIND_CHARS`)."""
        if kind == ANY_TOOL or is_user_kind(kind):
            return True
        if len(kind) > MAX_KIND_CHARS:
            return False
        known = f"{kind}|{bucket}" in self.gaps and f"{kind}|*" in self.gaps
        return known or len(self.gaps) + 2 <= MAX_GAP_KEYS

    # -- persistence ---------------------------------------------------------------------

    def to_dict(self) -> dict[str, object]:
        return {
            "version": STATS_VERSION,
            "decay": self.decay,
            "gaps": {k: {"counts": h.counts, "total": h.total} for k, h in self.gaps.items()},
            "returns": {k: [c.finished, c.returned] for k, c in self.returns.items()},
            "completion_reads": [self.completion_reads.finished,
                                 self.completion_reads.returned],
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> LearnedStats:
        """Inverse of :meth:`to_dict`; raises ValueError on a shape it does not know, and on
        values :meth:`apply` never makes: a count or total that is negative, NaN or
        infinite, a decay outside (0, 1]. Before, such a row (a hand edit, a restore from
        elsewhere) was taken, and a NaN made every retain priority computed from it raise."""
        if data.get("version") != STATS_VERSION:
            raise ValueError(f"learned stats: unsupported version {data.get('version')!r}")
        decay = float(data.get("decay", 0.999))  # type: ignore[arg-type]
        if not 0.0 < decay <= 1.0:  # NaN fails it too
            raise ValueError(f"learned stats: decay {decay!r} is not in (0, 1]")
        stats = cls(decay=decay)
        gaps = data.get("gaps", {})
        returns = data.get("returns", {})
        if not isinstance(gaps, dict) or not isinstance(returns, dict):
            raise ValueError("learned stats: gaps and returns must be objects")
        for key, raw in gaps.items():
            counts = _counts(raw["counts"], key)
            if len(counts) != _BUCKETS:
                raise ValueError(f"learned stats: gap histogram {key!r} has {len(counts)} buckets")
            (total,) = _counts([raw["total"]], key)
            stats.gaps[str(key)] = GapHistogram(counts, total)
        for key, pair in returns.items():
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError(f"learned stats: return count {key!r} is not [finished, "
                                 "returned]")
            stats.returns[str(key)] = ReturnCount(*_counts(pair, key))
        reads = data.get("completion_reads", [0.0, 0.0])  # absent before it was learnt
        if not isinstance(reads, list) or len(reads) != 2:
            raise ValueError("learned stats: completion_reads must be [observed, read]")
        stats.completion_reads = ReturnCount(*_counts(reads, "completion_reads"))
        return stats


def _counts(raw: Iterable[object], key: object) -> list[float]:
    """``raw`` as (decayed) counts: each finite and >= 0, else ValueError naming ``key``."""
    counts = [float(c) for c in raw]  # type: ignore[arg-type]
    if not all(math.isfinite(c) and c >= 0.0 for c in counts):
        raise ValueError(f"learned stats: {key!r} holds a count that is negative, NaN or "
                         "infinite")
    return counts


def _lognormal_survival(seconds: float, median_s: float, sigma: float) -> float:
    if seconds <= 0:
        return 1.0
    z = math.log(seconds / max(median_s, 1e-6)) / sigma
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def _return_class(kind: str) -> str:
    return kind if is_user_kind(kind) else ANY_TOOL


def _normal_ppf(q: float) -> float:
    """Inverse standard normal CDF (Acklam's rational approximation; |err| < 1e-8)."""
    q = min(max(q, 1e-9), 1 - 1e-9)
    a = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02,
         1.383577518672690e02, -3.066479806614716e01, 2.506628277459239e00)
    b = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02,
         6.680131188771972e01, -1.328068155288572e01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00,
         -2.549732539343734e00, 4.374664141464968e00, 2.938163982698783e00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00,
         3.754408661907416e00)
    low = 0.02425
    if q < low:
        r = math.sqrt(-2 * math.log(q))
        return (((((c[0] * r + c[1]) * r + c[2]) * r + c[3]) * r + c[4]) * r + c[5]) / (
            (((d[0] * r + d[1]) * r + d[2]) * r + d[3]) * r + 1
        )
    if q > 1 - low:
        return -_normal_ppf(1 - q)
    r = (q - 0.5) ** 2
    return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * (q - 0.5) / (
        ((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1
    )
