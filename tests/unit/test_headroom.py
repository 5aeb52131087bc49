"""`poise run` on a busy machine: the replay rate is cut to the cores left, and a run the machine could not
keep up with is told apart from one Poise failed."""

from __future__ import annotations

from loadgen.records import RequestRecord
from services.cli.headroom import Headroom, paced_rate, sample_headroom, verdict


def record(i: int, *, status: str = "ok", http: int | None = 200) -> RequestRecord:
    return RequestRecord(index=i, rid=f"r{i}", arrival_s=0.0, sent_s=0.0, first_token_s=0.1, finished_s=1.0,
                         input_tokens=10, output_tokens_expected=5, output_tokens_received=5, status=status,  # type: ignore[arg-type]
                         http_status=http)


def test_a_free_machine_replays_at_the_rate_asked_for() -> None:
    assert paced_rate(6.0, Headroom(cores=2, busy=0.2)) == 6.0


def test_a_busy_machine_gets_a_rate_cut_to_the_cores_left_but_never_below_a_quarter() -> None:
    assert paced_rate(6.0, Headroom(cores=2, busy=1.0)) == 3.0
    assert paced_rate(6.0, Headroom(cores=2, busy=1.5)) == 1.5
    assert paced_rate(6.0, Headroom(cores=2, busy=7.0)) == 1.5
    assert paced_rate(8.0, Headroom(cores=8, busy=2.0)) == 6.0


def test_the_sample_counts_other_tasks_not_itself() -> None:
    h = sample_headroom(seconds=0.05, samples=5)
    assert h.cores >= 1 and h.busy >= 0.0


def test_refusals_and_a_machine_that_fell_behind_do_not_fail_the_run_but_say_so() -> None:
    records = [record(0), record(1, status="error", http=429), record(2, status="error", http=None)]
    kept_up = verdict(records, 0.05, rate=6.0)
    assert (kept_up.machine_behind, kept_up.refused, kept_up.poise_failures, kept_up.failed) == (False, 1, 1, True)
    behind = verdict(records, 5.4, rate=6.0)
    assert (behind.machine_behind, behind.poise_failures, behind.failed) == (True, 0, False)
    assert behind.line is not None and "fell behind" in behind.line and "--rate-scale 3" in behind.line
    # an error answer is Poise's whatever the machine did
    assert verdict([*records, record(3, status="error", http=500)], 5.4, rate=6.0).failed
    assert verdict([record(0)], 0.0, rate=6.0).line is None
