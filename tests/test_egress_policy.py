"""Egress policies without a network (tests/e2e/test_egress.py runs them for real): what a
policy accepts, what a request may narrow it to, the E2B options' mapping, and the
deployments an environment with a policy is refused on."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from orchestrator.config import Settings
from orchestrator.e2b.models import NewSandbox
from orchestrator.e2b.sandboxes import BadRequest, asked_egress
from orchestrator.environments.loader import EnvironmentConfigError, parse_environments
from orchestrator.sandbox.backend import SandboxSpec
from orchestrator.sandbox.docker.egress import nft_rules
from orchestrator.sandbox.egress import NO_EGRESS, EgressPolicy, EgressRefused

POLICY = EgressPolicy(allow_domains=["pypi.org", "*.example.com"], allow_cidrs=["10.2.0.0/16"])


def test_a_policy_is_normalised_so_equal_policies_share_a_digest() -> None:
    assert POLICY.allow_domains == ("example.com", "pypi.org")
    same = EgressPolicy(allow_domains=["PyPI.org.", "example.com"], allow_cidrs=["10.2.3.4/16"])
    assert same == POLICY and same.digest == POLICY.digest
    assert EgressPolicy().allows_nothing and not POLICY.allows_nothing
    assert POLICY.allows_domain("files.pypi.org") and not POLICY.allows_domain("notpypi.org")


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("allow_domains", ["localhost"], "is not a domain"),
        ("allow_domains", ["pypi.org/simple"], "is not a domain"),
        ("allow_domains", "pypi.org", "a list of domains"),
        ("allow_cidrs", ["0.0.0.0/0"], "allows every address"),
        ("allow_cidrs", ["fd00::/8"], "IPv6 egress is not supported"),
        ("allow_cidrs", ["10.0.0.300"], "is not an IPv4 address"),
    ],
)
def test_a_wrong_entry_says_what_is_wrong(field: str, value: Any, says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        EgressPolicy.model_validate({field: value})


def test_a_request_narrows_and_never_widens() -> None:
    narrowed = POLICY.narrowed(["files.pypi.org", "10.2.9.0/24", "10.2.0.7"])
    assert narrowed.allow_domains == ("files.pypi.org",)
    assert narrowed.allow_cidrs == ("10.2.0.7/32", "10.2.9.0/24")
    for wider in ("10.0.0.0/8", "10.3.0.1", "evil.org", "org"):
        with pytest.raises(EgressRefused, match="allowOut"):
            POLICY.narrowed([wider])


def _asked(**body: Any) -> EgressPolicy | None:
    return asked_egress(POLICY, NewSandbox.model_validate(body))


def test_e2b_options_map_onto_the_policy() -> None:
    assert _asked() is None  # the template's own
    assert _asked(allow_internet_access=True) is None
    assert _asked(allow_internet_access=False) == NO_EGRESS
    assert _asked(allowInternetAccess=False) == NO_EGRESS
    assert _asked(network={"denyOut": ["0.0.0.0/0"]}) == NO_EGRESS
    # allowOut wins over denyOut, as on E2B.
    asked = _asked(network={"allowOut": ["pypi.org"], "denyOut": ["0.0.0.0/0"]})
    assert asked == EgressPolicy(allow_domains=["pypi.org"])
    # Denying what the template never allowed changes nothing.
    assert _asked(network={"denyOut": ["192.168.0.0/16"]}) is None


@pytest.mark.parametrize(
    ("network", "says"),
    [
        ({"allowOut": ["evil.org"]}, "outside this template's egress policy"),
        ({"denyOut": ["10.2.1.0/24"]}, "overlaps what the template allows"),
        ({"denyOut": ["nowhere"]}, "is not an address or CIDR"),
        ({"rules": {"api.example.com": {}}}, "not supported"),
        ({"egressProxy": {"address": "socks5://x"}}, "not supported"),
    ],
)
def test_e2b_options_it_cannot_honour_are_refused(network: dict[str, Any], says: str) -> None:
    with pytest.raises(BadRequest, match=says):
        _asked(network=network)


def test_the_rules_refuse_everything_but_the_allowed_set_and_dns() -> None:
    text = nft_rules("k1", "oegk1", "10.231.0.1", POLICY)
    assert "add element inet orchestrator_egress allow_k1 { 10.2.0.0/16 }" in text
    assert 'oifname "oegk1" drop' in text  # sandbox to sandbox
    assert "ip daddr 10.231.0.1 udp dport 53 return" in text
    assert text.count("reject with tcp reset") == 2  # out of the bridge, into the host
    assert "ct state established,related return" in text


ENV = {"name": "net", "tools": ["shell"], "grader": {"name": "file_f1"}}


@pytest.mark.parametrize(
    ("settings", "runtime", "says"),
    [
        ({"sandbox_backend": "kubernetes"}, None, "enforced by the Docker backend only"),
        ({}, "runsc", "needs runtime runc"),
        ({"sandbox_runtime": "runsc"}, None, "needs runtime runc"),
    ],
)
def test_an_environment_with_egress_is_refused_where_it_cannot_be_enforced(
    settings: dict[str, Any], runtime: str | None, says: str
) -> None:
    env = ENV | {"egress": {"allow_domains": ["pypi.org"]}}
    if runtime:
        env["runtime"] = runtime
    text = yaml.safe_dump({"environments": [env]})
    with pytest.raises(EnvironmentConfigError, match=says):
        parse_environments(text, Settings(**settings))


def test_an_environment_without_egress_keeps_its_digest() -> None:
    registry = parse_environments(yaml.safe_dump({"environments": [ENV]}), Settings())
    config = registry.get("net")
    assert "egress" not in config.snapshot  # pinned rollouts from before still find it
    with_policy = parse_environments(
        yaml.safe_dump({"environments": [ENV | {"egress": {"allow_cidrs": ["10.0.0.1"]}}]}),
        Settings(),
    ).get("net")
    assert with_policy.digest != config.digest


def test_a_spec_says_no_network_one_way() -> None:
    """An empty policy is made None, so a backend asks one question (spec.egress is None)."""
    assert SandboxSpec(image="i", egress=EgressPolicy()).egress is None
    assert SandboxSpec(image="i", egress=POLICY).egress == POLICY
