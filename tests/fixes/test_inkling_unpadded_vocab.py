"""inkling-unpadded-vocab: vLLM 0.30.0's InklingModelConfig drops unpadded_vocab_size when the config also
states padded_vocab_size, as the published Inkling-Small config.json does.

Config (the sdist's class, read by vLLM's own get_config from a folder holding the published config.json):
pristine says vocab_size 201,024 (the padded rows), patched 200,058; a config without padded_vocab_size reads
200,058 on both.

Served (vLLM's CPU build, the port's model, every other fix of the profile applied): a tiny checkpoint whose
config has the published shape and whose 24 padding rows' logits beat every real token's
(tools/tiny_model.py --winning-padding). The pristine server is the same venv with the sdist's configs.py in an
overlay of its vllm package: a greedy request returns padding ids. Patched: never, greedy or in 400 seeded
draws at temperature 1.5; top-20 logprobs list none; logit_bias, allowed_token_ids or stop_token_ids naming
one get HTTP 400, and the server serves on.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cookbook.api import patched_copy
from tools import cpu_server

REPO = Path(__file__).resolve().parents[2]
PUBLISHED_CONFIG = REPO / "ports" / "inkling-small" / "configs" / "inkling-small" / "config.json"
CONFIG_FILE = "vllm/models/inkling/configs.py"
PADDING = 24          # the tiny checkpoint's padding rows: ids VOCAB_ROWS - PADDING .. VOCAB_ROWS - 1
SAMPLED_DRAWS = 400


@pytest.fixture(scope="module")
def trees(vllm_src, tmp_path_factory):
    dest = tmp_path_factory.mktemp("inkling-unpadded-vocab")
    return {"pristine": vllm_src, "patched": patched_copy(vllm_src, "vllm", ["inkling-unpadded-vocab"], dest)}


def vocab_read_by_vllm(tree: Path, config: dict, folder: Path) -> dict:
    """vocab_size, padded_vocab_size and unpadded_vocab_size of vLLM's config object for `config` (get_config on
    a folder holding it as config.json, with `tree`'s vLLM), and what get_vocab_size() reads (the text config's)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    code = ("import json, sys; from vllm.transformers_utils.config import get_config; "
            "c = get_config(sys.argv[1], trust_remote_code=False); t = c.get_text_config(); "
            "print(json.dumps({k: getattr(t, k) for k in ('vocab_size', 'padded_vocab_size', 'unpadded_vocab_size')}"
            " | {'class': type(c).__name__}))")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_published_config_keeps_its_unpadded_vocabulary(trees, tmp_path):
    published = json.loads(PUBLISHED_CONFIG.read_text())
    assert (published["vocab_size"], published["padded_vocab_size"], published["unpadded_vocab_size"]) == (
        201024, 201024, 200058)
    pristine = vocab_read_by_vllm(trees["pristine"], published, tmp_path / "pristine")
    patched = vocab_read_by_vllm(trees["patched"], published, tmp_path / "patched")
    assert pristine["class"] == patched["class"] == "InklingModelConfig", pristine
    # the bug: the sampler would be handed 201,024 logits, 966 of them for ids with no token
    assert (pristine["vocab_size"], pristine["padded_vocab_size"], pristine["unpadded_vocab_size"]) == (
        201024, 201024, 201024), pristine
    assert (patched["vocab_size"], patched["padded_vocab_size"], patched["unpadded_vocab_size"]) == (
        200058, 201024, 200058), patched


@pytest.mark.parametrize("name", ["pristine", "patched"])
def test_configs_without_the_padded_size_read_as_before(trees, tmp_path, name):
    published = json.loads(PUBLISHED_CONFIG.read_text())
    unstated = {k: v for k, v in published.items() if k != "padded_vocab_size"}
    got = vocab_read_by_vllm(trees[name], unstated, tmp_path / "unstated")
    assert (got["vocab_size"], got["padded_vocab_size"], got["unpadded_vocab_size"]) == (200058, 201024, 200058), got
    # the tiny checkpoints' shape: vocab_size already the unpadded one beside the padded rows
    tiny = dict(published, vocab_size=1023, padded_vocab_size=1024, unpadded_vocab_size=1023)
    got = vocab_read_by_vllm(trees[name], tiny, tmp_path / "tiny")
    assert (got["vocab_size"], got["padded_vocab_size"], got["unpadded_vocab_size"]) == (1023, 1024, 1023), got


# --- served ------------------------------------------------------------------------------------------------
def pristine_overlay(site_packages: Path, vllm_src: Path, dest: Path) -> Path:
    """A folder whose `vllm` is the venv's (hard links, every other fix applied) with the sdist's configs.py:
    first on the server's PYTHONPATH, it is the vLLM the server imports."""
    package = dest / "vllm"
    try:
        shutil.copytree(site_packages / "vllm", package, copy_function=os.link,
                        ignore=shutil.ignore_patterns("__pycache__"))
    except OSError:      # another file system: copies
        shutil.rmtree(package, ignore_errors=True)
        shutil.copytree(site_packages / "vllm", package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "models" / "inkling" / "configs.py").unlink()
    shutil.copyfile(vllm_src / CONFIG_FILE, package / "models" / "inkling" / "configs.py")
    return dest


def completion(server: cpu_server.CpuServer, **params) -> tuple[int, dict]:
    body = {"model": server.served_model, "prompt": "The committee reviewed the quarterly figures",
            "return_tokens_as_token_ids": True, **params}
    request = urllib.request.Request(server.base_url + "/v1/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def token_ids(answer: dict) -> list[int]:
    return [int(t.split(":", 1)[1]) for t in answer["choices"][0]["logprobs"]["tokens"]]


def top_logprob_ids(answer: dict) -> set[int]:
    return {int(t.split(":", 1)[1]) for top in answer["choices"][0]["logprobs"]["top_logprobs"] for t in top}


def ask(server: cpu_server.CpuServer, first_padding_id: int) -> dict:
    """Everything the test judges of one server, asked while it runs."""
    greedy = completion(server, max_tokens=16, temperature=0, logprobs=20, ignore_eos=True)
    sampled = completion(server, max_tokens=SAMPLED_DRAWS, temperature=1.5, seed=7, logprobs=20, ignore_eos=True)
    refused = {name: completion(server, max_tokens=4, **{name: value}) for name, value in (
        ("logit_bias", {str(first_padding_id): 5}), ("allowed_token_ids", [first_padding_id]),
        ("stop_token_ids", [first_padding_id]))}
    after = completion(server, max_tokens=4, temperature=0)
    return {"greedy": greedy, "sampled": sampled, "refused": refused, "after": after,
            "log": server.log.read_text(errors="replace")}


def served_test(test):
    """A test of the two servers: marked as starting a CPU server, slow, and given their start-up time."""
    for mark in (pytest.mark.server, pytest.mark.slow, pytest.mark.timeout(1800)):
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def served(vllm_src, tmp_path_factory):
    """{"pristine": ask(...), "patched": ask(...)} and the first padding id, one server at a time."""
    sys.path.insert(0, str(REPO / "ports" / "inkling-small" / "tests" / "cpu"))
    from cpu_server_helpers import server_venv

    venv = server_venv()
    cpu_server.patch_vllm(venv)        # the profile, this fix included
    plugin = cpu_server.port_install(venv)
    model = cpu_server.tiny_model(venv, plugin, winning_padding=PADDING)
    config = json.loads((model / "config.json").read_text())
    first_padding_id = config["unpadded_vocab_size"]
    assert config["vocab_size"] == config["padded_vocab_size"] == first_padding_id + PADDING, config
    scratch = tmp_path_factory.mktemp("served-unpadded-vocab")
    overlay = pristine_overlay(cpu_server.site_packages(venv), vllm_src, scratch / "pristine-vllm")
    answers = {}
    for name, env in (("pristine", {"PYTHONPATH": str(overlay)}), ("patched", {})):
        with cpu_server.CpuServer(venv, model, scratch / f"{name}.log", env=env, plugin_path=plugin) as server:
            answers[name] = ask(server, first_padding_id)
    return answers, first_padding_id


@served_test
def test_the_pristine_server_samples_padding_ids(served):
    answers, first_padding_id = served
    pristine = answers["pristine"]
    assert "logits: 1024 ids of 1024 head rows" in pristine["log"], pristine["log"][-3000:]
    status, greedy = pristine["greedy"]
    assert status == 200, greedy
    assert all(t >= first_padding_id for t in token_ids(greedy)), token_ids(greedy)     # the bug
    # and a request naming a padding id is taken
    assert all(status == 200 for status, _ in pristine["refused"].values()), pristine["refused"]


@served_test
def test_the_patched_server_never_samples_a_padding_id(served):
    answers, first_padding_id = served
    patched = answers["patched"]
    assert f"logits: {first_padding_id} ids of 1024 head rows (the padding trimmed)" in patched["log"], \
        patched["log"][-3000:]
    for kind in ("greedy", "sampled"):
        status, answer = patched[kind]
        assert status == 200, (kind, answer)
        ids = token_ids(answer)
        assert ids and max(ids) < first_padding_id, (kind, ids)
        listed = top_logprob_ids(answer)
        assert len(listed) >= 20 and max(listed) < first_padding_id, (kind, sorted(listed)[-5:])
    assert len(token_ids(patched["sampled"][1])) == SAMPLED_DRAWS
    assert len(set(token_ids(patched["sampled"][1]))) > 50     # sampled, not a repeated argmax
    for name, (status, answer) in patched["refused"].items():
        assert status == 400, (name, status, answer)
        assert str(first_padding_id) in json.dumps(answer), (name, answer)
    assert patched["after"][0] == 200, patched["after"]
