"""The launcher's speed and time left (``diloco.rate``), from synthetic series with known
answers."""

import pytest

from diloco.rate import Rate, duration_text, rate_text


def test_the_rate_is_the_windows_growth_and_the_time_left_follows_from_it():
    rate = Rate(window=60.0)
    assert rate.per_second() is None and rate.time_to(100.0) is None  # unknown, said so
    rate.add(0.0, 0.0)
    assert rate.per_second() is None  # one point: no rate yet
    for t in range(10, 70, 10):
        rate.add(float(t), 100.0 * t)  # 100 a second
    assert rate.per_second() == pytest.approx(100.0)
    assert rate.time_to(10_000.0) == pytest.approx((10_000 - 6_000) / 100)
    assert rate.time_to(1_000.0) == 0.0  # reached already
    # Slower now: after a window at 10 a second the rate is that, not the old average.
    for t in range(70, 200, 10):
        rate.add(float(t), 6_000.0 + 10.0 * (t - 60))
    assert rate.per_second() == pytest.approx(10.0)
    assert rate.points[0][0] <= 190.0 - 60.0 < rate.points[1][0]  # the window, covered whole


def test_a_series_that_stands_still_or_goes_back_has_no_rate_until_it_moves_again():
    rate = Rate()
    rate.add(0.0, 50.0)
    rate.add(10.0, 50.0)
    assert rate.per_second() is None and rate.time_to(100.0) is None
    rate.add(20.0, 5.0)  # a resumed run counts from what it reads: start over
    assert list(rate.points) == [(20.0, 5.0)]
    rate.add(30.0, 25.0)
    assert rate.per_second() == pytest.approx(2.0)
    # A start-up (no progress for minutes) is not slow progress: it counts from its end.
    starting = Rate()
    for t in (0.0, 60.0, 120.0):
        starting.add(t, 0.0)
    starting.add(130.0, 1_000.0)
    assert starting.per_second() == pytest.approx(100.0)


@pytest.mark.parametrize(
    "seconds, text",
    [(None, "unknown"), (0.4, "0 s"), (45.2, "45 s"), (725, "12 min 05 s"), (12_000, "3 h 20 min")],
)
def test_a_time_left_reads_as_people_say_it(seconds, text):
    assert duration_text(seconds) == text


def test_a_rate_reads_with_thousands_separated_and_unknown_as_a_question_mark():
    assert rate_text(12_345.6) == "12,346/s" and rate_text(None) == "?/s"


def test_the_launchers_pace_says_its_rates_and_the_time_left_or_that_they_are_unknown():
    """From a known history: 5,000 tokens, a fifth of the budget, 120 inner steps and 2
    versions of each of 2 fragments in 10 s."""
    from flows.watch import Pace

    pace = Pace()
    pace.add(0.0, 0.0, 0.0, 0, {0: 0, 1: 0})
    assert pace.text() == "?/s | time left unknown | ? steps/s"
    assert pace.versions_text({0: 0, 1: 0}) == "f0:v0 f1:v0 at ?/min"
    pace.add(10.0, 5_000.0, 20.0, 120, {0: 2, 1: 2})  # 40 s to go at this rate
    assert pace.text() == "500/s | 40 s left | 12.0 steps/s"
    assert pace.versions_text({0: 2, 1: 2}) == "f0:v2 f1:v2 at 12.0/min"
    assert pace.scalars() == {
        "throughput/learner_steps_per_s": 12.0,
        "throughput/versions_per_min": 12.0,
        "time/seconds_left": 40.0,
    }
