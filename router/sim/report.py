"""Presenting simulation results: table, JSON lines, plot; written atomically."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvhint.router.sim.results import PolicyResult, ReferenceResult, percentile


def table(results: Sequence[PolicyResult], references: Sequence[ReferenceResult]) -> str:
    header = (f"{'policy':<17}{'hit':>8}{'G1':>8}{'G2':>8}{'recomputed':>15}"
              f"{'balance':>9}{'ttft p50':>10}{'ttft p99':>10}  hints")
    lines = [header, "-" * len(header)]
    for r in results:
        total = r.rate(r.g1_hit_tokens + r.g2_hit_tokens)
        hints = ", ".join(
            f"{action.removeprefix('kv.')} {counts.get('sent', 0)}"
            + "".join(f" {s[0]}{n}" for s, n in sorted(counts.items()) if s != "sent")
            for action, counts in r.hints_by_action().items()
        ) or "-"
        lines.append(
            f"{r.policy:<17}{total:>8.2%}{r.rate(r.g1_hit_tokens):>8.2%}"
            f"{r.rate(r.g2_hit_tokens):>8.2%}{r.recomputed_tokens:>15,}{r.load_balance:>9.3f}"
            f"{percentile(r.ttfts_s, 50):>9.3f}s{percentile(r.ttfts_s, 99):>9.3f}s  {hints}"
        )
    for ref in references:
        rate = ref.hit_tokens / ref.prompt_tokens if ref.prompt_tokens else 0.0
        cap = f" @{ref.capacity_blocks:,} blocks" if ref.capacity_blocks else ""
        lines.append(f"{'(' + ref.name + ')':<17}{rate:>8.2%}{'':>16}{ref.recomputed_tokens:>15,}"
                     f"   reference{cap}")
    lines.append("hints: sent, then outcomes a=accepted c=clipped d=deferred m=missing r=rejected")
    for r in results:
        if r.released_blocks:
            released = ", ".join(f"{action.removeprefix('kv.')} {reason} {n:,}"
                                 for (action, reason), n in sorted(r.released_blocks.items()))
            lines.append(f"{r.policy}: blocks workers let go of accepted holds unasked: "
                         f"{released}")
        if r.preemptions:
            lines.append(f"{r.policy}: vLLM preempted {r.preemptions:,} running requests for "
                         "room (scheduler engine; they were recomputed)")
        if r.dropped_requests:
            # Not in the rates above (the references do count them): say so, not hide it.
            lines.append(f"{r.policy}: {r.dropped_requests:,} of {r.requests:,} requests dropped "
                         "(longer than max_model_len, or larger than a worker's pool with "
                         "its holds); the rows above count only the rest")
    return "\n".join(lines)


def json_lines(results: Sequence[PolicyResult], references: Sequence[ReferenceResult],
               extra: dict[str, object] | None = None) -> str:
    rows = [r.to_json() for r in results] + [ref.to_json() for ref in references]
    if extra:
        rows = [{**row, **extra} for row in rows]
    return "".join(json.dumps(row, sort_keys=False) + "\n" for row in rows)


def write_atomic(path: Path, data: bytes) -> None:
    """Write the whole file or nothing (temp file in the same folder, then rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        # mkstemp makes the file 0600; give it the mode a plain open() would (umask).
        _plain_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def plot_target_problem(path: Path) -> str | None:
    """Why :func:`plot` could not write ``path``, checked before a run (so a bad target
    costs nothing), or None: its folder must exist and be writable, it must not be a
    folder, and its suffix must name a format matplotlib writes (none: PNG)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return "matplotlib is not installed (the sim extra: pip install 'kvhint[sim]')"
    path = Path(path)
    folder = path.parent
    if not folder.is_dir():
        return f"folder {folder} does not exist"
    if path.is_dir():
        return f"{path} is a directory; give a file name such as {path / 'hits.png'}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"folder {folder} is not writable"
    suffix = path.suffix.lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        return (f"{path}: matplotlib cannot write .{suffix} files (it writes "
                f"{', '.join('.' + f for f in sorted(formats))})")
    return None


def plot(path: Path, results: Sequence[PolicyResult], references: Sequence[ReferenceResult],
         title: str) -> None:
    """Cumulative token hit rate (G1+G2) over trace time, one line per policy; reference
    lines dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5), dpi=120)
    for r in results:
        xs, ys = [], []
        prompt = hits = 0
        for point in r.timeline:
            prompt += point.prompt_tokens
            hits += point.hit_tokens
            if prompt:
                xs.append((point.start_s + 0.5 * r.timeline_width_s) / 60.0)
                ys.append(100.0 * hits / prompt)
        ax.plot(xs, ys, label=r.policy, linewidth=1.8)
    for ref in references:
        rate = 100.0 * ref.hit_tokens / ref.prompt_tokens if ref.prompt_tokens else 0.0
        ax.axhline(rate, linestyle="--", linewidth=1.0, color="grey")
        ax.annotate(f"{ref.name} {rate:.1f}%", xy=(0.0, rate), xytext=(4, 3),
                    textcoords="offset points", color="grey", fontsize=8,
                    xycoords=("axes fraction", "data"))
    ax.set_xlabel("trace time (min)")
    ax.set_ylabel("prompt tokens served from cache, cumulative (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    suffix = Path(path).suffix.lstrip(".").lower() or "png"
    fd, tmp = tempfile.mkstemp(prefix=f".{Path(path).name}.", suffix=f".{suffix}",
                               dir=Path(path).parent or ".")
    os.close(fd)
    try:
        fig.savefig(tmp, format=suffix)
        _plain_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)


def _plain_mode(path: str) -> None:
    """mkstemp makes files 0600; give ours the mode a plain open() would (the umask's)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
