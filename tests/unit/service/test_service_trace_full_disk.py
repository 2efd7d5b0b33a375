"""The traffic recorder on a full disk: a real file size limit (RLIMIT_FSIZE, set in a
child process so the test run keeps its own) makes the recorder's writes fail part way,
as a full disk does. The file must never hold half a line or lines counted as dropped,
and closing must not raise into the router's shutdown."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = r'''
import asyncio, json, resource, signal, sys
from pathlib import Path
from kvhint.router.service.trace_recorder import TraceRecorder, TracedRequest
from kvhint.router.sim.trace import load_trace

drops = {}

def drop(what, n):
    drops[what] = drops.get(what, 0) + n

def request(i):
    return TracedRequest(tenant="default", session_id=f"s{i}", prompt_tokens=64,
                         block_hashes=tuple(range(1000 + 4 * i, 1004 + 4 * i)), block_size=16,
                         output_tokens=3, finish_reason="stop", tool_names=(), end=False)

async def main():
    recorder = TraceRecorder(Path(sys.argv[1]), drop, stall_s=60)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    for i in range(3):
        recorder.finished(recorder.arrived(), request(i))
    await recorder.flush()
    size = recorder.path.stat().st_size
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 60, hard))  # the disk fills up
    for i in range(3, 6):
        recorder.finished(recorder.arrived(), request(i))
    await recorder.flush()
    after_full = recorder.path.read_bytes()
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # space again
    for i in range(6, 8):
        recorder.finished(recorder.arrived(), request(i))
    await recorder.close()
    trace = load_trace(recorder.path, block_size=16)
    print(json.dumps({"written": recorder.written, "drops": drops,
                      "size_before": size, "size_after_full": len(after_full),
                      "sessions": [r.session_id for r in trace.requests]}))

asyncio.run(main())
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE semantics")
def test_a_write_the_disk_refuses_leaves_whole_lines_and_counts_match(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["size_after_full"] == result["size_before"]  # the partial batch undone
    assert result["drops"] == {"trace_write_error": 3}
    assert result["written"] == 5
    assert result["sessions"] == ["s0", "s1", "s2", "s6", "s7"]
