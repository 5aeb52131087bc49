"""Bad command-line input gets a one-line ``poise: ...`` error and an exit code, never a traceback, and
``poise run`` refuses a bad slice before it brings the stack up."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli.main import main


def _exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return int(exc.value.code or 0)


def test_an_unknown_trace_names_the_known_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["sim", "--trace", "no-such-trace", "--out-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("poise: trace file not found: no-such-trace") and "azure-conv" in err
    assert "Traceback" not in err


def test_a_file_that_is_not_a_trace_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    assert _exit_code(["sim", "--trace", str(notes), "--out-dir", str(tmp_path)]) == 1
    assert "unsupported trace format" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--rate-scale", "-1"], ["--rate-scale", "0"], ["--duration-s", "0"]])
def test_out_of_range_numbers_are_refused_by_the_settings(flag: list[str], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["sim", "--trace", "azure-code", *flag, "--out-dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "greater than 0" in captured.out + captured.err and "Traceback" not in captured.err


def test_poise_run_refuses_a_bad_trace_before_starting_anything(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    assert _exit_code(["run", "--trace", "no-such-trace", "--run-dir", str(run_dir), "--gateway-port", "0",
                       "--monitor-port", "0"]) == 1
    assert capsys.readouterr().err.startswith("poise: trace file not found")
    assert not run_dir.exists()  # no process was started (each logs into the run dir)
