"""Script kinds (tests/distributed/scripts/kinds_script.py), in place on one rank, against real
``transformers.Trainer``: the same script with only the import changed gives the same steps, log steps and keys,
checkpoints and checkpoint files (Trainer's, and our loop's own three), and losses: images with a random crop
and flip per access read by 2 loader workers (``dataloader_num_workers``), detection and segmentation labels as lists of
dicts (classes, boxes, masks) that ``compute_metrics`` walks batch by batch (``eval_do_concat_batches=False``),
audio decoded from WAV bytes on every
access with a random window (``random.randint``) per access, a CLIP two-tower contrastive model
(``return_loss=True`` in the batch, no labels), a LLaVA vision-language SFT collator (image tokens, masked
prompt, pixel values), trl's DPOTrainer on a LLaVA model with a ``LlavaProcessor`` (vision-language DPO: the
same rewards too; the processor saved whole, ``processor_config.json`` included).  Both launch styles on 2 gloo
ranks, with the DeepSpeed JSON and fsdp_config kinds: tests/distributed/test_script_kinds.py
(``compat_full``)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from unittest import mock

import pytest

from trainbridge.checkpoint.layout import COMPLETE_MARKER, MANIFEST_FILE, TRAINING_STATE_FILE

SCRIPT = Path(__file__).parents[1] / "distributed" / "scripts" / "kinds_script.py"
KINDS = ["images", "detection", "audio", "twotower", "vlm", "vlmdpo"]
LOOP_FILES = {TRAINING_STATE_FILE, MANIFEST_FILE, COMPLETE_MARKER}
"""The files our checkpoints hold beside Trainer's: the loop's state and the checkpoint's integrity."""
SAME = ("global_step", "loss_steps", "eval_steps", "checkpoints")


def _run(out: Path, real: bool) -> dict[str, dict]:
    """The script's ``main()`` in this process (``real``: transformers.Trainer), each kind's summary."""
    argv = [str(SCRIPT), str(out), ",".join(KINDS), *(["real"] if real else [])]
    with mock.patch.object(sys, "argv", argv):
        runpy.run_path(str(SCRIPT), run_name="kinds_script")["main"]()
    return {kind: json.loads((out / kind / "summary.json").read_text()) for kind in KINDS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict]]:
    root = tmp_path_factory.mktemp("kinds")
    return {"real": _run(root / "real", real=True), "ours": _run(root / "ours", real=False)}


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_trains_as_under_trainer(runs: dict[str, dict[str, dict]], kind: str) -> None:
    real, ours = runs["real"][kind], runs["ours"][kind]
    assert {k: ours[k] for k in SAME} == {k: real[k] for k in SAME}
    assert ours["log_keys"] == real["log_keys"]
    assert real["checkpoint_files"]
    assert set(ours["checkpoint_files"]) - LOOP_FILES == set(real["checkpoint_files"])
    # the random draws (images: torch's crops and flips in 2 loader workers; audio: Python's windows; dropout)
    # come from the streams Trainer's DataLoader leaves (tests/unit/test_random_stream.py): no extra tolerance
    assert ours["losses"] == pytest.approx(real["losses"], rel=1e-4)
    assert ours.get("eval_accuracy") == real.get("eval_accuracy")
    # detection: compute_metrics got the same per-batch lists of label dicts (images, objects, mask pixels)
    assert (ours.get("counts"), ours.get("batches")) == (real.get("counts"), real.get("batches"))
    for values in ("eval_losses", "margins"):
        if values in real:
            assert ours[values] == pytest.approx(real[values], rel=1e-4)
