"""The lake writer lease's time to live, read from CLAWPIPE_LAKE_LEASE_TTL where a writer takes the lease."""

from __future__ import annotations

import pytest

from clawpipe.errors import LakeError
from clawpipe.lake.lease import TTL_ENV, default_ttl


@pytest.mark.parametrize(("raw", "ttl"), [(None, 60.0), ("", 60.0), ("2", 2.0), ("0.2", 1.0), ("90.5", 90.5)])
def test_the_lease_lives_as_long_as_the_variable_says_at_least_a_second(
    monkeypatch: pytest.MonkeyPatch, raw: str | None, ttl: float
) -> None:
    if raw is None:
        monkeypatch.delenv(TTL_ENV, raising=False)
    else:
        monkeypatch.setenv(TTL_ENV, raw)
    assert default_ttl() == ttl


@pytest.mark.parametrize("raw", ["abc", "0", "-5", "nan", "inf"])
def test_a_bad_lease_time_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    # before: taken as 60 s (or 1 s) without a word
    monkeypatch.setenv(TTL_ENV, raw)
    with pytest.raises(LakeError, match=f"CLAWPIPE_LAKE_LEASE_TTL='{raw}': give the lease's time to live"):
        default_ttl()
