"""Signals (cdcd.snapshot.signals): only those holding the key may ask this daemon for a
snapshot; signals for other slots, unsigned, tampered, malformed or replayed ones are ignored."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from cdcd.config import load_config
from cdcd.pipeline.progress import ProgressTracker
from cdcd.snapshot.incremental import IncrementalSnapshot
from cdcd.snapshot.signals import KEY_ENV, key_path, sign, signal_key, verify
from cdcd.stats import Stats
from tests.e2e import write_config

KEY = b"k" * 32


def test_a_signed_signal_is_accepted_for_its_slot_only() -> None:
    content = sign(KEY, "cdcd", ["public.t", "s.u"])
    verdict = verify(KEY, "cdcd", content)
    assert verdict.tables == ["public.t", "s.u"] and verdict.why == "" and len(verdict.id) == 32
    other = verify(KEY, "other", content)
    assert other.tables is None and other.other_slot


@pytest.mark.parametrize(
    "content, why",
    [
        (b"not json", "not JSON"),
        (b"[1]", "not a JSON object"),
        (json.dumps({"tables": ["public.t"]}), "unsigned"),  # what cdcd wrote before keys
        (sign(b"another key", "cdcd", ["public.t"]), "does not match"),
    ],
    # fixed ids: a signed signal holds a random id, and pytest-xdist's workers must collect
    # the same test names
    ids=["not-json", "not-an-object", "unsigned", "another-key"],
)
def test_unsigned_forged_and_malformed_signals_are_refused(content: bytes | str, why: str) -> None:
    verdict = verify(KEY, "cdcd", content)
    assert verdict.tables is None and why in verdict.why and not verdict.other_slot


def test_a_tampered_signal_is_refused() -> None:
    payload = json.loads(sign(KEY, "cdcd", ["public.t"]))
    payload["tables"] = ["public.secret"]
    assert verify(KEY, "cdcd", json.dumps(payload)).tables is None
    payload = json.loads(sign(KEY, "cdcd", ["public.t"]))
    payload["extra"] = 1  # fields outside the mac
    assert verify(KEY, "cdcd", json.dumps(payload)).tables is None


def test_the_key_comes_from_the_config_the_environment_or_a_private_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    assert signal_key("configured", tmp_path, "s") == (b"configured", None)
    key, made = signal_key(None, tmp_path, "s")
    assert made == key_path(tmp_path, "s") and len(key) == 64
    assert stat.S_IMODE(made.stat().st_mode) == 0o600
    assert signal_key(None, tmp_path, "s") == (key, None)  # the same key next time
    monkeypatch.setenv(KEY_ENV, "from-env")
    assert signal_key(None, tmp_path, "s") == (b"from-env", None)


def test_the_daemon_takes_a_signal_once_and_ignores_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "secret")
    config = load_config(write_config(tmp_path, "postgresql://cdc@127.0.0.1:1/db"))
    snap = IncrementalSnapshot(config, None, ProgressTracker(1), Stats())
    slot = config.source.slot
    good = sign(b"secret", slot, ["public.t"]).encode()
    snap._signalled(sign(b"guessed", slot, ["public.t"]).encode(), 100)
    snap._signalled(json.dumps({"tables": ["public.t"]}).encode(), 110)
    snap._signalled(sign(b"secret", "another_slot", ["public.t"]).encode(), 120)
    assert snap.state.pending() == []
    snap._signalled(good, 130)
    assert snap.state.pending() == ["public.t"]
    snap.state.tables["public.t"]["status"] = "done"
    snap._signalled(good, 130)  # sent again after a restart
    snap._signalled(good, 140)  # the same signal written again (a replay)
    assert snap.state.pending() == []
    assert IncrementalSnapshot(config, None, ProgressTracker(1), Stats()).state.signals == [
        json.loads(good)["id"]
    ]
