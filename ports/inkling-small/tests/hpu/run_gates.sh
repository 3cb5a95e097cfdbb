#!/usr/bin/env bash
# The published page's gates for Inkling-Small on Gaudi 2, against a running OpenAI-compatible
# server. Meaningful only with the real model served on an 8-card Gaudi 2 node: on any other
# setup the needles, logprobs and timing gates test that setup, not the port.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: run_gates.sh quick|long [--only GATE[,GATE...]] [--json]

Runs the page's gates against the server at $BASE_URL and prints a Gate | Result table.

  quick   preflight, smoke, greedy/reasoning/streaming, needles 3K-131K, 200 logprobs requests,
          prefix-cache hit vs cold, 16 concurrent 4K needles, over-long prompt -> HTTP 400,
          server log lines (one KV group, the pool line, decode window of 5 blocks)
  long    needles at 200K and 250K, three 100K prompts resident at once (no preemption),
          a 250K prompt while 16 streams decode (tok/s before and during)

Environment:
  BASE_URL        server root, e.g. http://127.0.0.1:8000 (required)
  MODEL           served model name (default thinkingmachines/Inkling-Small)
  MAX_MODEL_LEN   the server's --max-model-len (default 262144)
  SERVER_LOG      path of the server's log, for the log gate (skipped when unset)
  PREFLIGHT_TESTS 1 = also run the port's CPU tests with this python (inside the image)
  GATE_TIMEOUT    seconds per request (default 900)

Exit codes: 0 every gate passed (skipped gates say why), 1 a gate failed, 2 usage error,
3 the server is unreachable.
EOF
}

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mode=""
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    quick|long)
      if [ -n "$mode" ]; then echo "error: give one mode, found '$mode' and '$1'" >&2; exit 2; fi
      mode="$1" ;;
    --json) extra+=(--json) ;;
    --only)
      if [ $# -lt 2 ]; then echo "error: --only needs a comma-separated list of gate names" >&2; exit 2; fi
      extra+=(--only "$2"); shift ;;
    *) echo "error: unknown argument '$1' (expected quick, long, --only, --json or --help)" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$mode" ]; then echo "error: expected a mode, quick or long" >&2; usage >&2; exit 2; fi
if [ -z "${BASE_URL:-}" ]; then echo "error: BASE_URL is not set (e.g. BASE_URL=http://127.0.0.1:8000)" >&2; exit 2; fi
exec python3 "$here/gates.py" "$mode" "${extra[@]}"
