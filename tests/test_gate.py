import math

import pytest

from components.evaluation.intervals import wilson_interval
from components.registry.gate import two_proportion_gate


def test_gate_refuses_an_equal_model():
    decision = two_proportion_gate(90, 120, 90, 120, alpha=0.05)
    assert not decision.promote
    assert decision.p_value == pytest.approx(0.5)


def test_gate_refuses_a_slightly_better_model_on_noise():
    decision = two_proportion_gate(94, 120, 90, 120, alpha=0.05)
    assert not decision.promote
    assert 0.05 < decision.p_value < 0.5


def test_gate_accepts_a_clearly_better_model():
    decision = two_proportion_gate(115, 120, 90, 120, alpha=0.05)
    assert decision.promote
    assert decision.p_value < 1e-3
    assert decision.z > 3


def test_gate_never_promotes_a_worse_model():
    assert not two_proportion_gate(80, 120, 110, 120, alpha=0.05).promote


def test_gate_promotes_first_model_without_champion():
    decision = two_proportion_gate(10, 20, None, None, alpha=0.05)
    assert decision.promote and decision.reason == "no champion yet"


def test_gate_at_the_ceiling_is_no_evidence():
    assert not two_proportion_gate(120, 120, 120, 120, alpha=0.05).promote


def test_gate_rejects_unevaluated_challenger():
    with pytest.raises(ValueError, match="evaluate it"):
        two_proportion_gate(0, 0, 10, 20, alpha=0.05)


def test_wilson_interval_known_values():
    # 8/10 at 95%: Wilson interval is [0.4902, 0.9433]
    p = wilson_interval(8, 10, 0.95)
    assert p.low == pytest.approx(0.4902, abs=1e-4)
    assert p.high == pytest.approx(0.9433, abs=1e-4)
    edge = wilson_interval(0, 50)
    assert edge.low == 0.0 and 0.0 < edge.high < 0.1
    assert math.isnan(wilson_interval(0, 0).rate)
