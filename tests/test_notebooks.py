"""Execute every notebook under notebooks/ with nbclient (kernel python3): it must run
without error and print what it promises. (No wall-time assertion: a shared CI machine
makes timings flaky; the per-cell timeout only stops a hung kernel.)"""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 600  # only catches a hung kernel
# What each notebook must print (stdout) and how many figures it must show.
EXPECT = {
    "quickstart.ipynb": (["40 steps in", "eval at step  40: reward", "ppo_clip_loss = ",
                          "by hand = "], 1),
    "vcpo.ipynb": (["VCPO staleness ablation: ", "ESS by hand = ", "rl.objectives.vcpo.ess_ratio = ",
                    "baseline by hand = ", "max |difference|"], 3),
}


def test_every_notebook_is_checked():
    assert NOTEBOOKS and {p.name for p in NOTEBOOKS} == set(EXPECT)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    # The kernel inherits this process's environment (conftest: CPU only, wandb disabled).
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(REPO)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    stdout = "".join(o.get("text", "") for o in outputs if o.get("name") == "stdout")
    texts, n_images = EXPECT[path.name]
    for text in texts:
        assert text in stdout, f"{path.name} did not print {text!r}"
    assert sum("image/png" in o.get("data", {}) for o in outputs) == n_images
