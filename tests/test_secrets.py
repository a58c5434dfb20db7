"""Secrets (orchestrator/secrets.py): read where they are kept, each time; taken out of
text; never named by their value in an error. tests/e2e/test_http_tools.py runs them
through a real deployment."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.secrets import SecretSource, SecretUnreadable, read_secret, redact


def test_a_secret_is_read_from_its_file_or_variable_each_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = tmp_path / "token"
    kept.write_text("first-value\n")
    from_file = SecretSource(file=str(kept))
    assert read_secret("t", from_file) == "first-value"
    kept.write_text("rotated-value\n")  # a Kubernetes Secret's file, updated
    assert read_secret("t", from_file) == "rotated-value"
    monkeypatch.setenv("ORCH_TEST_SECRET", "from-the-environment")
    assert read_secret("v", SecretSource(env="ORCH_TEST_SECRET")) == "from-the-environment"


@pytest.mark.parametrize("where", ["missing-file", "empty-file", "unset-variable"])
def test_a_secret_that_cannot_be_read_names_itself_only(tmp_path: Path, where: str) -> None:
    (tmp_path / "empty").write_text("\n")
    source = {
        "missing-file": SecretSource(file=str(tmp_path / "nope")),
        "empty-file": SecretSource(file=str(tmp_path / "empty")),
        "unset-variable": SecretSource(env="ORCH_TEST_NO_SUCH_SECRET"),
    }[where]
    with pytest.raises(SecretUnreadable, match="secret 'key' could not be read") as found:
        read_secret("key", source)
    assert found.value.name == "key"


def test_values_are_taken_out_of_text_and_short_ones_left() -> None:
    values = {"TOKEN": "s3cr3t-value", "PIN": "42"}
    text = "token=s3cr3t-value, again s3cr3t-value; pin 42"
    assert redact(text, values) == ("token=[secret TOKEN], again [secret TOKEN]; pin 42")


def test_a_source_is_one_place() -> None:
    with pytest.raises(ValueError, match="exactly one of: file, env"):
        SecretSource(file="/f", env="V")
    with pytest.raises(ValueError, match="exactly one of: file, env"):
        SecretSource()
