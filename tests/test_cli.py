"""The ``lpfa`` command line: every verb is listed with a description and dispatches to its module's ``main``."""

import importlib

import pytest

from lpfa import cli

VERBS = ("book", "tokens", "train", "launch", "replay", "structure", "sfa-sweep", "doctor")


@pytest.mark.parametrize("argv", [[], ["--help"], ["-h"]])
def test_no_verb_or_help_lists_every_verb(argv, capsys):
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    listed = {line.split()[0]: line for line in out.split("verbs:")[1].splitlines() if line.strip()}
    assert set(listed) == set(VERBS)
    for verb, line in listed.items():
        assert len(line.split()) > 3, f"{verb} has no description"


def test_unknown_verb_is_one_line_naming_it_and_the_verbs(capsys):
    assert cli.main(["trian"]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and "'trian'" in lines[0] and all(v in lines[0] for v in VERBS)


@pytest.mark.parametrize("verb", [v for v in VERBS if v != "tokens"])
def test_every_verb_dispatches_to_its_module_main(verb, monkeypatch):
    module = importlib.import_module(cli.VERBS[verb][0])
    seen = []
    monkeypatch.setattr(module, "main", lambda argv: seen.append(argv) or 7)
    assert cli.main([verb, "--x", "y=1"]) == 7
    assert seen == [["--x", "y=1"]]


def test_train_help_is_the_module_help(capsys):
    from lpfa import train

    assert cli.main(["train", "--help"]) == 0
    via_cli = capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        train.main(["--help"])
    assert e.value.code == 0
    assert via_cli == capsys.readouterr().out
    for preset in train.PRESETS:  # each preset and each field, with its type and default
        assert f"  {preset}" in via_cli
    assert "max_steps (int, default " in via_cli and "attn_policy (" in via_cli
    assert cli.main(["train", "--help-all"]) == 0  # every field, by section
    assert "\nbookkeeping fields (" in capsys.readouterr().out


@pytest.mark.parametrize("verb", [v for v in VERBS if v not in ("tokens", "train")])
def test_every_verb_has_help(verb, capsys):
    assert cli.main([verb, "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage:")


def test_usage_error_in_a_verb_returns_its_status(capsys):
    assert cli.main(["structure"]) == 2  # --run and --out are required
    assert "required" in capsys.readouterr().err


def test_tokens(tmp_path, capsys):
    src = tmp_path / "txt"
    src.mkdir()
    (src / "a.txt").write_text("hello world, " * 400)
    assert cli.main(["tokens", str(src), str(tmp_path / "out"), "--tokenizer", "bytes"]) == 0
    assert "train /" in capsys.readouterr().out
    assert (tmp_path / "out" / "train.bin").is_file()
    assert cli.main(["tokens", str(src)]) == 2  # a usage error is one line
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_module_without_main_runs_as_python_m(monkeypatch, capsys):
    """A verb whose module has no main(argv) runs through runpy with sys.argv set."""
    import sys
    import types

    mod = types.ModuleType("lpfa_fake_verb")
    monkeypatch.setitem(sys.modules, "lpfa_fake_verb", mod)
    monkeypatch.setitem(cli.VERBS, "fake", ("lpfa_fake_verb", "a stand-in"))
    ran = []
    monkeypatch.setattr(cli.runpy, "run_module", lambda name, run_name, alter_sys: ran.append((name, list(sys.argv))))
    assert cli.main(["fake", "a", "b"]) == 0
    assert ran == [("lpfa_fake_verb", ["lpfa_fake_verb", "a", "b"])]
