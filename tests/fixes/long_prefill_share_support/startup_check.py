"""Start-up behaviour of the long-prefill-share variables in one vLLM tree.

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=<tree>:<sdist> python startup_check.py '<json cases>'

cases: a list of {variable: value} dicts. For each case the variables are set (all three
cleared first), then: vLLM's own unknown-variable check (`envs.validate_environ(True)`,
which raises on unregistered VLLM_* variables) and the real Scheduler's construction
(`create_scheduler` from the sdist's tests). Prints one JSON list (last line of stdout):
per case {"validate_environ": "ok" | error text, "scheduler": "ok" | error text}.
"""

from __future__ import annotations

import json
import os
import sys

from scenario import make_model_dir

VARIABLES = ("VLLM_LONG_PREFILL_SHARE", "VLLM_LONG_PREFILL_MIN_TOKENS",
             "VLLM_LONG_PREFILL_SHARE_ASYNC")


def outcome(action) -> str:
    try:
        action()
    except Exception as exc:  # the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def main(cases: list[dict[str, str]]) -> list[dict[str, str]]:
    import vllm.envs as envs
    from tests.v1.core.utils import create_scheduler

    model_dir = make_model_dir()
    results = []
    for case in cases:
        for name in VARIABLES:
            os.environ.pop(name, None)
        os.environ.update(case)
        results.append({
            "validate_environ": outcome(lambda: envs.validate_environ(True)),
            "scheduler": outcome(lambda: create_scheduler(
                model=model_dir, skip_tokenizer_init=True, max_num_seqs=32,
                max_num_batched_tokens=2048, max_model_len=262144, block_size=128,
                num_blocks=4096)),
        })
    return results


if __name__ == "__main__":
    sys.stdout.write("\n" + json.dumps(main(json.loads(sys.argv[1]))) + "\n")
