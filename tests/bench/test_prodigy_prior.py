"""bench.prodigy_prior trains (a)'s fine-tune at the step size a saved case's Prodigy arm ended on, and weighs what
it delivers against the saved arms."""

import json
from pathlib import Path

import pytest

from bench.common import case_key
from bench.prodigy_prior import main, probe_case, tally
from bench.versus import verdict_of

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def _saved(method, kind, seed, epochs=2):
    """A case of the standings, its arms' length cut to `epochs` (the probe trains as long as the case says)."""
    case = next(c for c in json.loads((RESULTS / "versus_all_275.json").read_text())["cases"]
                if (c["method"], c["kind"], c["seed"]) == (method, kind, seed))
    return {**case, "finetune_epochs": epochs}


def _row(method, prior, a, prodigy, random, ok=True):
    """A probe's row as probe_case writes it: the prior run's loss and (a)'s, and Prodigy's and random search's best."""
    row = {"case": f"{method} x", "method": method, "reproduces": ok, "prior": prior, "rangefinder": a,
           "lr_over_rangefinder": 2.0, "seconds": 1.0, "prior_or_prodigy": min(prior, prodigy)}
    for opp, theirs in (("prodigy_best", prodigy), ("folk_best", 1.0), ("random_best", random), ("rangefinder", a)):
        row[f"prior_vs_{opp}"] = verdict_of(prior, theirs)
        row[f"prior_or_prodigy_vs_{opp}"] = verdict_of(min(prior, prodigy), theirs)
        row[f"rangefinder_vs_{opp}"] = verdict_of(a, theirs) if opp != "rangefinder" else None
    return row


def test_the_tally_counts_each_delivery_against_each_arm_over_the_cases_read():
    rows = [_row("full", 0.090, 0.100, 0.100, 0.095), _row("lora", 0.100, 0.100, 0.100, 0.120),
            _row("lora", 0.110, 0.100, 0.100, 0.090), _row("full", 0.05, 0.1, 0.1, 0.1, ok=False)]
    t = tally(rows)
    assert (t["cases"], t["read"], t["not_read"]) == (4, 3, ["full x"])
    a = t["by"]["all"]
    assert {k: a["prior_vs_prodigy_best"][k] for k in ("win", "tie", "loss")} == {"win": 1, "tie": 1, "loss": 1}
    # The lower of the prior run and Prodigy's best never loses to Prodigy's best.
    assert a["prior_or_prodigy_vs_prodigy_best"]["loss"] == 0
    assert a["prior_vs_random_best"]["win"] == 2 and a["rangefinder_vs_random_best"]["win"] == 1
    assert t["by"]["lora"]["prior_vs_rangefinder"]["loss"] == 1 and t["by"]["full"]["cases"] == 1


@pytest.mark.probe
def test_a_saved_case_trains_at_its_prodigy_step_size_and_is_weighed(tmp_path):
    """LoRA `shapes` 14 of the standings, cut to 2 epochs: the prior run trains at the step size the saved Prodigy arm
    ended on, on the same data (the base model's loss reproduces), and its delivery gets a verdict against each arm."""
    case = _saved("lora", "shapes", 14)
    row = probe_case(case, tmp_path)
    assert row["prodigy_lr_effective_final"] == case["prodigy"]["lr_effective_final"]
    assert row["family"] == "sd1" and case_key(row) == case_key(case)  # a killed probe resumes by it
    assert row["reproduces"] is True and row["prior_updates"] == 8 and row["updates"] == 8 + 160
    assert row["prior"] is not None and row["prior_or_prodigy"] <= case["summary"]["prodigy_best"]
    for who in ("prior", "prior_or_prodigy"):
        assert {row[f"{who}_vs_{o}"] for o in ("prodigy_best", "folk_best", "random_best")} <= {"win", "tie", "loss"}
    assert not (tmp_path / "lora-shapes-seed14").exists()


@pytest.mark.probe
def test_a_multiplier_trains_at_that_multiple_of_the_step_size(tmp_path):
    """--multiplier: the same case trained at twice the saved Prodigy step size, recorded as such."""
    case = _saved("lora", "shapes", 14)
    row = probe_case(case, tmp_path, multiplier=2.0)
    step = case["prodigy"]["lr_effective_final"]
    assert row["prodigy_lr_effective_final"] == step and row["multiplier"] == 2.0 and row["trained_lr"] == 2 * step
    assert row["lr_over_rangefinder"] == pytest.approx(2 * step / case["summary"]["rangefinder_lr"])
    assert row["reproduces"] is True and row["prior"] is not None


@pytest.mark.probe
def test_a_case_without_a_recorded_step_size_re_runs_prodigy_and_must_reproduce_it(tmp_path):
    """Cut to 2 epochs, the re-run Prodigy arm cannot reproduce the saved 40-epoch arm's best loss: the case is not
    read, and says why (a re-run that does reproduce is read with its own step size)."""
    case = _saved("full", "stripes", 14)
    case = {**case, "prodigy": {k: v for k, v in case["prodigy"].items() if k != "lr_effective_final"}}
    row = probe_case(case, tmp_path)
    assert row["prodigy_rerun"]["lr_effective_final"] > 0 and row["prodigy_reproduces"] is False
    assert "did not reproduce" in row["absent"] and "prior" not in row


def test_report_merges_parts_and_needs_no_source(tmp_path, capsys):
    parts = []
    for i, r in enumerate([_row("full", 0.09, 0.1, 0.1, 0.1), _row("lora", 0.1, 0.1, 0.1, 0.1)]):
        r["kind"], r["seed"] = "shapes", i
        parts.append(tmp_path / f"part{i}.json")
        parts[-1].write_text(json.dumps({"cases": [r]}))
    out = tmp_path / "all.json"
    result = main(["--report", *map(str, parts), "--out", str(out)])
    assert result["tally"]["read"] == 2 and json.loads(out.read_text())["merged_from"] == ["part0.json", "part1.json"]


def test_the_standings_put_the_prior_run_in_a_s_place_where_it_was_read():
    """Over saved cases: a read full case takes the prior run's loss, LR, updates, verdicts and grid gap; a case not
    read, or textual inversion, keeps (a) as it ran."""
    from bench.prodigy_prior import standings

    source = json.loads((RESULTS / "versus_all_275.json").read_text())
    full = next(c for c in source["cases"] if (c["method"], c["kind"], c["seed"]) == ("full", "shapes", 3))
    ti = next(c for c in source["cases"] if (c["method"], c["kind"], c["seed"]) == ("textual_inversion", "shapes", 3))
    lora = next(c for c in source["cases"] if (c["method"], c["kind"], c["seed"]) == ("lora", "shapes", 3))
    s = full["summary"]
    key = {k: full[k] for k in ("method", "kind", "seed")}
    rows = [{**key, "reproduces": True, "prior": 0.98 * s["grid_best"], "prodigy_lr_effective_final": 2e-4,
             "updates": 320},
            {"method": "lora", "kind": "shapes", "seed": 3, "absent": "no step size"},
            {"method": "textual_inversion", "kind": "shapes", "seed": 3, "reproduces": True, "prior": 0.0,
             "prodigy_lr_effective_final": 1e-3, "updates": 320}]
    st = standings({"cases": [full, ti, lora]}, rows)
    new, kept_ti, kept_lora = st["summaries"]
    assert st["with_prior"] == 1 and new["lr_finder"] == "prodigy_step" and new["rangefinder_lr"] == 2e-4
    assert new["vs_prodigy_best"] == "win" and new["gap_rangefinder_pct"] < 0
    assert new["rangefinder_update_share"] == 320 / s["updates"]["grid"] and new["updates"]["rangefinder"] == 320
    assert kept_ti == ti["summary"] and kept_lora == lora["summary"]
    assert st["aggregate"]["cases"] == 3 and st["aggregate_by_method"]["full"]["vs_prodigy_best"]["win"] == 1
