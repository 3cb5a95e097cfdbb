"""Trees of real vLLM v0.30.0 files and the fix-pack runs the cookbook tests make on them.

Fixture patches (fixtures/) each add a comment line to a real vLLM file; the other patches are
authored at test time the way docs/fix-format.md says (a scratch git repository of real files,
`git diff --full-index`), so no upstream file is committed.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from cookbook import api

REPO = Path(__file__).resolve().parents[2]


APPLY_ALL = REPO / "fixes" / "apply_all.py"


FIXTURES = Path(__file__).parent / "fixtures"


PROFILE = FIXTURES / "profile.yaml"


TOUCHED = ["vllm/_version.py", "vllm/envs.py", "vllm/v1/core/sched/scheduler.py", "vllm/v1/sample/sampler.py"]


BASE = "ced6857afa0ea7b2e3f0846a62e1394e90f15607"


ENVS = "vllm/envs.py"  # mode 0755 in the sdist, like in vLLM's repository


# The journal a run keeps in the package it changes (relative to a vLLM tree).
JOURNAL = "vllm/.cookbook-fixes-journal"


STAMP = "vllm/cookbook-fixes.json"


SCHEDULER = "vllm/v1/core/sched/scheduler.py"


OTHER_USER = 54321  # no such user here: git's ownership check then refuses the checkout


def cli(*args, env=None, cwd=REPO, check_rc=None) -> subprocess.CompletedProcess:
    """fixes/apply_all.py, as users run it."""
    done = subprocess.run([sys.executable, str(APPLY_ALL), *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=120)
    if check_rc is not None:
        assert done.returncode == check_rc, done.stdout + done.stderr
    return done


def apply(root, *extra, profile=PROFILE, **kw):
    return cli("--profile", profile, "--vllm-root", root, "--target", "vllm", *extra, **kw)


def git(repo: Path, *args) -> bytes:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                           "-c", "core.autocrlf=false", *args], check=True, capture_output=True).stdout


def make_tree(src: Path, dest: Path) -> Path:
    """The real vLLM files the fixture series touches (plus _version.py, which names the commit)."""
    for rel in TOUCHED:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, dest / rel)
    return dest


def tree_hash(root: Path, skip: str | None = None) -> str:
    """The tree's names, modes and bytes; `skip`: a folder name left out wherever it is."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if skip in rel.parts:
            continue
        digest.update(str(rel).encode())
        if path.is_file():
            digest.update(oct(path.stat().st_mode).encode() + path.read_bytes())
    return digest.hexdigest()


def add_fix(fixes_dir: Path, name: str, patch: bytes, **meta) -> None:
    folder = fixes_dir / name
    folder.mkdir(parents=True)
    (folder / "vllm.patch").write_bytes(patch)
    extra = "".join(f"{k}: {json.dumps(v)}\n" for k, v in meta.items())
    (folder / "fix.yaml").write_text(
        f"title: {name}\ntargets: [vllm]\npatches:\n  - target: vllm\n    file: vllm.patch\n"
        f"    base: ced6857afa0ea7b2e3f0846a62e1394e90f15607\nupstream:\n  status: inappropriate\n{extra}")


def profile_with(tmp_path: Path, extra_fixes: dict[str, bytes], order: list[str], opt_in=(), **metas) -> Path:
    """A copy of the fixture profile with more fixes, in the given order."""
    fixes_dir = tmp_path / "fixes"
    shutil.copytree(FIXTURES / "fixes", fixes_dir)
    for name, patch in extra_fixes.items():
        add_fix(fixes_dir, name, patch, **metas.get(name, {}))
    profile = tmp_path / "profile.yaml"
    profile.write_text(f"name: custom\nextends: v0.30.0\nfixes-dir: fixes\nfixes: {json.dumps(order)}\n"
                       f"opt-in: {json.dumps(list(opt_in))}\n")
    return profile


def fixture_patch(name: str) -> bytes:
    return (FIXTURES / "fixes" / name / "vllm.patch").read_bytes()


def author(base: Path, edit, work: Path) -> bytes:
    """The patch `edit(copy of base)` makes, as `git diff --full-index` (renames detected)."""
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(base, work, symlinks=True)
    git(work, "init", "-q")
    git(work, "add", "-A")
    git(work, "commit", "-qm", "base")
    edit(work)
    git(work, "add", "-A")
    patch = git(work, "diff", "--cached", "--full-index", "-M")
    shutil.rmtree(work)
    return patch


def replace(rel: str, old: bytes, new: bytes):
    def edit(work: Path):
        data = (work / rel).read_bytes()
        assert old in data, f"{old!r} not in {rel}"
        (work / rel).write_bytes(data.replace(old, new, 1))
    return edit


def fix_yaml(name: str, extra: str = "", patches: str | None = None) -> str:
    if patches is None:
        patches = f"patches:\n  - target: vllm\n    file: vllm.patch\n    base: {BASE}\n"
    return f"title: {name}\ntargets: [vllm]\n{patches}upstream:\n  status: inappropriate\n{extra}"


def make_profile(where: Path, fixes: dict[str, bytes], order: list[str], opt_in=(), metas=None,
                 extra: str = "") -> Path:
    """A profile extending v0.30.0 with its own fixes folder; `metas` adds fix.yaml lines."""
    fixes_dir = where / "fixes"
    fixes_dir.mkdir(parents=True)
    for name, patch in fixes.items():
        (fixes_dir / name).mkdir()
        (fixes_dir / name / "vllm.patch").write_bytes(patch)
        (fixes_dir / name / "fix.yaml").write_text(fix_yaml(name, (metas or {}).get(name, "")))
    profile = where / "profile.yaml"
    profile.write_text(f"name: edge\nextends: v0.30.0\nfixes-dir: fixes\nfixes: {json.dumps(order)}\n"
                       f"opt-in: {json.dumps(list(opt_in))}\n{extra}")
    return profile


def run(profile: Path, root: Path, opt_ins=(), mode="apply", strict=False):
    """The library's run, in process (fast); returns the report."""
    report = api.run(api.load_profile(str(profile)), {"vllm": root, "vllm-gaudi": None}, list(opt_ins), mode=mode,
                        only_targets=["vllm"], strict=strict)
    return report


def statuses(report) -> list[tuple[str, str]]:
    return [(f.name, f.status) for f in report.fixes]


def copy_fixture_fixes(where: Path) -> Path:
    shutil.copytree(FIXTURES / "fixes", where / "fixes")
    return where


def profile_with_fix_yaml(tmp_path: Path, text: str) -> Path:
    where = copy_fixture_fixes(tmp_path)
    (where / "fixes/new").mkdir()
    (where / "fixes/new/fix.yaml").write_text(text)
    shutil.copy(FIXTURES / "fixes/sampler-marker/vllm.patch", where / "fixes/new/vllm.patch")
    shutil.copy(FIXTURES / "fixes/envs-marker/vllm.patch", where / "fixes/new/other.patch")
    (where / "profile.yaml").write_text("name: x\nextends: v0.30.0\nfixes-dir: fixes\nfixes: [new]\n")
    return where / "profile.yaml"


def stamped(tree: Path) -> list[str] | None:
    path = tree / "vllm/cookbook-fixes.json"
    if not path.exists():
        return None
    return [f["name"] for f in json.loads(path.read_text())["profiles"]["engine-fixture"]["fixes"]]


def killed_apply(root: Path, after_writes: int, *extra) -> None:
    env = dict(os.environ, COOKBOOK_TEST_KILL_AFTER_WRITES=str(after_writes))
    done = apply(root, *extra, env=env)
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    assert (root / JOURNAL / "manifest.json").exists()


def one_line_refusal(done: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """The run refused with `code` in one REFUSED/error line naming `words`, and no traceback."""
    out = done.stdout + done.stderr
    assert done.returncode == code, out
    assert "Traceback" not in out, out
    line = next(l for l in out.splitlines() if l.startswith(("REFUSED", "error:")))
    for word in words:
        assert word in line, line
    return line


def patched_reference(vllm_src, tmp_path) -> str:
    """The hash of a fresh tree after a clean apply of the fixture profile."""
    ref = make_tree(vllm_src, tmp_path / "reference")
    apply(ref, check_rc=0)
    return tree_hash(ref)


def commit_checkout(root: Path) -> str:
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "another commit"], check=True)
    return subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
