"""The sustained bench's summary names every command a row's searches came from."""

from __future__ import annotations

from tests.bench.sustained import commands_for_row, row_commands

WHOLE = "python -m tests.bench.sustained"
POISE = "python -m tests.bench.sustained --policies poise --workloads stress-step"
BEST = "python -m tests.bench.sustained --policies static-best+poise-engines --workloads stress-step"


def test_a_row_re_run_in_part_keeps_the_commands_of_its_other_searches() -> None:
    after_poise = commands_for_row([WHOLE], POISE, summarize=False, partial=True)
    assert after_poise == [WHOLE, POISE]
    assert commands_for_row(after_poise, BEST, summarize=False, partial=True) == [WHOLE, POISE, BEST]
    assert commands_for_row([WHOLE, POISE], POISE, summarize=False, partial=True) == [WHOLE, POISE]


def test_a_whole_re_run_names_itself_and_a_summary_keeps_the_rows_own() -> None:
    assert commands_for_row([WHOLE, POISE], WHOLE, summarize=False, partial=False) == [WHOLE]
    assert commands_for_row([WHOLE, POISE], "python -m tests.bench.sustained --summarize", summarize=True,
                            partial=False) == [WHOLE, POISE]


def test_rows_written_with_one_command_still_read() -> None:
    assert row_commands({"command": WHOLE}) == [WHOLE]
    assert row_commands({"commands": [WHOLE, POISE]}) == [WHOLE, POISE]
