"""The pre-sharded layout: per tensor-parallel rank one file holding only that rank's slabs, written
from the port's name table (split_dims, write_presharded), with a manifest of sha256s to check
(verify_presharded); and the command line that makes and checks it, `python -m inkling_hpu.loader`."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

from inkling_hpu.checkpoint_names import template_regex
from inkling_hpu.loader.checkpoint import PRESHARDED_DIR, PRESHARDED_MANIFEST, TextCheckpoint
from inkling_hpu.loader.header import CheckpointError, TensorSpec
from inkling_hpu.model.weights import CHECKPOINT_TO_PORT


def split_dims(checkpoint: TextCheckpoint) -> dict[str, int | None]:
    """Each text tensor's tensor-parallel split dim from the model's name table (None: replicated)."""
    rules = [(template_regex(r.checkpoint), r.dim) for r in CHECKPOINT_TO_PORT]
    dims = {}
    for name in checkpoint.text:
        matched = [dim for pattern, dim in rules if pattern.match(name)]
        if len(matched) != 1:
            raise CheckpointError(f"{name}: expected one rule of the port's name table to match, found {len(matched)}")
        dims[name] = matched[0]
    return dims


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_presharded(checkpoint_dir: str | os.PathLike, world_size: int) -> Path:
    """Write <checkpoint>/presharded-tp<N>/: per rank one file with only its slabs (read by this
    loader's own rank reads), then a manifest with each file's sha256, the split dims and the
    source checkpoint's fingerprint. The manifest comes last, so a layout without one is unused."""
    from safetensors.torch import save_file

    checkpoint = TextCheckpoint(checkpoint_dir)
    directory = checkpoint.dir / PRESHARDED_DIR.format(world_size=world_size)
    (directory / PRESHARDED_MANIFEST).unlink(missing_ok=True)
    dims = split_dims(checkpoint)
    specs = [TensorSpec(name, None, shard_dim=dim) for name, dim in dims.items()]
    hashes = {}
    for rank in range(world_size):
        rank_dir = directory / f"rank-{rank}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        tensors = dict(checkpoint.load(specs, rank=rank, world_size=world_size))
        save_file(tensors, rank_dir / "model.safetensors.partial", metadata={"rank": str(rank)})
        del tensors
        os.replace(rank_dir / "model.safetensors.partial", rank_dir / "model.safetensors")
        hashes[f"rank-{rank}/model.safetensors"] = _sha256(rank_dir / "model.safetensors")
    manifest = {"world_size": world_size, "source": checkpoint.fingerprint(), "shard_dims": dims, "sha256": hashes}
    (directory / (PRESHARDED_MANIFEST + ".partial")).write_text(json.dumps(manifest, indent=1))
    os.replace(directory / (PRESHARDED_MANIFEST + ".partial"), directory / PRESHARDED_MANIFEST)
    return directory


def verify_presharded(directory: str | os.PathLike) -> None:
    """Each rank file's sha256 against the manifest; CheckpointError names the file, expected and found."""
    directory = Path(directory)
    manifest = json.loads((directory / PRESHARDED_MANIFEST).read_text())
    for name, expected in manifest["sha256"].items():
        found = _sha256(directory / name)
        if found != expected:
            raise CheckpointError(f"{directory / name}: sha256 expected {expected} (manifest), found {found}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inkling_hpu.loader",
                                     description="Pre-sharded layout of a checkpoint's text tensors, one file per TP rank.")
    sub = parser.add_subparsers(dest="command", required=True)
    presplit = sub.add_parser("presplit", help="write <checkpoint>/presharded-tp<N>/ and verify it")
    presplit.add_argument("checkpoint", type=Path)
    presplit.add_argument("--tp", type=int, required=True, help="tensor-parallel size")
    verify = sub.add_parser("verify", help="check a pre-sharded layout's files against its manifest")
    verify.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    try:
        directory = write_presharded(args.checkpoint, args.tp) if args.command == "presplit" else args.directory
        verify_presharded(directory)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{directory}: verified against {PRESHARDED_MANIFEST}")
    return 0
