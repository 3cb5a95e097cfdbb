"""`python3 -m builder`: probe a base image, build the port image on it (`make image`), and build
the stock base from the top-level Dockerfile with the profile's pins."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click

from cookbook import api
from cookbook.cli import HELP_OPTIONS, UsageExitGroup
from cookbook.errors import EXIT_BASE_MISMATCH, EXIT_OK, CookbookError
from cookbook.profiles import DEFAULT_PROFILE, load_profile

from . import image, probe as probes
from .docker_io import connect, stderr_log
from .errors import EXIT_CODES_HELP


def _emit_error(exc: CookbookError, as_json: bool):
    if as_json:
        click.echo(json.dumps({"ok": False, "exit_code": exc.exit_code, "error": str(exc),
                               **getattr(exc, "details", {})}, indent=2))
    else:
        click.echo(f"error: {exc}", err=True)
    sys.exit(exc.exit_code)


# Progress always goes to stderr, so --json leaves stdout to the one JSON object.
@click.group(cls=UsageExitGroup, epilog=EXIT_CODES_HELP, context_settings=HELP_OPTIONS)
def main():
    """Gaudi cookbook image builder (Docker Engine API). Base images are judged by their
    contents: a throw-away container runs the cookbook's probe, never trusting tags or labels."""


@main.command(epilog=EXIT_CODES_HELP)
@click.option("--base", required=True, help="Base image (a stock vllm-gaudi releases/v0.30.0 image).")
@click.option("--profile", default=DEFAULT_PROFILE, show_default=True,
              help="Profile name or a profile file inside this repository.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def probe(base, profile, as_json):
    """Report the vLLM and vllm-gaudi commits inside BASE and whether it matches the profile
    (exit 2 if it does not)."""
    try:
        loaded = load_profile(profile)
        found = probes.probe_image(connect(), base, loaded)
        problems = api.check_probe(loaded, found)
    except CookbookError as exc:
        _emit_error(exc, as_json)
    code = EXIT_BASE_MISMATCH if problems else EXIT_OK
    if as_json:
        click.echo(json.dumps({"ok": not problems, "exit_code": code, "base": base,
                               "profile": profile, "problems": problems, "probe": found}, indent=2))
    else:
        for target, entry in found.items():
            click.echo(f"{target:<11} commit {entry.get('commit') or 'unidentified'} ({entry.get('how')})")
            click.echo(f"{'':<11} checkout {entry.get('checkout')}: {entry.get('checkout_commit')}; "
                       f"installed matches checkout: {entry.get('installed_matches_checkout')}")
        click.echo("MATCHES profile " + profile if not problems else
                   "DOES NOT MATCH profile " + profile + ":\n  " + "\n  ".join(problems))
    sys.exit(code)


@main.command("build", epilog=EXIT_CODES_HELP)
@click.option("--base", required=True, help="Base image (a stock vllm-gaudi releases/v0.30.0 image).")
@click.option("--tag", required=True, help="Tag for the port image.")
@click.option("--profile", default=DEFAULT_PROFILE, show_default=True,
              help="Profile the base must match (name, or a profile file inside this repository).")
@click.option("--port-profile", default=image.PORT_PROFILE, show_default=True,
              help="The port's series (its two runner patches: decode-window, conv-snapshot-pages).")
@click.option("--no-preflight", is_flag=True, help="Skip the CPU preflight inside the new image.")
@click.option("--no-cache", is_flag=True, help="Build every step again (a cold build; also re-probes).")
@click.option("--reprobe", is_flag=True,
              help="Probe the base even if this image id was probed before (results are kept per image id).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout (progress on stderr).")
def build_port_image(base, tag, profile, port_profile, no_preflight, no_cache, reprobe, as_json):
    """`make image`: probe BASE, refuse it unless it is the profile's, build ports/inkling-small/Dockerfile on
    it, label the result and run the port's preflight inside it."""
    try:
        result = image.make_image(base, tag, load_profile(profile), load_profile(port_profile),
                                  not no_preflight, stderr_log, nocache=no_cache, probe_cache=not reprobe)
    except CookbookError as exc:
        _emit_error(exc, as_json)
    if as_json:
        click.echo(json.dumps({"ok": True, "exit_code": 0, **dataclasses.asdict(result)}, indent=2))
    else:
        click.echo(f"{tag}: {result.image_id[:19]} built on {base} in {result.build_seconds:.1f}s "
                   f"({result.cached_steps}/{result.cacheable_steps} steps from cache); preflight "
                   f"{'passed' if result.preflight else 'not run'}")
    sys.exit(EXIT_OK)


@main.command("base-args", epilog=EXIT_CODES_HELP)
@click.option("--profile", default=DEFAULT_PROFILE, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def base_args(profile, as_json):
    """The top-level Dockerfile's build args, from the profile (as --build-arg flags)."""
    try:
        args = image.base_buildargs(load_profile(profile))
    except CookbookError as exc:
        _emit_error(exc, as_json)
    if as_json:
        click.echo(json.dumps(args, indent=2))
    else:
        click.echo(" ".join(f"--build-arg {k}={v}" for k, v in args.items()))


@main.command(epilog=EXIT_CODES_HELP)
@click.option("--base-image", required=True,
              help="Habana's PyTorch installer image for the profile's Gaudi SW release.")
@click.option("--tag", required=True)
@click.option("--profile", default=DEFAULT_PROFILE, show_default=True)
@click.option("--vllm-src", type=click.Path(exists=True, file_okay=False),
              help="Local vLLM tree instead of a clone at the profile's commit.")
@click.option("--vllm-gaudi-src", type=click.Path(exists=True, file_okay=False),
              help="Local vllm-gaudi tree instead of a clone at the profile's commit.")
@click.option("--json", "as_json", is_flag=True)
def base(base_image, tag, profile, vllm_src, vllm_gaudi_src, as_json):
    """Build the stock releases/v0.30.0 base (top-level Dockerfile) with the profile's pins."""
    try:
        result = image.build_stock_base(connect(), base_image, tag, load_profile(profile),
                                        Path(vllm_src) if vllm_src else None,
                                        Path(vllm_gaudi_src) if vllm_gaudi_src else None)
    except CookbookError as exc:
        _emit_error(exc, as_json)
    if as_json:
        click.echo(json.dumps({"ok": True, "exit_code": 0, "tag": tag, "image_id": result.image_id,
                               "seconds": result.seconds}, indent=2))
    else:
        click.echo(f"{tag}: {result.image_id[:19]} in {result.seconds:.1f}s")
