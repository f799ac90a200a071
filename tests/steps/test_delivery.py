"""The one rule by which weights that are no checkpoint (the cooldown's, the window average) replace the window's
pick (steps/delivery.deliver_if_lower), through each step's own `deliver`, on real folders."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rangefinder.formats import checkpoints
from rangefinder.steps import average, cooldown

PICK = {"checkpoint": "checkpoint-000012", "update": 12, "epoch": 3.0, "val_loss": 0.11, "rule": "window_lowest",
        "reason": "Weights at update 12.", "base_val_loss": 0.2, "improved_on_base": True}
CASES = {
    "cooldown": (cooldown.deliver, cooldown.COOLDOWN_DIR, "window_val_loss",
                 cooldown.Cooldown(lr=1e-3, epochs=5, total_updates=20, decay_start=16, start_update=16,
                                   updates_trained=4, val_loss=0.1), ("cooldown", 20, 5.0), "cooldown"),
    "window_average": (functools.partial(average.deliver, epoch=3.0), average.AVERAGE_DIR, "pick_val_loss",
                       average.WindowAverage(updates=(8, 12, 16), val_loss=0.1), ("window_average", 16, 3.0),
                       "8, 12, 16"),
}

# The cooldown's deliver, SIGKILLed at the first folder removal: the pick's old chosen/ swapped out once the candidate
# took its place (audit events fire before the operation).
KILLED_AFTER_THE_MOVE = """
import json, os, signal, sys
from pathlib import Path
from rangefinder.steps import cooldown

def killed_there(event, args):
    if event == "shutil.rmtree":
        os.kill(os.getpid(), signal.SIGKILL)

sys.addaudithook(killed_there)
cooldown.deliver(Path(sys.argv[1]), cooldown.Cooldown(**json.loads(sys.argv[2])), json.loads(sys.argv[3]))
"""


def lay_out(work: Path, folder: str, candidate: bool = True) -> Path:
    """A step's work folder at delivery: the window's pick in chosen/ and (with `candidate`) the weights measured
    against it in `folder`/final."""
    (work / folder).mkdir(parents=True)
    if candidate:
        (work / folder / "final").mkdir()
        (work / folder / "final" / "model.safetensors").write_text("candidate")
    (work / checkpoints.CHOSEN_DIR).mkdir()
    (work / checkpoints.CHOSEN_DIR / "model.safetensors").write_text("pick")
    return work


@pytest.mark.parametrize("which", list(CASES))
def test_lower_weights_move_into_chosen_and_the_pick_stays_on_record(tmp_path, which):
    """Measured lower, the candidate's model becomes chosen/ (its rule, update and epoch; the pick under
    window_pick); measured higher or equal, it is removed and chosen/ stays as it was. chosen.json says which."""
    deliver, folder, compared_as, measured, (rule, update, epoch), named = CASES[which]
    for pick_loss, delivered in ((0.11, True), (0.1, False)):
        work = lay_out(tmp_path / f"{which}-{pick_loss}", folder)
        info = deliver(work, measured, {**PICK, "val_loss": pick_loss})

        record = info["cooldown" if which == "cooldown" else "average"]
        assert record["delivered"] is delivered and record[compared_as] == pick_loss
        assert (work / checkpoints.CHOSEN_DIR / "model.safetensors").read_text() == (
            "candidate" if delivered else "pick")
        assert not (work / folder / "final").exists()
        assert checkpoints.read_chosen(work) == info
        if delivered:
            assert (info["rule"], info["update"], info["val_loss"], info["epoch"]) == (rule, update, 0.1, epoch)
            assert info["window_pick"]["update"] == 12 and info["improved_on_base"] is True
            assert named in info["reason"] and info["reason"].endswith("Weights at update 12.")
        else:
            assert (info["rule"], info["update"], info["val_loss"]) == ("window_lowest", 12, pick_loss)


@pytest.mark.parametrize("which", list(CASES))
def test_a_retried_step_keeps_the_decision_and_finishes_its_move(tmp_path, which):
    """A pod preempted after the decision (its work folder kept, as RANGEFINDER_WORK keeps it) retries the step: the
    candidate is weighed again against what chosen.json now says, which would undo a delivery. The recorded decision
    stands instead. Stopped between writing chosen.json and moving the model, the retry moves it; stopped after, the
    retry finds the model in chosen/ and leaves everything as it is."""
    deliver, folder, _, measured, (rule, update, _), _ = CASES[which]
    work = lay_out(tmp_path / which, folder)
    first = deliver(work, measured, PICK)
    assert (first["rule"], first["update"]) == (rule, update)
    # Stopped before the move: the decision is on record, the candidate still where it was, chosen/ the pick's.
    (work / checkpoints.CHOSEN_DIR).rename(work / folder / "final")
    (work / checkpoints.CHOSEN_DIR).mkdir()
    (work / checkpoints.CHOSEN_DIR / "model.safetensors").write_text("pick")
    for _attempt in range(2):  # the retry finishes the move; another retry finds it done
        assert deliver(work, measured, checkpoints.read_chosen(work)) == first == checkpoints.read_chosen(work)
        assert (work / checkpoints.CHOSEN_DIR / "model.safetensors").read_text() == "candidate"
        assert not (work / folder / "final").exists()


@pytest.mark.parametrize("which", list(CASES))
def test_weights_measured_against_a_pick_without_a_finite_loss_are_delivered_if_their_model_is_there(tmp_path, which):
    """A window's pick with no finite validation loss (None in chosen.json) loses to any finite measurement: the
    candidate is delivered. A candidate whose model folder is not there is never named as delivered, whatever it
    measured: chosen.json would name weights that chosen/ does not hold."""
    deliver, folder, compared_as, measured, (rule, update, _), _ = CASES[which]
    for present in (True, False):
        work = lay_out(tmp_path / f"{which}-{present}", folder, candidate=present)
        pick_loss = None if present else 0.11
        info = deliver(work, measured, {**PICK, "val_loss": pick_loss})

        record = info["cooldown" if which == "cooldown" else "average"]
        assert record["delivered"] is present and record[compared_as] == pick_loss
        assert (info["rule"], info["update"]) == ((rule, update) if present else ("window_lowest", 12))
        assert (work / checkpoints.CHOSEN_DIR / "model.safetensors").read_text() == ("candidate" if present else "pick")
        assert checkpoints.read_chosen(work) == info


def test_a_step_killed_right_after_the_move_finds_chosen_json_naming_the_moved_weights(tmp_path):
    """chosen.json is written before the delivered model moves into chosen/: killed just after the move, chosen/
    holds the cooldown's weights and chosen.json already names them (never the window's pick over other weights),
    and the retry keeps that decision."""
    _, folder, _, measured, (rule, update, _), _ = CASES["cooldown"]
    work = lay_out(tmp_path / "work", folder)
    child = subprocess.run([sys.executable, "-c", KILLED_AFTER_THE_MOVE, str(work), json.dumps(measured.to_json()),
                            json.dumps(PICK)], capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert (work / checkpoints.CHOSEN_DIR / "model.safetensors").read_text() == "candidate"
    info = checkpoints.read_chosen(work)
    assert info is not None and (info["rule"], info["update"], info["cooldown"]["delivered"]) == (rule, update, True)
    assert cooldown.deliver(work, measured, info) == info == checkpoints.read_chosen(work)
