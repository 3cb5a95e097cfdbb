"""Docs that cannot drift: every command in the code blocks of the README, docs/ and the port's docs is
checked against the code it names. A `make` target must exist and each VAR=value must be a variable the
Makefile reads; a `python3 -m MODULE` or script of this repository must exist, answer --help (for its
sub-command too) and list every option the command gives it; each repository path must exist; each
environment variable set or used must be read by this repository's code or by vLLM 0.30.0.

The commands are read from fenced blocks (``` with no language, sh, bash, shell or console), from 4-space
indented blocks, one command per line (a trailing backslash continues it), and from code spans in prose that
start with such a program; each is split at ;, &&, || and |, and a `# comment` is dropped. Placeholders in
angle brackets (<port image>) stand for a value."""
from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/*.md", "ports/inkling-small/README.md", "ports/inkling-small/docs/*.md",
        "ports/inkling-small/configs/inkling-small/README.md", "tests/gaudi_harness/README.md", "benchmarks/README.md"]
TOP_DIRS = ("benchmarks/", "builder/", "cookbook/", "docs/", "fixes/", "ports/", "profiles/", "recipes/", "requirements/",
            "tests/", "tools/", ".ci/", ".github/")
SHELL_LANGUAGES = {"", "sh", "bash", "shell", "console"}
# Variables of the shell and of other programs, read by no code of ours: the docs may name them freely.
OUTSIDE_VARIABLES = {"HOME", "PATH", "PWD", "PIP_INDEX_URL", "HF_HOME", "HF_HUB_OFFLINE", "CI"}
PROGRAMS = ("make", "python", "python3", "bash", "sh")
# A click group whose first argument, when it is not a sub-command, goes to this one (cookbook.cli.DefaultGroup).
DEFAULT_SUB_COMMAND = {"fixes/apply_all.py": "apply"}


@dataclass(frozen=True)
class Command:
    where: str        # file:line
    words: tuple[str, ...]
    assigned: frozenset[str] = frozenset()    # variables the doc set before it


def doc_files() -> list[Path]:
    return sorted({path for pattern in DOCS for path in REPO.glob(pattern)})


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the shell code blocks: fenced blocks in a shell language, indented blocks."""
    out, fence, previous_blank, in_indented = [], None, True, False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip().lower()
            continue
        if fence is not None:
            if fence in SHELL_LANGUAGES:
                out.append((number, line))
            continue
        indented = line.startswith("    ") and stripped and not stripped.startswith(("-", "*", "|", "`"))
        in_indented = bool(indented and (previous_blank or in_indented))
        if in_indented:
            out.append((number, line))
        previous_blank = not stripped
    return out


def inline_commands(text: str) -> list[tuple[int, str]]:
    """(line number, span) of the `code spans` in prose that are a command of a program we check."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", line):
            if _program(tuple(span.split())) is not None and " " in span:
                out.append((number, span))
    return out


def commands(path: Path) -> list[Command]:
    """The commands of a doc's code blocks and of its command-like code spans: joined continuations, split at
    shell operators, comments, prompts and placeholders stripped, wrappers unwrapped (`docker exec NAME`,
    `bash -c '...'`, `sudo`, `env`, `timeout N`), command substitutions checked as commands of their own;
    those of the programs we check (PROGRAMS, or a script of ours)."""
    found, pending, start, assigned = [], "", 0, set()
    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
    text = path.read_text()
    for number, line in code_lines(text) + inline_commands(text):
        line = line.strip()
        line = line[2:] if line.startswith("$ ") else line
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        for words in shell_commands(re.sub(r"<[^<>]*>", "PLACEHOLDER", line)):
            found.append(Command(f"{where}:{start}", words, frozenset(assigned)))
            assigned.update(_assignments(list(words)))
    return [c for c in found if _program(c.words) is not None]


def shell_commands(line: str) -> list[tuple[str, ...]]:
    """The simple commands of one shell line, wrappers unwrapped, substitutions' commands included."""
    inner = [words for sub in re.findall(r"\$\(([^()]*)\)", line) for words in shell_commands(sub)]
    line = re.sub(r"\$\([^()]*\)", "SUBST", line)       # the substitution's value, in its command
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words = list(lexer)
    except ValueError:      # not shell (an output line with an odd quote)
        return inner
    out, piece = [], []
    for word in words + [";"]:
        if word and set(word) <= set(";&|"):
            out += _unwrap(tuple(piece)) if piece else []
            piece = []
        else:
            piece.append(word)
    return inner + out


def _unwrap(words: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The command a wrapper runs: docker exec [options] NAME CMD, bash|sh -c STRING, sudo, env, timeout N."""
    if words[:2] == ("docker", "exec"):
        rest = list(words[2:])
        while rest and rest[0].startswith("-"):
            option = rest.pop(0)
            if option in ("-e", "--env", "-w", "--workdir", "-u", "--user") and rest:
                rest.pop(0)
        return _unwrap(tuple(rest[1:])) if len(rest) > 1 else []
    if len(words) >= 3 and words[0] in ("bash", "sh") and words[1] == "-c":
        return shell_commands(words[2])
    if words[:1] in (("sudo",), ("env",)):
        return _unwrap(words[1:])
    if words[:1] == ("timeout",) and len(words) > 2:
        return _unwrap(words[2:])
    return [words]


def _assignments(words: list[str]) -> set[str]:
    """The variables a command that is only assignments (VENV=$(bash tools/test_env.sh)) sets for the
    commands after it in the same doc."""
    env, rest = _split_env(tuple(words))
    return set(env) if not rest else set()


def _split_env(words: tuple[str, ...]) -> tuple[dict[str, str], tuple[str, ...]]:
    env, rest = {}, list(words)
    while rest and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", rest[0]):
        name, value = rest.pop(0).split("=", 1)
        env[name] = value
    return env, tuple(rest)


def _program(words: tuple[str, ...]) -> str | None:
    _, rest = _split_env(words)
    if not rest:
        return None
    head = rest[0]
    if Path(head).name in PROGRAMS or head.endswith(("/python", "/python3")):
        return Path(head).name if Path(head).name in ("make", "bash", "sh") else "python"
    if head.startswith(TOP_DIRS) or head.startswith("./"):
        return "script"
    return None


@functools.lru_cache(maxsize=None)
def makefile() -> tuple[frozenset[str], frozenset[str]]:
    """(targets, variables read) of the Makefile."""
    text = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z][\w-]*):(?!=)", text, re.M))
    variables = set(re.findall(r"\$\(([A-Z_][A-Z0-9_]*)\)", text))
    variables |= set(re.findall(r"^([A-Z_][A-Z0-9_]*)\s*\?=", text, re.M))
    return frozenset(targets), frozenset(variables)


@functools.lru_cache(maxsize=None)
def help_text(pythonpath: str, *argv: str) -> tuple[int, str]:
    """`argv --help` run as the doc writes it: from the repository root, with the command's own PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([*argv, "--help"], capture_output=True, text=True, cwd=REPO,
                          env={**env, "PYTHONPATH": pythonpath} if pythonpath else env, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def module_file(module: str, pythonpath: str) -> Path | None:
    """The file `python -m module` runs from the repository root with that PYTHONPATH, or None."""
    for root in [REPO, *(REPO / part for part in pythonpath.split(os.pathsep) if part)]:
        base = root / module.replace(".", "/")
        for candidate in (base.with_suffix(".py"), base / "__main__.py"):
            if candidate.is_file():
                return candidate
    return None


@functools.lru_cache(maxsize=None)
def read_by_code(name: str) -> bool:
    """Whether a variable is named by this repository's code (not its docs, not tests/) or read by vLLM 0.30.0
    (its envs.py)."""
    from cookbook import upstream

    proc = subprocess.run(["git", "grep", "-q", "-w", name, "--", "*.py", "*.sh", "Makefile", "*.yaml", "*.yml",
                           "Dockerfile", "*/Dockerfile", ".ci/run", ":!tests/"], cwd=REPO)
    if proc.returncode == 0:
        return True
    return f'"{name}"' in (upstream.vllm_source() / "vllm" / "envs.py").read_text()


def problems(command: Command) -> list[str]:
    env, words = _split_env(command.words)
    found = [f"{name} is read by nothing" for name in env if name not in OUTSIDE_VARIABLES and not read_by_code(name)]
    for word in words:
        for name in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", word):
            if name not in OUTSIDE_VARIABLES | env.keys() | command.assigned and not read_by_code(name):
                found.append(f"${name} is read by nothing and set nowhere in the command")
    program = _program(command.words)
    # the port's package is installed wherever its commands run (install.sh, the image): ports/inkling-small
    pythonpath = os.pathsep.join(filter(None, [env.get("PYTHONPATH", ""), "ports/inkling-small"]))
    # the cookbook inside the image ($COOKBOOK, the recipe's cookbook-path) is this repository
    args = [re.sub(r"^(\$COOKBOOK|\$\{COOKBOOK\}|/opt/gaudi-cookbook)/", "", arg) for arg in words[1:]]
    if program == "make":
        targets, variables = makefile()
        for arg in args:
            if "=" in arg:
                if arg.split("=", 1)[0] not in variables:
                    found.append(f"the Makefile reads no variable {arg.split('=', 1)[0]}")
            elif not arg.startswith("-") and arg not in targets:
                found.append(f"no make target {arg!r}")
        return found
    if program in ("bash", "sh", "script"):
        script = args.pop(0) if program != "script" else words[0]
        if not (REPO / script).exists():
            return found + [f"no script {script}"]
        if script.endswith(".py"):
            program, args = "python", [script, *args]
        elif "--help" in (REPO / script).read_text():    # never run a script that has no --help: it would run
            code, text = help_text(pythonpath, "bash", script)
            return found + _missing_options(args, text, code, f"bash {script}")
        else:
            return found + [f"{script} takes no options, given {a}" for a in args if a.startswith("-")]
    if program == "python":
        if args[:1] == ["-m"] and len(args) > 1:
            module, rest = args[1], args[2:]
            if module == "pytest":
                return found + [f"no test file {a}" for a in rest if a.endswith(".py") and not (REPO / a).exists()]
            if "PLACEHOLDER" in module:
                return found
            source = module_file(module, pythonpath)
            if source is None:
                ours = module.split(".")[0] in _our_packages()
                return found + ([f"no module {module} in this repository"] if ours else [])
            argv = (sys.executable, "-m", module)
        elif args and args[0].endswith(".py"):
            source = REPO / args[0]
            if not source.exists():
                return found + [f"no script {args[0]}"]
            argv, rest = (sys.executable, str(source)), args[1:]
        else:
            return found
        if not re.search(r"argparse|click|\bmain\(", source.read_text()):   # --help would run it
            return found + [f"{source.relative_to(REPO)} parses no options, given {a}" for a in rest if a.startswith("-")]
        code, text = help_text(pythonpath, *argv)
        subs = _sub_commands(text) if code == 0 else []
        if subs:      # the doc's sub-command must be one, and its options that sub-command's (or the group's)
            given = next((a for a in rest if not a.startswith("-")), None)
            chosen = given if given in subs else DEFAULT_SUB_COMMAND.get(str(source.relative_to(REPO)))
            if given is not None and chosen is None:
                return found + [f"{' '.join(argv[1:])}: no sub-command {given!r} (it has {', '.join(subs)})"]
            if chosen is not None:
                sub_code, sub_text = help_text(pythonpath, *argv, chosen)
                text += sub_text if sub_code == 0 else ""
        found += _missing_options(rest, text, code, " ".join(argv[1:]))
        found += [f"no path {a}" for a in rest if a.startswith(TOP_DIRS) and not list(REPO.glob(a.split("=")[-1]))]
    return found


def _sub_commands(help_output: str) -> list[str]:
    """The sub-commands a --help lists: a click group's under "Commands:" (up to the next blank line), and
    argparse's positional {a,b} choices in its usage (not an option's, `--dtype {float32,bfloat16}`)."""
    section = help_output.split("Commands:", 1)[1].split("\n\n", 1)[0] if "Commands:" in help_output else ""
    usage = help_output.split("\n\n", 1)[0]
    positional = []
    for before, choices in re.findall(r"(\S+)\s+\{([\w,-]+)\}", usage):
        takes_value = before.lstrip("[").startswith("-") and not before.endswith("]")    # `--dtype {a,b}`
        positional += [] if takes_value else choices.split(",")
    return re.findall(r"^  ([a-z][\w-]*)", section, re.M) + positional


def _our_packages() -> set[str]:
    return {"benchmarks", "builder", "cookbook", "recipes", "tools", "inkling_hpu", "gaudi_harness", "fixes"}


def _missing_options(args: list[str], text: str, code: int, what: str) -> list[str]:
    """The options given that no option line or usage line of the help lists (prose mentions do not count)."""
    if code != 0:
        return [f"`{what} --help` exits {code}: {text.strip().splitlines()[-1][:200] if text.strip() else ''}"]
    listed = "\n".join(line for line in text.splitlines() if re.match(r"\s*(-|usage:|Usage:|\[)", line)
                       or line.startswith(" " * 10))     # usage and option lines, and their continuations
    options = [a.split("=", 1)[0] for a in args if a.startswith("-") and a not in ("-", "--")]
    return [f"{what} has no option {option}" for option in options
            if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", listed)]


ALL = [command for path in doc_files() for command in commands(path)]


def test_the_docs_name_commands_to_check():
    assert len(ALL) >= 30, [c.where for c in ALL]
    assert {Path(c.where.split(":")[0]).name for c in ALL} >= {"README.md", "images.md"}


@pytest.mark.parametrize("command", ALL, ids=[f"{c.where} {' '.join(c.words)[:60]}" for c in ALL])
def test_each_documented_command_runs_as_written(command):
    assert not problems(command), f"{command.where}: {' '.join(command.words)}: {problems(command)}"


def test_the_checker_catches_what_drifts(tmp_path):
    """Each check can fail: a made-up target, variable, module, option, path and environment variable."""
    doc = tmp_path / "doc.md"
    doc.write_text("\n".join([
        "    make no-such-target", "    make test NO_SUCH_VARIABLE=1", "    python3 -m tools.no_such_module",
        "    python3 -m recipes.launch docker --no-such-option", "    python3 fixes/no_such_script.py",
        "    NO_SUCH_ENV=1 python3 fixes/apply_all.py --profile v0.30.0", "    bash tools/no_such.sh",
        "    python3 -m recipes.launch docker --image x && make test  # a comment --ignored",
        "    python3 -m builder nosuch", "    python3 -m builder probe --tag x",
        "    python3 -m tools.cpu_server serve --only x",
        "    docker exec c bash -c 'cd /opt && python3 -m recipes.launch docker --bogus'",
        "    VENV=$(bash tools/no_such_env.sh)"]) + "\n")
    found = {" ".join(c.words): problems(c) for c in commands(doc)}
    assert found["make no-such-target"] == ["no make target 'no-such-target'"]
    assert found["make test NO_SUCH_VARIABLE=1"] == ["the Makefile reads no variable NO_SUCH_VARIABLE"]
    assert found["python3 -m tools.no_such_module"] == ["no module tools.no_such_module in this repository"]
    assert found["python3 -m recipes.launch docker --no-such-option"] == [
        "-m recipes.launch has no option --no-such-option"]
    assert found["python3 fixes/no_such_script.py"] == ["no script fixes/no_such_script.py"]
    assert found["NO_SUCH_ENV=1 python3 fixes/apply_all.py --profile v0.30.0"] == ["NO_SUCH_ENV is read by nothing"]
    assert found["bash tools/no_such.sh"] == ["no script tools/no_such.sh"]
    assert found["python3 -m recipes.launch docker --image x"] == [] and found["make test"] == []
    assert found["python3 -m builder nosuch"] == [
        "-m builder: no sub-command 'nosuch' (it has base, base-args, build, probe)"]
    assert found["python3 -m builder probe --tag x"] == ["-m builder has no option --tag"]      # build's, not probe's
    assert found["python3 -m tools.cpu_server serve --only x"] == ["-m tools.cpu_server has no option --only"]
    assert found["python3 -m recipes.launch docker --bogus"] == ["-m recipes.launch has no option --bogus"]
    assert found["bash tools/no_such_env.sh"] == ["no script tools/no_such_env.sh"]


def test_make_help_lists_every_variable_the_makefile_takes():
    help_out = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    variables = help_out.split("Variables", 1)[1]
    listed = set(re.findall(r"^  ([A-Z_][A-Z0-9_, ]*?)\s{2,}", variables, re.M))
    listed = {name.strip() for entry in listed for name in entry.split(",")}
    settable = set(re.findall(r"^([A-Z_][A-Z0-9_]*)\s*\?=", (REPO / "Makefile").read_text(), re.M))
    assert settable >= {"PROFILE", "TP", "PP", "SERVE_ARGS", "GATES_ARGS", "PYTEST_ARGS"}, settable
    missing = [name for name in settable | {"BASE", "TAG", "VLLM_GAUDI_SRC", "COOKBOOK_CACHE"} if name not in listed]
    assert not missing, f"make help does not list {missing}"
