"""The committed trained tiny Inkling (checkpoints/trained-tiny-inkling) is what the command its training.json
records writes: a two-step run of tools/train_tiny_inkling.py with the same seed gives the same config.json,
tokenizer and chat template, and the same tensor names, shapes and dtypes in the same files (only the
trained values differ). And it stays small enough to commit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRAINED = REPO / "checkpoints" / "trained-tiny-inkling"
MAX_BYTES = 16 * 2**20

pytestmark = [pytest.mark.timeout(900)]


def tensor_layout(folder: Path) -> dict[str, dict[str, tuple]]:
    """file -> tensor name -> (dtype, shape), read from the safetensors headers."""
    from safetensors import safe_open

    layout = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            layout[path.name] = {name: (str(f.get_slice(name).get_dtype()), tuple(f.get_slice(name).get_shape()))
                                 for name in f.keys()}
    return layout


def test_committed_checkpoint_is_what_its_command_writes(tmp_path):
    record = json.loads((TRAINED / "training.json").read_text())
    assert record["command"].startswith("python -m tools.train_tiny_inkling OUT --seed "), record["command"]
    out = tmp_path / "again"
    subprocess.run([sys.executable, "-m", "tools.train_tiny_inkling", str(out), "--seed", str(record["seed"]),
                    "--steps-short", "1", "--steps-long", "1", "--held-out", "0"], cwd=REPO, check=True,
                   capture_output=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_text() == (TRAINED / name).read_text(), f"{name} differs from the command's"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert index == json.loads((TRAINED / "model.safetensors.index.json").read_text())["weight_map"]
    assert tensor_layout(out) == tensor_layout(TRAINED)
    again = json.loads((out / "training.json").read_text())
    assert (again["config"], again["data"]) == (record["config"], record["data"])


def test_committed_checkpoint_is_small_and_says_how_it_scores():
    size = sum(path.stat().st_size for path in TRAINED.iterdir())
    assert size <= MAX_BYTES, f"{size} bytes: expected at most {MAX_BYTES}"
    record = json.loads((TRAINED / "training.json").read_text())
    assert record["trained"] and record["training_minutes"] <= 30, record["training_minutes"]
    assert set(record["held_out"]["needle_recall"]) and set(record["held_out"]["tasks"]) == {
        "addition", "tool call", "JSON", "thinking"}
    assert not (TRAINED / "stand-in.json").exists()
