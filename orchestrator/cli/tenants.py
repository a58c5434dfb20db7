"""``orchestrator tenants``: make a tenant's token and the digest the deployment keeps of
it, and check a tenants file before it is deployed (docs/tenancy.md)."""

from __future__ import annotations

import secrets
import sys
from pathlib import Path
from typing import Annotated

import typer

from orchestrator.tenants import MIN_TOKEN_CHARS, Directory, TenantsError, digest, parse_tenants

app = typer.Typer(help="Tenants: tokens and their digests, and the tenants file.")


@app.command()
def token() -> None:
    """A new random token (give it to the tenant) and its digest (put it in the tenants
    file, or in ORCH_API_TOKENS for an operator's token). Only the digest is kept."""
    made = secrets.token_urlsafe(32)
    typer.echo(f"token:  {made}")
    typer.echo(f"digest: {digest(made)}")


@app.command("digest")
def digest_of() -> None:
    """The digest of a token read from standard input (one line; never an argument, which
    the shell's history would keep)."""
    presented = sys.stdin.readline().strip()
    if len(presented) < MIN_TOKEN_CHARS:
        typer.echo(f"a token is at least {MIN_TOKEN_CHARS} characters", err=True)
        raise typer.Exit(2)
    typer.echo(digest(presented))


@app.command()
def check(
    path: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True)],
) -> None:
    """Check a tenants file as the API reads it: names, digests, quotas, no credential
    given to two tenants. Prints each tenant, its credentials counted, and its quotas."""
    try:
        parsed = parse_tenants(path.read_text(), str(path))
        Directory.build([], "", parsed)
    except TenantsError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    for name, tenant in parsed.tenants.items():
        role = "admin" if tenant.admin else "tenant"
        quotas = tenant.quotas.model_dump(exclude_none=True) or "none"
        typer.echo(
            f"{name}: {role}, {len(tenant.tokens)} token(s), "
            f"{len(tenant.grader_secrets)} grader secret(s), quotas {quotas}"
        )
