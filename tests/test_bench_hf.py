"""benchmarks/bench_hf.py's run note records the transformers side's stack."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_hf import run_note  # noqa: E402


def test_run_note_names_the_torch_side_versions():
    side = {"versions": {"torch": "2.11.0", "transformers": "5.17.0", "fla": "0.6.0"}}
    assert run_note(False, side) == "torch side: torch 2.11.0, transformers 5.17.0, fla 0.6.0"
    assert run_note(True, None) == "dry run (CPU smoke)"
    assert run_note(False, None) is None
    missing = {"versions": {"fla": "unavailable (ImportError)"}}
    want = "dry run (CPU smoke); torch side: fla unavailable (ImportError)"
    assert run_note(True, missing) == want
