"""Text-only loader on real safetensors files (written by the safetensors library itself)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from inkling_hpu import loader
from inkling_hpu.loader import CheckpointError, TensorSpec, TextCheckpoint, direct_io, file_reader, tuning

H = 64
SKIPPED_ELEMS = 1 << 22          # 8 MiB of bf16 per skipped tensor: reading any of it would show


def _text_tensors(gen: torch.Generator) -> dict[str, torch.Tensor]:
    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    return {
        "model.llm.embed.weight": rnd(96, H),
        "model.llm.norm.weight": rnd(H),
        "model.llm.layers.0.attn.wq_du.weight": rnd(8 * 16, H),
        "model.llm.layers.0.attn.wo_ud.weight": rnd(H, 8 * 16),
        "model.llm.layers.0.mlp.gate.bias": torch.randn(8, generator=gen),          # fp32
        # Big enough that a dim-1 shard is read in >= 1 MiB pieces (strided path).
        "model.llm.layers.0.mlp.experts.w13_weight": rnd(2, 8, 1 << 17),
    }


@pytest.fixture()
def checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    text = _text_tensors(gen)
    names = sorted(text)
    # Text tensors split over two shards with a vision and an audio tensor between them, and the
    # MTP head in its own file, as in the TML checkpoint.
    shard1 = {n: text[n] for n in names[:3]}
    shard1["model.visual.layers.linear_0.weight"] = torch.ones(SKIPPED_ELEMS, dtype=torch.bfloat16)
    shard2 = {n: text[n] for n in names[3:]}
    shard2["model.audio.encoder.weight"] = torch.ones(SKIPPED_ELEMS, dtype=torch.bfloat16)
    mtp = {"model.mtp.layers.0.input_proj.weight": torch.ones(SKIPPED_ELEMS, dtype=torch.bfloat16)}
    save_file(shard1, tmp_path / "model-00001-of-00002.safetensors")
    save_file(shard2, tmp_path / "model-00002-of-00002.safetensors")
    save_file(mtp, tmp_path / "mtp.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" for n in shard1}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in shard2})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp_path, text


def _io(field: str) -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/io")


def _rchar() -> int:
    """Bytes this process read through read()/pread() so far (page cache included)."""
    return _io("rchar")


def _drop_from_page_cache(directory: Path) -> None:
    for path in directory.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _assert_equal_to_safe_open(ckpt_dir: Path, loaded: dict[str, torch.Tensor]) -> None:
    seen = set()
    for f in ckpt_dir.glob("*.safetensors"):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                if name in loaded:
                    got, expected = loaded[name], st.get_tensor(name)
                    assert got.dtype == expected.dtype and got.shape == expected.shape, name
                    assert torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), name
                    seen.add(name)
    assert seen == set(loaded)


# buffered: direct=False; direct: O_DIRECT through the thread pool.
READ_PATHS = ["buffered", "direct"]


@pytest.fixture()
def direct(request) -> bool:
    return request.param != "buffered"


@pytest.fixture()
def small_chunks(monkeypatch):
    """Reads in many chunks, a prefetch window of a few calls and runs long enough for kernel
    readahead, so the chunk, window and readahead/exact split bookkeeping runs on tensors this small."""
    monkeypatch.setattr(tuning, "READ_CHUNK_BYTES", 3 * 4096)
    monkeypatch.setattr(tuning, "PREFETCH_CALL_BYTES", 4096)
    monkeypatch.setattr(tuning, "PREFETCH_BYTES", 5 * 4096)
    monkeypatch.setattr(tuning, "READAHEAD_TAIL_BYTES", 2 * 4096 + 100)


def test_loads_text_tensors_bit_exact_against_safe_open(checkpoint):
    ckpt_dir, text = checkpoint
    loaded = dict(TextCheckpoint(ckpt_dir).load())
    assert sorted(loaded) == sorted(text)
    for f in ckpt_dir.glob("model-*.safetensors"):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                if name in loaded:
                    assert loaded[name].dtype == st.get_tensor(name).dtype
                    assert torch.equal(loaded[name], st.get_tensor(name)), name


@pytest.mark.parametrize("direct", READ_PATHS, indirect=True)
def test_every_read_path_matches_safe_open_in_small_chunks(checkpoint, small_chunks, direct):
    ckpt_dir, _ = checkpoint
    _assert_equal_to_safe_open(ckpt_dir, dict(TextCheckpoint(ckpt_dir).load(direct=direct)))


@pytest.mark.parametrize("direct", READ_PATHS, indirect=True)
def test_cold_load_reads_only_the_text_pages_from_storage(checkpoint, direct):
    """With the files out of the page cache, storage reads (/proc/self/io read_bytes, readahead
    included) stay within the text ranges rounded out to 4 KiB pages: readahead would run into
    the 8 MiB skipped tensors next to them."""
    ckpt_dir, _ = checkpoint
    ckpt = TextCheckpoint(ckpt_dir)
    _drop_from_page_cache(ckpt_dir)
    before = _io("read_bytes")
    loaded = dict(ckpt.load(direct=direct))
    read = _io("read_bytes") - before
    assert len(loaded) == 6
    assert read <= ckpt.text_bytes + 2 * 4096 * len(loaded), (read, ckpt.text_bytes)


def test_long_run_read_by_kernel_readahead_stops_at_the_text(tmp_path):
    """A run of text longer than READAHEAD_TAIL_BYTES goes mostly through kernel readahead, which
    must not reach the skipped tensor right after it (cold cache, storage bytes)."""
    text = {"model.llm.layers.0.mlp.experts.w13_weight": torch.arange(48 << 20, dtype=torch.int16).view(torch.bfloat16),
            "model.llm.norm.weight": torch.ones(H, dtype=torch.bfloat16)}
    save_file(text | {"model.visual.after.weight": torch.ones(SKIPPED_ELEMS * 4, dtype=torch.bfloat16)},
              tmp_path / "model.safetensors")
    ckpt = TextCheckpoint(tmp_path)
    entries = sorted(ckpt.text.values(), key=lambda e: e.begin)
    assert entries[-1].end == ckpt.skipped["model.visual.after.weight"].begin    # text, then right after it the tower
    assert ckpt.text_bytes > 1.4 * tuning.READAHEAD_TAIL_BYTES
    _drop_from_page_cache(tmp_path)
    before = _io("read_bytes")
    loaded = dict(ckpt.load(direct=False))
    read = _io("read_bytes") - before
    assert read <= ckpt.text_bytes + 2 * 4096 * len(loaded), (read, ckpt.text_bytes)
    _assert_equal_to_safe_open(tmp_path, loaded)


def test_file_system_without_o_direct_is_read_buffered(checkpoint, small_chunks, tmp_path_factory):
    """ramfs refuses O_DIRECT (tmpfs accepts it since Linux 6.6): direct=True then reads through
    the page cache, same tensors. Mounting it needs root."""
    ckpt_dir, _ = checkpoint
    mount = tmp_path_factory.mktemp("ramfs")
    if subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a ramfs here (needs root)")
    try:
        for f in ckpt_dir.iterdir():
            shutil.copy(f, mount / f.name)
        with pytest.raises(OSError):
            os.open(mount / "mtp.safetensors", os.O_RDONLY | os.O_DIRECT)
        _assert_equal_to_safe_open(mount, dict(TextCheckpoint(mount).load(direct=True)))
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_skipped_tensors_bytes_are_never_read(checkpoint):
    ckpt_dir, _ = checkpoint
    ckpt = TextCheckpoint(ckpt_dir)
    assert sorted(ckpt.skipped) == ["model.audio.encoder.weight", "model.mtp.layers.0.input_proj.weight",
                                    "model.visual.layers.linear_0.weight"]
    skipped_bytes = sum(e.nbytes for e in ckpt.skipped.values())
    before = _rchar()
    loaded = list(ckpt.load())
    read = _rchar() - before
    assert len(loaded) == 6
    # Every text byte once, plus a little for whatever else the interpreter read meanwhile.
    assert ckpt.text_bytes <= read <= ckpt.text_bytes + (256 << 10), (read, ckpt.text_bytes)
    assert skipped_bytes > 4 * ckpt.text_bytes


def test_headers_alone_are_read_to_index_the_checkpoint(checkpoint):
    ckpt_dir, _ = checkpoint
    before = _rchar()
    TextCheckpoint(ckpt_dir)
    assert _rchar() - before < (64 << 10)


@pytest.mark.parametrize("direct", READ_PATHS, indirect=True)
@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_shards_reassemble_the_full_tensor(checkpoint, world_size, direct):
    ckpt_dir, text = checkpoint
    specs = [
        TensorSpec("model.llm.embed.weight", (96, H)),                                  # replicated
        TensorSpec("model.llm.norm.weight", (H,), dtype="BF16"),
        TensorSpec("model.llm.layers.0.attn.wq_du.weight", (128, H), shard_dim=0),        # one range
        TensorSpec("model.llm.layers.0.attn.wo_ud.weight", (H, 128), shard_dim=1),        # small pieces
        TensorSpec("model.llm.layers.0.mlp.gate.bias", (8,), dtype="F32"),
        TensorSpec("model.llm.layers.0.mlp.experts.w13_weight", (2, 8, 1 << 17), shard_dim=1),  # 1 MiB pieces
    ]
    ckpt = TextCheckpoint(ckpt_dir)
    per_rank = [dict(ckpt.load(specs, rank=r, world_size=world_size, direct=direct)) for r in range(world_size)]
    for spec in specs:
        parts = [p[spec.name] for p in per_rank]
        if spec.shard_dim is None:
            assert all(torch.equal(p, text[spec.name]) for p in parts)
        else:
            assert parts[0].shape[spec.shard_dim] == spec.shape[spec.shard_dim] // world_size
            assert torch.equal(torch.cat(parts, dim=spec.shard_dim), text[spec.name]), spec.name


def test_dim0_shard_reads_only_its_slice(checkpoint):
    ckpt_dir, _ = checkpoint
    ckpt = TextCheckpoint(ckpt_dir)
    spec = TensorSpec("model.llm.layers.0.mlp.experts.w13_weight", (2, 8, 1 << 17), shard_dim=0)
    before = _rchar()
    ((_, shard),) = ckpt.load([spec], rank=1, world_size=2, allow_unexpected=True)
    read = _rchar() - before
    assert shard.shape == (1, 8, 1 << 17)
    assert shard.numel() * 2 <= read <= shard.numel() * 2 + (64 << 10)


def test_missing_tensor_is_named(checkpoint):
    ckpt_dir, _ = checkpoint
    with pytest.raises(CheckpointError, match=r"missing tensor model\.llm\.layers\.1\.attn_norm\.weight "
                                              r"\(expected shape \[64\]\)"):
        list(TextCheckpoint(ckpt_dir).load([TensorSpec("model.llm.layers.1.attn_norm.weight", (H,))],
                                           allow_unexpected=True))


def test_misshapen_tensor_names_expected_and_found(checkpoint):
    ckpt_dir, _ = checkpoint
    with pytest.raises(CheckpointError, match=r"expected shape \[128, 32\], found \[128, 64\]"):
        list(TextCheckpoint(ckpt_dir).load([TensorSpec("model.llm.layers.0.attn.wq_du.weight", (128, 32))],
                                           allow_unexpected=True))


def test_wrong_dtype_is_refused(checkpoint):
    ckpt_dir, _ = checkpoint
    with pytest.raises(CheckpointError, match="expected dtype F32, found BF16"):
        list(TextCheckpoint(ckpt_dir).load([TensorSpec("model.llm.norm.weight", (H,), dtype="F32")],
                                           allow_unexpected=True))


def test_unexpected_text_tensors_are_refused(checkpoint):
    ckpt_dir, _ = checkpoint
    with pytest.raises(CheckpointError, match="5 text tensors the model does not expect"):
        list(TextCheckpoint(ckpt_dir).load([TensorSpec("model.llm.norm.weight", (H,))]))


def test_truncated_shard_is_refused_before_reading(checkpoint):
    ckpt_dir, _ = checkpoint
    shard = ckpt_dir / "model-00002-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - SKIPPED_ELEMS * 2 - 10)   # cuts into text tensors
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: truncated: model\.llm\."):
        TextCheckpoint(ckpt_dir)


@pytest.mark.parametrize("direct", READ_PATHS, indirect=True)
def test_file_truncated_after_indexing_fails_while_reading(checkpoint, direct):
    ckpt_dir, _ = checkpoint
    ckpt = TextCheckpoint(ckpt_dir)
    entry = ckpt.text["model.llm.layers.0.mlp.experts.w13_weight"]
    os.truncate(entry.file, entry.begin + (3 << 20) + 100)
    with pytest.raises(CheckpointError, match=r"truncated while reading model\.llm\.layers\.0\.mlp\.experts\."
                                              r"w13_weight: got 3145828 of 4194304 bytes"):
        list(ckpt.load(direct=direct))


def test_default_reads_cold_files_with_o_direct(checkpoint, monkeypatch):
    """The default: cold files are read with O_DIRECT (several requests in flight); files mostly in
    the page cache already are read buffered (O_DIRECT would go to storage again)."""
    ckpt_dir, _ = checkpoint
    ckpt = TextCheckpoint(ckpt_dir)
    requests = []
    real_submit = direct_io._DirectQueue._submit
    monkeypatch.setattr(direct_io._DirectQueue, "_submit", lambda queue, job: requests.append(job) or real_submit(queue, job))
    monkeypatch.setattr(tuning, "READ_CHUNK_BYTES", 64 << 10)       # many requests in flight at once
    dict(ckpt.load())                                                # now in the page cache
    assert requests == []
    _drop_from_page_cache(ckpt_dir)
    before = _io("read_bytes")
    loaded = dict(ckpt.load())
    read = _io("read_bytes") - before
    assert len(requests) > tuning.READ_THREADS
    assert read <= ckpt.text_bytes + 2 * 4096 * len(loaded), (read, ckpt.text_bytes)
    _assert_equal_to_safe_open(ckpt_dir, loaded)


def test_default_tensor_parallel_ranks_in_place_read_buffered(checkpoint, monkeypatch):
    ckpt_dir, text = checkpoint
    ckpt = TextCheckpoint(ckpt_dir)
    monkeypatch.setattr(tuning, "CACHED_SHARE_BUFFERED", 1.0)        # cache or not, would read O_DIRECT
    queues = []
    real_queue = direct_io._DirectQueue
    monkeypatch.setattr(file_reader, "_DirectQueue", lambda *args: queues.append(args) or real_queue(*args))
    specs = [TensorSpec(name, None, shard_dim=dim) for name, dim in
             {n: (0 if n.endswith("wq_du.weight") else None) for n in text}.items()]
    per_rank = [dict(ckpt.load(specs, rank=r, world_size=2)) for r in range(2)]
    assert queues == []
    name = "model.llm.layers.0.attn.wq_du.weight"
    assert torch.equal(torch.cat([p[name] for p in per_rank]), text[name])
    dict(ckpt.load(specs, rank=0, world_size=2, direct=True))
    assert queues


@pytest.mark.parametrize("direct", READ_PATHS, indirect=True)
def test_load_stopped_early_leaves_no_read_in_flight(checkpoint, small_chunks, direct):
    ckpt_dir, text = checkpoint
    loads = TextCheckpoint(ckpt_dir).load(direct=direct)
    name, first = next(loads)
    loads.close()                    # waits out the requests in flight, then frees their memory
    assert torch.equal(first, text[name])


@pytest.mark.parametrize("direct", READ_PATHS, indirect=True)
def test_truncated_file_fails_on_the_small_piece_slab_path(checkpoint, direct):
    """A slab taken from the whole tensor (pieces under MIN_STRIDED_PIECE_BYTES) checks the file
    size before mapping it: an error, not a SIGBUS."""
    ckpt_dir, _ = checkpoint
    ckpt = TextCheckpoint(ckpt_dir)
    entry = ckpt.text["model.llm.layers.0.attn.wo_ud.weight"]
    os.truncate(entry.file, entry.begin + 100)
    spec = TensorSpec(entry.name, (H, 128), shard_dim=1)
    with pytest.raises(CheckpointError, match=r"truncated while reading model\.llm\.layers\.0\.attn\.wo_ud\.weight: "
                                              r"got 100 of 16384 bytes"):
        list(ckpt.load([spec], rank=1, world_size=2, allow_unexpected=True, direct=direct))


def _name_table_specs(ckpt: TextCheckpoint) -> list[TensorSpec]:
    return [TensorSpec(name, None, shard_dim=dim) for name, dim in loader.split_dims(ckpt).items()]


def test_presharded_layout_is_read_instead_and_holds_only_the_rank_slabs(checkpoint, capsys):
    ckpt_dir, _ = checkpoint
    ckpt = TextCheckpoint(ckpt_dir)
    specs = _name_table_specs(ckpt)
    in_place = [dict(ckpt.load(specs, rank=r, world_size=2)) for r in range(2)]
    assert loader.main(["presplit", str(ckpt_dir), "--tp", "2"]) == 0
    assert "presharded-tp2: verified against presharded.json" in capsys.readouterr().out
    for rank in range(2):
        rank_file = ckpt_dir / "presharded-tp2" / f"rank-{rank}" / "model.safetensors"
        slab_bytes = sum(t.numel() * t.element_size() for t in in_place[rank].values())
        assert slab_bytes < rank_file.stat().st_size < slab_bytes + (8 << 10)
        ckpt = TextCheckpoint(ckpt_dir)
        before = _rchar()
        loaded = dict(ckpt.load(specs, rank=rank, world_size=2))
        assert _rchar() - before < rank_file.stat().st_size + (64 << 10)      # its own file, nothing else
        assert sorted(loaded) == sorted(in_place[rank])
        for name, tensor in loaded.items():
            assert tensor.dtype == in_place[rank][name].dtype and torch.equal(tensor, in_place[rank][name]), name


def test_presharded_file_that_changed_fails_verification(checkpoint, capsys):
    ckpt_dir, _ = checkpoint
    directory = loader.write_presharded(ckpt_dir, 2)
    rank_file = directory / "rank-1" / "model.safetensors"
    data = bytearray(rank_file.read_bytes())
    data[-1] ^= 1
    rank_file.write_bytes(bytes(data))
    assert loader.main(["verify", str(directory)]) == 1
    assert re.search(r"rank-1/model\.safetensors: sha256 expected [0-9a-f]{64} \(manifest\), found [0-9a-f]{64}",
                     capsys.readouterr().err)


def test_presharded_layout_of_another_checkpoint_or_split_is_refused(checkpoint):
    ckpt_dir, _ = checkpoint
    directory = loader.write_presharded(ckpt_dir, 2)
    ckpt = TextCheckpoint(ckpt_dir)
    specs = _name_table_specs(ckpt)
    resplit = [TensorSpec(s.name, None, shard_dim=1) if s.name.endswith("wq_du.weight") else s for s in specs]
    with pytest.raises(CheckpointError, match=r"wq_du\.weight split on dim 0 there, the model splits it on dim 1"):
        list(ckpt.load(resplit, rank=0, world_size=2))
    manifest = json.loads((directory / "presharded.json").read_text())
    (directory / "presharded.json").write_text(json.dumps(manifest | {"source": "0" * 64}))
    with pytest.raises(CheckpointError, match=f"made from a checkpoint with fingerprint {'0' * 64}, this one has "
                                              f"{ckpt.fingerprint()}: remake it"):
        list(ckpt.load(specs, rank=0, world_size=2))


@pytest.mark.parametrize("first", ["inkling_hpu.loader", "inkling_hpu.model.weights"])
def test_loader_and_name_table_import_in_either_order(first):
    """The loader's pre-sharded layout reads the model's name table and the table the checkpoint's
    names (inkling_hpu.checkpoint_names): no import cycle, whichever a fresh interpreter imports first."""
    port = Path(loader.__file__).parents[2]
    proc = subprocess.run([sys.executable, "-c", f"import {first}; import inkling_hpu.loader, inkling_hpu.model.weights"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(port)})
    assert proc.returncode == 0, proc.stderr


def test_garbage_header_length_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="header length 1000000000000 does not fit the file"):
        TextCheckpoint(tmp_path)


def test_unknown_prefix_is_refused(tmp_path):
    save_file({"model.llm.norm.weight": torch.ones(4), "lm_head.weight": torch.ones(4)},
              tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"found 1 others, e.g. \['lm_head.weight"):
        TextCheckpoint(tmp_path)


def test_index_naming_a_missing_shard_is_refused(checkpoint):
    ckpt_dir, _ = checkpoint
    (ckpt_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard files that do not exist"):
        TextCheckpoint(ckpt_dir)


def test_indivisible_shard_is_refused(checkpoint):
    ckpt_dir, _ = checkpoint
    spec = TensorSpec("model.llm.layers.0.attn.wq_du.weight", (128, H), shard_dim=0)
    with pytest.raises(CheckpointError, match="not divisible by the tensor-parallel size 3"):
        list(TextCheckpoint(ckpt_dir).load([spec], rank=0, world_size=3, allow_unexpected=True))


def test_empty_directory_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"expected \*\.safetensors files, found none"):
        TextCheckpoint(tmp_path)



def test_optional_tensor_may_be_absent(checkpoint):
    ckpt_dir, _ = checkpoint
    specs = [TensorSpec("model.llm.norm.weight", None),
             TensorSpec("model.llm.layers.0.mlp.global_scale", (1,), optional=True)]
    loaded = dict(TextCheckpoint(ckpt_dir).load(specs, allow_unexpected=True))
    assert list(loaded) == ["model.llm.norm.weight"]


@pytest.mark.parametrize("tp_size", [1, 2])
def test_glue_loads_rank_slabs_exactly_like_the_full_tensor_path(tmp_path, tp_size):
    """vllm_model.load_text_checkpoint (this loader, reading only each rank's slab) fills the port
    model exactly as the model's own name table does from each full tensor's slab r of tp_size."""
    from inkling_hpu import parity
    from inkling_hpu.vllm_model import load_text_checkpoint
    from inkling_hpu.model import InklingForCausalLM, InklingPortConfig, TensorParallel
    from inkling_hpu.model import weights as weight_table
    from inkling_hpu.model.knobs import Knobs

    raw = json.loads((Path(parity.__file__).parent / "configs" / "tiny-gqa2-mix.json").read_text())
    tensors = {k: v.contiguous() for k, v in
               parity.reference_to_checkpoint(parity.build_reference(raw, 0, torch.float32)).items()}
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[::2]} | {"model.visual.final_norm.weight": torch.ones(8)},
              tmp_path / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in names[1::2]}, tmp_path / "model-00002-of-00002.safetensors")
    config = InklingPortConfig.from_dict({k: v for k, v in raw.items() if k not in parity.NON_MODEL_KEYS})
    for rank in range(tp_size):
        tp = TensorParallel(rank=rank, size=tp_size)
        ours = InklingForCausalLM(config, tp=tp, knobs=Knobs())
        theirs = InklingForCausalLM(config, tp=tp, knobs=Knobs())
        load_text_checkpoint(ours, tmp_path)
        dims = {name: weight_table.resolve(name, config)[0].dim for name in tensors}
        weight_table.load_checkpoint(theirs, {name: tensor if dims[name] is None else
                                              tensor.chunk(tp_size, dims[name])[rank]
                                              for name, tensor in tensors.items()})
        expected = dict(theirs.state_dict())
        for name, value in ours.state_dict().items():
            assert torch.equal(value, expected[name]), (rank, name)
