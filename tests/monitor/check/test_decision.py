import pytest

from decode.acceptance import break_even_alpha, expected_speedup
from monitor.check.decision import EXIT_DRIFT, EXIT_ERROR, EXIT_OK, Cause, Status, decide
from monitor.stats.acceptance_tests import AcceptanceCheck, DropTest, TrafficDrift


def _test(alarm: bool) -> DropTest:
    return DropTest("delta", 0.7, 0.6 if alarm else 0.7, 0.1 if alarm else 0.0, 0.05, 0.15,
                    0.001 if alarm else 0.9, alarm, 0.01, 0.025, 256, 256)


def _drift(drifted: bool) -> TrafficDrift:
    return TrafficDrift(0.2 if drifted else 0.01, 1.0, drifted, 0.05, 256, 10000, 10000)


@pytest.mark.parametrize(
    "fp_changed, paired_alarm, unpaired_alarm, drifted, live, status, cause",
    [
        (False, False, False, False, 0.7, Status.OK, None),
        (True, False, False, False, 0.7, Status.OK, None),  # new target, draft still fits
        (False, False, False, True, 0.7, Status.OK, None),  # new traffic, draft still fits
        (True, True, False, False, 0.7, Status.DRIFT, Cause.TARGET_CHANGED),
        (False, False, True, True, 0.7, Status.DRIFT, Cause.TRAFFIC_SHIFTED),
        (True, True, True, True, 0.7, Status.DRIFT, Cause.BOTH),
        (False, True, False, False, 0.7, Status.DRIFT, Cause.UNEXPLAINED),
        (False, False, False, False, 0.3, Status.DRIFT, Cause.UNEXPLAINED),  # absolute alarm alone
        (True, False, False, False, 0.3, Status.DRIFT, Cause.TARGET_CHANGED),
    ],
)
def test_decision_table(fp_changed, paired_alarm, unpaired_alarm, drifted, live, status, cause):
    d = decide(champion_target_fingerprint="aaa", current_target_fingerprint="bbb" if fp_changed else "aaa",
               acceptance=AcceptanceCheck(_test(paired_alarm), _test(unpaired_alarm)), drift=_drift(drifted),
               current_acceptance=live, break_even=0.4, acceptance_source="live")
    assert d.status is status and d.cause is cause
    assert d.exit_code == (EXIT_DRIFT if status is Status.DRIFT else EXIT_OK)
    assert len(d.reasons) == paired_alarm + unpaired_alarm + (live < 0.4)
    assert any("fingerprint" in n for n in d.notes) == fp_changed
    assert d.to_dict()["status"] == status.value


def test_decision_without_unpaired_or_drift_and_missing_tag():
    d = decide(champion_target_fingerprint=None, current_target_fingerprint="bbb",
               acceptance=AcceptanceCheck(_test(True), None), drift=None, current_acceptance=0.6, break_even=0.4)
    assert d.status is Status.DRIFT and d.cause is Cause.UNEXPLAINED
    assert d.notes == ["champion has no target fingerprint tag"]
    assert (EXIT_OK, EXIT_DRIFT) == (0, 3)


def test_break_even_alpha():
    # gamma=1, c=0.5, v=1: (1 + a) / 1.5 = 1  ->  a = 0.5
    assert break_even_alpha(1, 0.5, 1.0) == pytest.approx(0.5)
    a = break_even_alpha(5, 0.1, 1.0)
    assert expected_speedup(a, 5, 0.1, 1.0) == pytest.approx(1.0)
    assert 0.33 < a < 0.34
    assert break_even_alpha(5, 0.0, 0.5) == 0.0  # verify cheaper than one step: always pays
    assert break_even_alpha(1, 2.0, 1.0) == 1.0  # draft slower than the target: never pays


def test_a_non_finite_acceptance_is_an_error_never_ok():
    """NaN compares False with everything: it must not slip through the drop test and the break-even alarm as OK."""
    nan = float("nan")
    nan_test = DropTest("bootstrap", 0.7, nan, nan, nan, nan, nan, False, 0.01, 0.025, 256, 256)
    for acceptance, current in ((AcceptanceCheck(paired=nan_test, unpaired=None), 0.7),
                                (AcceptanceCheck(paired=_test(False), unpaired=None), nan),
                                (None, float("inf"))):
        decision = decide(champion_target_fingerprint="a", current_target_fingerprint="a", acceptance=acceptance,
                          drift=None, current_acceptance=current, break_even=0.4)
        assert decision.status is Status.ERROR and decision.exit_code == EXIT_ERROR
        assert decision.reasons and all("not a number" in r for r in decision.reasons)
