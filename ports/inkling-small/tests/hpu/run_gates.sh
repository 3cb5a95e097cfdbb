#!/usr/bin/env bash
# The published page's gates for Inkling-Small on Gaudi 2, against a running OpenAI-compatible
# server. Meaningful only with the real model served on an 8-card Gaudi 2 node: on any other setup
# they test that setup. Every length comes from the server's max_model_len (/v1/models); a gate
# whose lengths do not fit says so and skips. With STAND_IN=1 (a random-weight stand-in such as
# `make gates` serves on CPU) the gates that need a trained model send their requests and report
# "needs a trained model" instead of judging the answers.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: run_gates.sh quick|long [--only GATE[,GATE...]] [--allow-skip GATE[,GATE...]] [--json]

Runs the page's gates against the server at $BASE_URL and prints a Gate | Result table (each row
says the lengths it used; skipped rows say why), then "N judged, N passed, K skipped (why)". A skip
is not a pass: name the gates whose skip you accept with --allow-skip (STAND_IN=1 accepts exactly
the rows that need a trained model).

  quick   preflight, smoke, greedy repeats, reasoning/streaming, needles 3K-131K, logprobs requests
          (vLLM's format: sampled token first, then the top k), prefix-cache hit vs cold
          (usage.prompt_tokens_details.cached_tokens), 16 concurrent 4K needles, over-long prompt
          -> HTTP 400, server log lines (one KV group, the pool line, decode window of 5 blocks)
  long    needles at 200K and 250K, three 100K prompts resident at once (each decodes until all three
          have started: the latest first token must come before the earliest end; no preemption), a
          250K prompt admitted beside DECODE_STREAMS decoding streams, whose rate while it prefills
          (from its admission to its first token; tokens counted from vLLM's running usage) must stay
          at or above the floor the long-prefill share promises: (k-1)(1-s) / ((k-1)(1-s) + k s) - 0.05
          of their rate before, for share s and k chunks (0.45 at the page's 0.5 and 123 chunks)

Environment:
  BASE_URL          server root, e.g. http://127.0.0.1:8000 (required)
  MODEL             served model name (default: the first /v1/models lists)
  STAND_IN          1 = the server serves a stand-in checkpoint (random weights)
  SERVER_LOG        path of the server's log, for the log gate (skipped when unset)
  COOKBOOK          the cookbook inside the image, for the preflight gate (default /opt/gaudi-cookbook)
  BLOCK_SIZE        the server's --block-size, for the prefix-cache gate (default 128)
  PREFIX_LOGPROB_TOLERANCE  the prefix-cache gate also requires a warm run's logprobs to equal the cold
                    run's within this, token by token (default unset: not judged; bf16 repeats differ;
                    make gates sets 1e-4 for its fp32 CPU server)
  MAX_NUM_BATCHED_TOKENS  the server's --max-num-batched-tokens, for the three-resident prompts'
                    room and the long prompt's chunks (default 2048)
  VLLM_LONG_PREFILL_SHARE, VLLM_LONG_PREFILL_MIN_TOKENS   the server's long-prefill share and
                    threshold, as the page exports them (default 0.5, 32768: the page's; a prompt under
                    the threshold is not judged against the share)
  LOGPROB_REQUESTS  logprobs requests (default 200)
  DECODE_STREAMS    streams beside the long prompt (default 15: --max-num-seqs 16 less one)
  STREAM_WARMUP_S, STREAM_WINDOW_S   seconds before measuring the streams, and measured (30, 30)
  ADMIT_TIMEOUT_S   the long prompt not running beside the streams by then: it queued, fail (120)
  LONG_PREFILL_TOLERANCE  noise allowed under the share's floor (default 0.05)
  GATE_TIMEOUT      seconds per request (default 900)

Exit codes: 0 every gate was judged and passed, or skipped where accepted; 1 a gate failed; 2 usage
error; 3 the server is unreachable; 4 no gate failed but one skipped that was not accepted.
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
    --only|--allow-skip)
      if [ $# -lt 2 ]; then echo "error: $1 needs a comma-separated list of gate names" >&2; exit 2; fi
      extra+=("$1" "$2"); shift ;;
    *) echo "error: unknown argument '$1' (expected quick, long, --only, --allow-skip, --json or --help)" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$mode" ]; then echo "error: expected a mode, quick or long" >&2; usage >&2; exit 2; fi
if [ -z "${BASE_URL:-}" ]; then echo "error: BASE_URL is not set (e.g. BASE_URL=http://127.0.0.1:8000)" >&2; exit 2; fi
exec python3 "$here/gates.py" "$mode" "${extra[@]}"
