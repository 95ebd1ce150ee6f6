"""Waste reports, worked by hand on small workloads."""

import numpy as np
import pytest

from bucketing.cost import PaddedTokenCost
from bucketing.errors import BucketError
from bucketing.report import against_nxdi, compare, nxdi_default_grid, report_1d, report_2d
from bucketing.workload import histogram

HIST = histogram([3, 4, 5, 9], [1, 2, 1, 1])


def test_first_fit_report_by_hand():
    report = report_1d([4, 8], HIST, cost=PaddedTokenCost())
    # 3 -> 4 pads 1; 4 -> 4 twice pads 0; 5 -> 8 pads 3; 9 fits nothing.
    assert (report.served, report.rejected) == (4, 1)
    assert (report.tokens, report.padded_tokens) == (16, 4)
    assert report.padding_ratio == pytest.approx(4 / 20)
    assert report.padded_per_need == 1.0
    assert report.expected_cost == pytest.approx((4 * 3 + 8) / 4)
    assert [(b.bucket, b.served, b.share, b.tokens, b.padded_tokens, b.cost)
            for b in report.buckets] == [((4,), 3, 0.75, 11, 1, 4.0), ((8,), 1, 0.25, 5, 3, 8.0)]


def test_strict_rule_report_by_hand():
    report = report_1d([4, 8], HIST, cost=PaddedTokenCost(), rule="strict")
    # NxDI sends both 4-token needs to the 8 bucket: 1 + 4 + 4 + 3 padded.
    assert report.padded_tokens == 12 and report.rule == "strict"
    assert report_1d([4, 8], histogram([8]), rule="strict").padded_tokens == 0


def test_report_json_form_is_stable():
    data = report_1d([4, 8], HIST, cost=PaddedTokenCost()).to_dict()
    assert list(data) == ["grid", "rule", "cost_model", "cost_unit", "served", "rejected",
                          "tokens", "padded_tokens", "padded_tokens_per_need",
                          "padding_ratio", "expected_cost", "buckets"]
    assert data["buckets"][0] == {"bucket": 4, "served": 3, "share": 0.75, "tokens": 11,
                                  "padded_tokens": 1, "cost": 4.0}


def test_2d_reports_by_hand():
    needs, counts = np.array([[1, 3], [2, 5]]), np.array([1, 1])
    report = report_2d([(1, 4), (2, 4), (2, 8)], needs, counts, cost=PaddedTokenCost())
    # (1, 3) -> (1, 4) pads 4 - 3; (2, 5) -> (2, 8) pads 16 - 10.
    assert report.padded_tokens == 7 and report.tokens == 13
    assert report.to_dict()["buckets"][2]["bucket"] == [2, 8]
    prefix = report_2d([(4, 0), (4, 8)], np.array([[3, 0], [2, 6]]), counts, pair="prefix",
                       cost=PaddedTokenCost())
    # Prefix grids count positions (active + prefix): (4, 0) pads 1, (4, 8) pads 4.
    assert prefix.padded_tokens == 5


def test_compare_reports():
    tuned = report_1d([4, 8], HIST, cost=PaddedTokenCost())
    nxdi = report_1d([4, 8], HIST, cost=PaddedTokenCost(), rule="strict")
    result = compare(tuned, nxdi)
    assert result["padded_tokens_ratio"] == pytest.approx(4 / 12, abs=1e-4)
    assert result["padded_tokens_saved_pct"] == pytest.approx(66.67)
    exact = report_1d([3, 4, 5, 9], HIST, cost=PaddedTokenCost())
    assert compare(tuned, exact)["padded_tokens_ratio"] is None


def test_nxdi_default_grid_and_bad_grids():
    assert nxdi_default_grid(2500) == [128, 256, 512, 1024, 2500]
    assert nxdi_default_grid(64) == [64]
    with pytest.raises(BucketError, match="grid is not sorted"):
        report_1d([8, 4], HIST)


def test_against_nxdi_uses_the_same_maximum_rule_and_cost():
    hist = histogram([100, 256, 900, 2500])
    report, baseline, comparison = against_nxdi([256, 1024, 2500], hist,
                                                cost=PaddedTokenCost(), rule="strict")
    assert baseline.grid == [128, 256, 512, 1024, 2500] and baseline.rule == "strict"
    # strict: 100 -> 256, 256 -> 1024, 900 -> 1024, 2500 -> 2500 (equal to the largest).
    assert report.padded_tokens == 156 + 768 + 124 + 0
    assert comparison["baseline_padded_tokens"] == baseline.padded_tokens
