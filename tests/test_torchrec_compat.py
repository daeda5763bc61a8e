"""TorchRec's private names behind one fence (`cubic_harness.torchrec_compat`): the installed TorchRec has every
one, a TorchRec that lacks one fails in one line naming its version and the name before any rank starts, and the
backend touches no private TorchRec name outside the fence."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import require

ROOT = Path(__file__).resolve().parents[1]


def test_the_installed_torchrec_has_every_private_name_the_backend_uses() -> None:
    require("torchrec")
    from cubic_harness import torchrec_compat as compat

    assert compat.missing() == []
    compat.check()


def test_a_torchrec_without_one_fails_in_one_line_naming_its_version_and_the_name(monkeypatch) -> None:
    require("torchrec")
    from cubic_harness import torchrec_compat as compat
    from cubic_harness.errors import ConfigError

    moved = compat.Private(compat.DMPC, "_default_ctx_v2", "init", "a name a later TorchRec might use")
    monkeypatch.setattr(compat, "PRIVATE", (*compat.PRIVATE, moved))
    compat.check.cache_clear()
    try:
        with pytest.raises(ConfigError) as e:
            compat.check()
    finally:
        compat.check.cache_clear()
    msg = str(e.value)
    assert "\n" not in msg and re.match(r"TorchRec \d+\.\d+\.\d+ lacks DMPCollection\._default_ctx_v2, ", msg), msg
    assert "harness/torchrec_compat.py" in msg and compat.SUPPORTED in msg


def test_an_instance_missing_a_private_attribute_fails_in_one_line() -> None:
    require("torchrec")
    from cubic_harness import torchrec_compat as compat
    from cubic_harness.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^TorchRec \S+: object\._default_ctx is gone"):
        compat.dmp_context(object())


def test_no_private_torchrec_name_outside_the_fence() -> None:
    """The backend reads the names in `PRIVATE` of TorchRec's objects only through the compat module's
    accessors; what remains in its files is its own subclasses' (`self._device`, an override's `super()`)."""
    from cubic_harness import torchrec_compat as compat

    names = {p.name for p in compat.PRIVATE} | {compat.IN_BACKWARD_OPTIMIZERS}
    files = sorted(set((ROOT / "harness").glob("torchrec_*.py")) - {ROOT / "harness/torchrec_compat.py"})
    assert {"torchrec_trial.py", "torchrec_train.py", "torchrec_kernel.py"} <= {f.name for f in files}
    for f in files:
        text = f.read_text()
        for n in names:
            uses = [m[0] for m in re.finditer(rf"(?<![`\w])(\w+)\.{n}\b", text) if m[1] != "self"]  # `doc`
            assert not uses, (f, n, uses)
