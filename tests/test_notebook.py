"""examples/main_job.ipynb: committed without outputs, and run end to end (its `QUICK` parameter
set, as papermill would) by a kernel of this interpreter, printing the figures the run directory
holds and drawing its plot."""

import json
import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "main_job.ipynb"


def test_the_notebook_is_committed_valid_and_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    [params] = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert "QUICK = False" in params.source  # the main job as it is, unless asked otherwise
    assert any("dpfleet.simulate(" in c.source for c in code)


@pytest.mark.slow  # the shrunk main job in a Jupyter kernel: ~1 min on 2 cores
def test_the_notebook_runs_the_main_job_end_to_end(tmp_path):
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    [params] = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    run_dir = tmp_path / "run"
    params.source = f"QUICK = True\nRUN_DIR = {str(run_dir)!r}"
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
                     if o.output_type == "stream" and o.name == "stdout")
    summary = json.loads((run_dir / "summary.json").read_text())
    privacy = json.loads((run_dir / "privacy.json").read_text())
    assert summary["rounds_completed"] == 2
    # the figures it prints are the run directory's
    accuracy = float(re.search(r"^accuracy +([0-9.]+)", text, re.M).group(1))
    assert accuracy == pytest.approx(summary["final"]["accuracy"], abs=5e-5)
    eps = float(re.search(r"^eps = ([0-9.]+) at delta", text, re.M).group(1))
    assert eps == pytest.approx(privacy["epsilon"], abs=5e-3)
    assert any(o.output_type == "display_data" and "image/png" in o.data
               for c in nb.cells if c.cell_type == "code" for o in c.outputs)  # the plot
    suggestions = re.findall(r"^'good m' +-> (\[.*\])$", text, re.M)
    assert suggestions, text[-2000:]


def test_a_run_leaves_the_callers_matplotlib_backend_alone(tmp_path):
    """A notebook's inline plots still show after `dpfleet.simulate` (which draws accuracy.png):
    the run must not switch the process's backend to Agg."""
    import matplotlib
    from test_api import CONFIG, USERS, TinyLM, WordIds

    import dpfleet

    before = matplotlib.get_backend()
    try:
        matplotlib.use("svg")  # stands in for Jupyter's inline backend
        result = dpfleet.simulate(CONFIG, model=TinyLM(), users=USERS, tokenizer=WordIds(),
                                  progress=False, run_dir=tmp_path / "run")
        assert (result.run_dir / "accuracy.png").stat().st_size > 0
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before)
