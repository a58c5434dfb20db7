"""Egress policy: where a sandbox may open connections. Nowhere is the default.

A policy is an allowlist of domains and IPv4 CIDRs. The backend enforces it outside the
sandbox (sandbox/docker/egress.py: a network of its own per policy, nftables rules and a
DNS server that answers only allowed names); whatever else the agent tries is refused as
its own failed connection, a result its tool call returns and the grader scores
(docs/egress.md).
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field, field_validator

_LABEL = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
DOMAIN_RE = re.compile(rf"^{_LABEL}(\.{_LABEL})+$")
"""A domain with at least two labels: ``pypi.org``, ``files.pythonhosted.org``."""

ALL_TRAFFIC = "0.0.0.0/0"
"""What E2B's SDK calls ALL_TRAFFIC: its ``deny_out`` of it is "no internet"."""


class EgressRefused(ValueError):
    """A request asked for more than the policy allows (a 400: nothing changes)."""


def _domain(value: str) -> str:
    name = value.strip().lower().rstrip(".")
    # "*.example.com" says what "example.com" already means: a domain allows its subdomains.
    name = name.removeprefix("*.")
    if not DOMAIN_RE.fullmatch(name):
        raise ValueError(
            f"{value!r} is not a domain (e.g. pypi.org; a domain allows its subdomains too)"
        )
    return name


def _cidr(value: str) -> ipaddress.IPv4Network:
    try:
        network = ipaddress.ip_network(value.strip(), strict=False)
    except ValueError:
        raise ValueError(f"{value!r} is not an IPv4 address or CIDR (e.g. 10.1.2.0/24)") from None
    if not isinstance(network, ipaddress.IPv4Network):
        raise ValueError(f"{value!r}: IPv6 egress is not supported (sandbox networks are IPv4)")
    if network.prefixlen == 0:
        raise ValueError(
            f"{value!r} allows every address: name the networks the sandbox needs (a "
            "deny-by-default policy is the point)"
        )
    return network


class EgressPolicy(BaseModel):
    """An allowlist: the domains (each with its subdomains) and IPv4 networks a sandbox may
    connect to, on any port. Empty: no network at all, as without a policy. The sandbox's
    host is never reachable, whatever the list says; DNS answers only the allowed names."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    allow_domains: tuple[str, ...] = Field(
        (),
        description="Domains it may resolve and connect to, each with its subdomains "
        "(pypi.org allows files.pypi.org; *.pypi.org means the same).",
    )
    allow_cidrs: tuple[str, ...] = Field(
        (), description="IPv4 addresses or networks it may connect to (10.2.0.0/16)."
    )

    @field_validator("allow_domains", mode="before")
    @classmethod
    def _domains_valid(cls, value: Iterable[str]) -> tuple[str, ...]:
        if isinstance(value, str):
            raise ValueError("a list of domains")
        return tuple(sorted({_domain(v) for v in value}))

    @field_validator("allow_cidrs", mode="before")
    @classmethod
    def _cidrs_valid(cls, value: Iterable[str]) -> tuple[str, ...]:
        if isinstance(value, str):
            raise ValueError("a list of addresses or CIDRs")
        return tuple(sorted({str(_cidr(v)) for v in value}))

    @property
    def allows_nothing(self) -> bool:
        """No domain and no network: the sandbox gets no network at all."""
        return not self.allow_domains and not self.allow_cidrs

    @property
    def networks(self) -> list[ipaddress.IPv4Network]:
        """:attr:`allow_cidrs` as networks."""
        return [ipaddress.IPv4Network(c) for c in self.allow_cidrs]

    @property
    def digest(self) -> str:
        """Ten hex digits naming this policy: sandboxes of equal policies share a network."""
        text = "\n".join(("d:" + "\n".join(self.allow_domains), "c:" + "\n".join(self.allow_cidrs)))
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    def allows_domain(self, name: str) -> bool:
        """Whether ``name`` is an allowed domain or one of their subdomains."""
        return any(name == d or name.endswith("." + d) for d in self.allow_domains)

    def narrowed(self, allow_out: Iterable[str]) -> EgressPolicy:
        """The policy of only ``allow_out`` (domains, addresses, CIDRs), each of which this
        policy must allow already: a request can narrow the operator's policy, never widen
        it. Raises :class:`EgressRefused` naming the first entry that is not allowed."""
        domains: list[str] = []
        cidrs: list[str] = []
        for entry in allow_out:
            try:
                network = _cidr(entry)
            except ValueError:
                network = None
            if network is not None:
                if not any(network.subnet_of(allowed) for allowed in self.networks):
                    raise EgressRefused(
                        f"allowOut {entry!r} is outside this template's egress policy "
                        f"(allowed networks: {', '.join(self.allow_cidrs) or 'none'})"
                    )
                cidrs.append(str(network))
                continue
            try:
                name = _domain(entry)
            except ValueError as exc:
                raise EgressRefused(f"allowOut: {exc}") from None
            if not self.allows_domain(name):
                raise EgressRefused(
                    f"allowOut {entry!r} is outside this template's egress policy "
                    f"(allowed domains: {', '.join(self.allow_domains) or 'none'})"
                )
            domains.append(name)
        return EgressPolicy(allow_domains=tuple(domains), allow_cidrs=tuple(cidrs))


NO_EGRESS = EgressPolicy()
