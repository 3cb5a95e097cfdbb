"""Command line: `python3 fixes/apply_all.py` (and `python3 -m cookbook`).

Without a sub-command it applies: `apply_all.py --profile v0.30.0 [OPT-IN FIX...]`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from . import api, report as reports
from .errors import EXIT_BASE_MISMATCH, EXIT_FIX_FAILED, EXIT_OK, EXIT_USAGE, CookbookError
from .profiles import DEFAULT_PROFILE
from .results import Mode

EXIT_CODES_HELP = """Exit codes: 0 success (every fix patched or already applied), 1 a fix refused or
failed (the tree is unchanged), 2 base mismatch (a commit is not the profile's), 3 usage or profile
error."""


HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}   # every command's, sub-commands' included


class UsageExitGroup(click.Group):
    """click's own usage errors exit with the documented usage code (3), not click's 2 (our base
    mismatch); with --json they are one JSON object on stdout like every other error."""

    def main(self, args=None, *rest, **kwargs):
        argv = sys.argv[1:] if args is None else list(args)
        try:
            return super().main(argv, *rest, standalone_mode=False, **kwargs)
        except click.ClickException as exc:  # usage errors included
            if "--json" in argv:
                click.echo(json.dumps({"ok": False, "exit_code": EXIT_USAGE, "error": exc.format_message()}))
            else:
                exc.show()
            sys.exit(EXIT_USAGE)
        except click.Abort:
            click.echo("aborted", err=True)
            sys.exit(EXIT_FIX_FAILED)


class DefaultGroup(UsageExitGroup):
    """A group whose first argument, when it is not a sub-command, goes to `apply`."""

    def parse_args(self, ctx, args):
        if not args or args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["apply", *args]
        return super().parse_args(ctx, args)


def _roots(vllm_root, vllm_gaudi_root):
    return {"vllm": Path(vllm_root) if vllm_root else None,
            "vllm-gaudi": Path(vllm_gaudi_root) if vllm_gaudi_root else None}


def _common(func):
    options = [
        click.option("--profile", "profile", default=DEFAULT_PROFILE, show_default=True,
                     help="Profile name (profiles/NAME.yaml) or path to a profile file."),
        click.option("--vllm-root", type=click.Path(file_okay=False), help="Directory holding vllm/ (default: the installed package)."),
        click.option("--vllm-gaudi-root", type=click.Path(file_okay=False), help="Directory holding vllm_gaudi/ (default: the installed package)."),
        click.option("--target", "targets", multiple=True, help="Only this target (repeatable): vllm, vllm-gaudi."),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of lines."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _finish(rep, as_json: bool):
    click.echo(reports.to_json(rep) if as_json else reports.to_text(rep))
    sys.exit(rep.exit_code)


def _fail(exc: CookbookError, as_json: bool):
    if as_json:
        click.echo(json.dumps({"ok": False, "exit_code": exc.exit_code, "error": str(exc)}))
    else:
        click.echo(f"error: {exc}", err=True)
    sys.exit(exc.exit_code)


@click.group(cls=DefaultGroup, epilog=EXIT_CODES_HELP, context_settings=HELP_OPTIONS)
def main():
    """Gaudi cookbook fix pack: apply a profile's commit-checked source patches to vLLM and
    vllm-gaudi, all or nothing."""


@main.command(epilog=EXIT_CODES_HELP)
@_common
@click.argument("opt_ins", nargs=-1)
@click.option("--check", "dry_run", is_flag=True, help="Work everything out, write nothing.")
@click.option("--revert", is_flag=True, help="Reverse the profile's fixes (and the named opt-ins).")
@click.option("--list", "list_only", is_flag=True, help="List the profile's fixes and whether each has a patch.")
@click.option("--strict", is_flag=True, help="Refuse a patch that applies only by context (file not byte-identical to its base).")
def apply(profile, vllm_root, vllm_gaudi_root, targets, as_json, opt_ins, dry_run, revert, list_only, strict):
    """Apply the profile's fixes, then the named OPT_INS, in the pack's order."""
    try:
        if list_only:
            return _list(profile, as_json)
        if dry_run and revert:
            raise click.UsageError("--check and --revert are exclusive")
        mode = Mode.CHECK if dry_run else Mode.REVERT if revert else Mode.APPLY
        rep = api.run(api.load_profile(profile), _roots(vllm_root, vllm_gaudi_root), list(opt_ins),
                      mode=mode, only_targets=list(targets) or None, strict=strict)
    except CookbookError as exc:
        _fail(exc, as_json)
    _finish(rep, as_json)


def _list(profile_name: str, as_json: bool):
    profile = api.load_profile(profile_name)
    rows = []
    for name in profile.all_fixes:
        fix = profile.fix(name)
        rows.append({"name": name, "title": fix.title, "targets": fix.targets,
                     "kind": "opt-in" if name in profile.opt_in else "default",
                     "patch": "available" if fix.available else "not yet available",
                     "upstream": (fix.meta.get("upstream") or {}).get("status")})
    if as_json:
        click.echo(json.dumps({"profile": profile.name, "fixes": rows}, indent=2))
    else:
        click.echo(f"profile {profile.name}: {profile.description}")
        width = max(len(r["name"]) for r in rows)
        for r in rows:
            click.echo(f"  {r['name']:<{width}}  {r['kind']:<7}  {','.join(r['targets']):<10}  "
                       f"{r['patch']:<17}  {r['title']}")
    sys.exit(EXIT_OK)


@main.command(epilog=EXIT_CODES_HELP)
@_common
@click.option("--strict", is_flag=True, help="Fail when a patch applies only by context.")
def verify(profile, vllm_root, vllm_gaudi_root, targets, as_json, strict):
    """Apply every fix of the profile (opt-ins included) to a scratch copy of the given trees.

    The commit pin is reported, not enforced: this is the "patch applies cleanly" check."""
    try:
        rep = api.run(api.load_profile(profile), _roots(vllm_root, vllm_gaudi_root), [], mode=Mode.VERIFY,
                      only_targets=list(targets) or None, strict=strict)
    except CookbookError as exc:
        _fail(exc, as_json)
    _finish(rep, as_json)


@main.command(epilog=EXIT_CODES_HELP)
@_common
def identify(profile, vllm_root, vllm_gaudi_root, targets, as_json):
    """Tell each target's commit and whether it is the profile's pin (exit 2 if not)."""
    try:
        found = api.identify(api.load_profile(profile), _roots(vllm_root, vllm_gaudi_root), list(targets) or None)
    except CookbookError as exc:
        _fail(exc, as_json)
    code = EXIT_OK if all(t.matches for t in found) else EXIT_BASE_MISMATCH
    if as_json:
        click.echo(json.dumps({"ok": code == EXIT_OK, "exit_code": code,
                               "targets": [t.__dict__ for t in found]}, indent=2))
    else:
        for t in found:
            verdict = "matches" if t.matches else "DOES NOT match"
            click.echo(f"{t.name}: {t.commit or 'unknown'} at {t.root} ({t.how}) {verdict} "
                       f"the pin {t.pin} ({t.ref})")
    sys.exit(code)


@main.command()
@click.option("--profile", "profile", default=DEFAULT_PROFILE, show_default=True)
@click.option("--vllm-root", type=click.Path(exists=True, file_okay=False))
@click.option("--vllm-gaudi-root", type=click.Path(exists=True, file_okay=False))
def refresh(profile, vllm_root, vllm_gaudi_root):
    """Rewrite the profile's patches so each is exact on the base plus the earlier fixes.

    Give pristine base trees; the patches in the repository are rewritten in place."""
    roots = {t: Path(r) for t, r in _roots(vllm_root, vllm_gaudi_root).items() if r}
    if not roots:
        raise click.UsageError("give --vllm-root and/or --vllm-gaudi-root (pristine base trees)")
    try:
        for path in api.refresh(api.load_profile(profile), roots):
            click.echo(f"rewrote {path}")
    except CookbookError as exc:
        _fail(exc, False)
    sys.exit(EXIT_OK)


@main.command("manifest", epilog=EXIT_CODES_HELP)
@click.option("--profile", "profile", default=DEFAULT_PROFILE, show_default=True)
@click.option("--target", required=True, help="The target whose pinned source ROOT holds: vllm, vllm-gaudi.")
@click.argument("root", type=click.Path(exists=True, file_okay=False))
def manifest_command(profile, target, root):
    """Print the content manifest of ROOT, a pristine tree of the target's pinned commit (the file a
    profile's `content.manifest` names, for builds that record no commit)."""
    try:
        loaded = api.load_profile(profile)
        if target not in loaded.targets:
            raise click.UsageError(f"unknown target {target}; profile {loaded.name} has {', '.join(loaded.targets)}")
        pin = loaded.targets[target]
        click.echo(api.manifest(Path(root), pin.package, pin.commit), nl=False)
    except CookbookError as exc:
        _fail(exc, False)
    sys.exit(EXIT_OK)


if __name__ == "__main__":
    main()
