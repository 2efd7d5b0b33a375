#!/usr/bin/env bash
# The simulator against live runs (BENCHMARKS.md, "The simulator against a live run"):
# every kept router recording that carries served TTFTs (ttft_ms) replayed on the fleet it
# was recorded on (2 vLLM CPU workers x 8,192 tokens: 256 blocks of 32; vLLM's CPU server
# defaults of 2,048 batched tokens and 128 sequences), with both engines, the decode time
# taken from the recording (median itl_ms) and the prefill rate fitted to its TTFT.
# Usage: tests/benchmarks/sim/replay_recorded.sh [OUT_DIR]   (from the repository root)
# Writes <recording>.<engine>.jsonl (one JSON object per policy) and .fit (the fit's lines).
set -euo pipefail
OUT=${1:-tests/benchmarks/sim/results/recorded}
KV=.venv/bin/kvhint
mkdir -p "$OUT"
for trace in tests/benchmarks/sim/recorded/*.jsonl; do
  grep -q '"ttft_ms"' "$trace" || continue  # recorded before answers carried their TTFT
  name=$(basename "$trace" .jsonl)
  for engine in fast scheduler; do
    "$KV" sim run --trace "$trace" --block-size 32 --workers 2 --gpu-blocks 256 \
        --router all --engine "$engine" --max-num-batched-tokens 2048 --max-num-seqs 128 \
        --prefill-tokens-per-s fit --json --no-progress \
        > "$OUT/$name.$engine.jsonl" 2> "$OUT/$name.$engine.log"
    grep '^\[sim\]' "$OUT/$name.$engine.log" > "$OUT/$name.$engine.fit"
    rm "$OUT/$name.$engine.log"
    echo "[replay] $name $engine: $(grep -o 'prefill [0-9,]* tokens/s[^(]*' "$OUT/$name.$engine.fit")" >&2
  done
done
