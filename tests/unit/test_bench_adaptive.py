"""bench/adaptive.py: the settings each method is measured at, the summary's arithmetic, and one tiny end-to-end run
(the report's shape; no timing is asserted)."""

from collections import Counter

import pytest

from bench.adaptive import batches, main, settings_for, summarise


def test_settings_cap_fixed_ks_at_the_methods_reach():
    assert settings_for(4, False, [1, 2, 3, 4], [4, 8]) == ["plain", "k=1", "k=2", "k=3", "k=4", "auto"]
    assert settings_for(3, False, [1, 2, 3, 4], [4, 8]) == ["plain", "k=1", "k=2", "k=3", "auto"]
    assert settings_for(12, True, [1, 2], [4, 8, 16, 31]) == ["plain", "k=4", "k=8", "k=12", "auto"]


def test_prompts_go_c_per_call_cycled_to_at_least_the_minimum():
    assert batches(["a", "b", "c"], 1, 2) == [["a"], ["b"]]
    assert batches(["a", "b", "c"], 2, 3) == [["a", "b"], ["c", "a"]]
    assert batches(["a", "b"], 4, 2) == [["a", "b", "a", "b"]]


def test_summary_medians_ratios_per_round_and_the_k_histogram():
    settings = ["plain", "k=1", "k=2", "auto"]
    runs = [{"plain": (100, 10.0, Counter()), "k=1": (100, 8.0, Counter()), "k=2": (100, 5.0, Counter()),
             "auto": (100, 6.0, Counter({0: 3, 2: 5}))},
            {"plain": (100, 20.0, Counter()), "k=1": (100, 16.0, Counter()), "k=2": (100, 10.0, Counter()),
             "auto": (100, 10.0, Counter({2: 4}))}]
    s = summarise(runs, settings)
    assert s["best_fixed"] == "k=2"
    assert s["auto_over_plain"] == pytest.approx((10 / 6 + 2.0) / 2, abs=1e-3)  # per-round ratios, then the median
    assert s["auto_over_best_fixed"] == pytest.approx((5 / 6 + 1.0) / 2, abs=1e-3)
    assert s["auto_chosen_k"] == {"0": 3, "2": 9}


def test_a_tiny_run_reports_every_setting(tiny, capsys):
    report = main(["--model", str(tiny["llama"]), "--methods", "ngram", "--concurrency", "1,2", "--rounds", "1",
                   "--max-tokens", "6", "--workloads", "chat", "--dtype", "float32", "--kv-cache-memory", str(1 << 24)])
    assert [(r["method"], r["concurrency"]) for r in report["results"]] == [("ngram", 1), ("ngram", 2)]
    for r in report["results"]:
        assert set(r["summary"]["tokens_per_s"]) == set(r["settings"]) == {"plain", "k=1", "k=2", "k=3", "k=4",
                                                                             "auto"}
        assert r["step_prediction"]["steps"] > 0 and r["workload"] == "chat"
    assert "| chat | ngram | 2 |" in capsys.readouterr().err
