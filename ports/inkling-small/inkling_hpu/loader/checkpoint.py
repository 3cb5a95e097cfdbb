"""A checkpoint directory's text tensors, located by their headers alone (TextCheckpoint), and their
loading: planned per tensor (reads.py), read file by file (file_reader.py), or from the
checkpoint's pre-sharded layout for the rank when there is one (written by presharded.py)."""
from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Iterable, Iterator

import torch

from inkling_hpu.checkpoint_names import SKIPPED_PREFIXES, TEXT_PREFIX, is_skipped
from inkling_hpu.loader.file_reader import read_tensors
from inkling_hpu.loader.header import SAFETENSORS_DTYPES, CheckpointError, TensorEntry, TensorSpec, read_header
from inkling_hpu.loader.reads import _plan_read

# write_presharded's layout: <checkpoint>/presharded-tp<N>/rank-<r>/model.safetensors + manifest.
PRESHARDED_DIR = "presharded-tp{world_size}"
PRESHARDED_MANIFEST = "presharded.json"


def _index_files(checkpoint_dir: Path) -> list[Path]:
    """The checkpoint's shard files: those named by model.safetensors.index.json, else all."""
    index = checkpoint_dir / "model.safetensors.index.json"
    files: set[Path] = set()
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files.update(checkpoint_dir / f for f in weight_map.values())
    # Files outside the index (e.g. mtp.safetensors) are still listed so their names are known.
    files.update(checkpoint_dir.glob("*.safetensors"))
    missing = sorted(str(f) for f in files if not f.is_file())
    if missing:
        raise CheckpointError(f"{checkpoint_dir}: the index names shard files that do not exist: {missing}")
    if not files:
        raise CheckpointError(f"{checkpoint_dir}: expected *.safetensors files, found none")
    return sorted(files)


class TextCheckpoint:
    """The text tensors of a sharded safetensors checkpoint, located by header only."""

    def __init__(self, checkpoint_dir: str | os.PathLike):
        self.dir = Path(checkpoint_dir)
        self.files = _index_files(self.dir)
        self.text: dict[str, TensorEntry] = {}
        self.skipped: dict[str, TensorEntry] = {}
        unknown = []
        for path in self.files:
            for name, entry in read_header(path).items():
                if name.startswith(TEXT_PREFIX):
                    self.text[name] = entry
                elif is_skipped(name):
                    self.skipped[name] = entry
                else:
                    unknown.append(f"{name} ({path.name})")
        if unknown:
            raise CheckpointError(
                f"{self.dir}: expected only {TEXT_PREFIX}* (text) and {', '.join(SKIPPED_PREFIXES)}* "
                f"(skipped) tensors, found {len(unknown)} others, e.g. {unknown[:5]}")
        for entry in self.text.values():
            self._check_entry(entry)

    def _check_entry(self, entry: TensorEntry) -> None:
        if entry.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{entry.name} ({entry.file.name}): dtype {entry.dtype} is not one of "
                                  f"{sorted(SAFETENSORS_DTYPES)}")
        itemsize = SAFETENSORS_DTYPES[entry.dtype].itemsize
        expected = math.prod(entry.shape) * itemsize
        if entry.nbytes != expected:
            raise CheckpointError(f"{entry.name} ({entry.file.name}): shape {list(entry.shape)} {entry.dtype} "
                                  f"needs {expected} bytes, the header gives {entry.nbytes}")
        size = entry.file.stat().st_size
        if entry.end > size:
            raise CheckpointError(f"{entry.file}: truncated: {entry.name} needs bytes up to {entry.end}, "
                                  f"the file has {size}")

    @property
    def text_bytes(self) -> int:
        return sum(e.nbytes for e in self.text.values())

    def entry(self, spec: TensorSpec) -> TensorEntry:
        entry = self.text.get(spec.name)
        if entry is None:
            shape = "any shape" if spec.shape is None else f"expected shape {list(spec.shape)}"
            raise CheckpointError(f"missing tensor {spec.name} ({shape}): not in "
                                  f"any of the {len(self.files)} files under {self.dir}")
        if spec.shape is not None and entry.shape != tuple(spec.shape):
            raise CheckpointError(f"misshapen tensor {spec.name} in {entry.file.name}: expected shape "
                                  f"{list(spec.shape)}, found {list(entry.shape)}")
        if spec.dtype is not None and entry.dtype != spec.dtype:
            raise CheckpointError(f"tensor {spec.name} in {entry.file.name}: expected dtype {spec.dtype}, "
                                  f"found {entry.dtype}")
        return entry

    def fingerprint(self) -> str:
        """sha256 of where every text tensor is (name, dtype, shape, file, byte range): what a
        pre-sharded layout was made from."""
        items = sorted((e.name, e.dtype, list(e.shape), e.file.name, e.begin, e.end) for e in self.text.values())
        return hashlib.sha256(json.dumps(items).encode()).hexdigest()

    def presharded(self, world_size: int) -> tuple[Path, dict] | None:
        """This checkpoint's pre-sharded layout for world_size (write_presharded), if there is one."""
        directory = self.dir / PRESHARDED_DIR.format(world_size=world_size)
        if not (directory / PRESHARDED_MANIFEST).is_file():
            return None
        manifest = json.loads((directory / PRESHARDED_MANIFEST).read_text())
        if manifest.get("source") != self.fingerprint():
            raise CheckpointError(f"{directory}: made from a checkpoint with fingerprint {manifest.get('source')}, "
                                  f"this one has {self.fingerprint()}: remake it (python -m inkling_hpu.loader "
                                  f"presplit {self.dir} --tp {world_size}) or remove it")
        return directory, manifest

    def _load_presharded(self, presharded: tuple[Path, dict], plan: list, rank: int, world_size: int,
                         direct: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """The rank's own file: its slabs, contiguous, nothing of the other ranks'."""
        directory, manifest = presharded
        rank_specs = []
        for entry, spec in plan:
            made = manifest["shard_dims"].get(entry.name, "absent")
            if made != spec.shard_dim:
                raise CheckpointError(f"{directory}: {entry.name} split on dim {made} there, the model splits it "
                                      f"on dim {spec.shard_dim}: remake it or remove it")
            shape = tuple(size // world_size if d == spec.shard_dim else size for d, size in enumerate(entry.shape))
            rank_specs.append(TensorSpec(entry.name, shape, entry.dtype))
        rank_file = TextCheckpoint(directory / f"rank-{rank}")
        yield from rank_file.load(rank_specs, allow_unexpected=True, direct=direct)

    def refuse_unexpected(self, expected: Iterable[str]) -> None:
        """CheckpointError when the checkpoint holds a text tensor the model does not expect."""
        extra = sorted(set(self.text) - set(expected))
        if extra:
            raise CheckpointError(f"{self.dir}: {len(extra)} text tensors the model does not expect, "
                                  f"e.g. {extra[:5]}: the config does not match the checkpoint")

    def load(self, specs: Iterable[TensorSpec] | None = None, rank: int = 0, world_size: int = 1,
             allow_unexpected: bool = False, direct: bool | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (checkpoint name, tensor) for the rank, in file order.

        specs None loads every text tensor whole (no sharding checks). With specs, every spec
        must be present with its shape, and (unless allow_unexpected) every text tensor of the
        checkpoint must be asked for, so a config that does not match the checkpoint is refused
        rather than half-loaded. direct=None (the default) reads with O_DIRECT where the file system
        has it and the file is not mostly in the page cache, else buffered; ranks of world_size > 1
        reading the checkpoint in place read buffered; direct=True reads them with O_DIRECT where
        the file system has it; direct=False reads buffered (see file_reader._FileReader). With
        specs and world_size > 1, a pre-sharded layout of this checkpoint for world_size
        (write_presharded) is read instead when present."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        if specs is None:
            plan = [(e, None) for e in self.text.values()]
        else:
            specs = list(specs)
            plan = [(self.entry(s), s) for s in specs if not (s.optional and s.name not in self.text)]
            if not allow_unexpected:
                self.refuse_unexpected(s.name for s in specs)
        if specs is not None and world_size > 1:
            presharded = self.presharded(world_size)
            if presharded is not None:
                yield from self._load_presharded(presharded, plan, rank, world_size, direct)
                return
        if direct is None and world_size > 1:
            # Ranks reading in place share bytes through the page cache; with 8 ranks buffered reads
            # measured as fast as or faster than their own slabs by O_DIRECT (the pre-sharded
            # layout above is a rank file of its own: the default applies there).
            direct = False
        plan.sort(key=lambda item: (str(item[0].file), item[0].begin))
        reads = [_plan_read(entry, spec, rank, world_size) for entry, spec in plan]
        yield from read_tensors(reads, direct)
