"""tests/fixtures/atomic_build.py: the tiny models' builds land whole or not at all (fake builds, no model)."""

from __future__ import annotations

import signal

import pytest

from tests.fixtures.atomic_build import build_atomically


@pytest.fixture(autouse=True)
def keep_pytests_sigterm(monkeypatch):
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # a build's SIGTERM handler is for its own process


def complete(out):
    return (out / "done").is_file()


def writes(text: str):
    def build(tmp):
        (tmp / "weights").write_text(text)
        (tmp / "done").write_text("")
        return {"seconds": 1.5}
    return build


def leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_a_build_lands_in_out_and_leaves_nothing_beside_it(tmp_path, capsys):
    out = tmp_path / "models" / "tiny"
    assert build_atomically(out, writes("new"), complete) == 0
    assert (out / "weights").read_text() == "new" and leftovers(out.parent) == []
    assert capsys.readouterr().out == f"wrote {out} in 1.5 s\n"


def test_a_complete_out_is_kept_unless_forced(tmp_path, capsys):
    out = tmp_path / "tiny"
    build_atomically(out, writes("old"), complete)
    capsys.readouterr()
    assert build_atomically(out, writes("new"), complete) == 0
    assert (out / "weights").read_text() == "old"
    assert capsys.readouterr().out == f"{out} is already complete; use --force to rebuild\n"
    build_atomically(out, writes("new"), complete, force=True)
    assert (out / "weights").read_text() == "new" and leftovers(tmp_path) == []


def test_a_failed_build_leaves_the_old_out_as_it_was_and_no_temporary(tmp_path):
    out = tmp_path / "tiny"
    build_atomically(out, writes("old"), complete)

    def fails(tmp):
        (tmp / "weights").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_atomically(out, fails, complete, force=True)
    assert (out / "weights").read_text() == "old" and leftovers(tmp_path) == []


def test_an_out_another_process_completed_meanwhile_is_kept(tmp_path, capsys):
    out = tmp_path / "tiny"

    def races(tmp):
        writes("theirs")(out.mkdir() or out)  # the other worker's build lands first
        return writes("ours")(tmp)

    assert build_atomically(out, races, complete) == 0
    assert (out / "weights").read_text() == "theirs" and leftovers(tmp_path) == []
    assert capsys.readouterr().out == f"{out} was completed by another build meanwhile; kept it\n"
