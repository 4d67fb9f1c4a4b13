"""The int8 `.pte` quantizes the embedding table too (ExecuTorch `embedding_byte`).

Checked on the value: the program shrinks by about 3 bytes per table entry (4 -> 1 byte, plus one
scale per row), the table rows it reads are really rounded (its logits differ from the
fp32-table program's), and it still agrees with eager. ExecuTorch exports take minutes: slow.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpfleet.export.models import ModelConfig, build_model
from dpfleet.export.phone import InferenceProgram, agreement, pte_program, random_windows

pytest.importorskip("executorch")
pytestmark = pytest.mark.slow

SEQ_LEN = 6


def test_int8_table_shrinks_the_program_and_keeps_top1(tmp_path):
    cfg = ModelConfig(vocab_size=3000, embedding_dim=32, hidden_dim=48, projection_dim=32)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    rows, lengths = random_windows(cfg, SEQ_LEN, n=32)
    programs = {}
    for table in (False, True):
        path = tmp_path / f"table-{table}.pte"
        path.write_bytes(pte_program(model, SEQ_LEN, "int8", quantize_embedding=table))
        programs[table] = path
    saved = programs[False].stat().st_size - programs[True].stat().st_size
    entries = cfg.vocab_size * cfg.embedding_dim
    assert 2.5 * entries < saved < 3.1 * entries
    fp32_table = InferenceProgram(programs[False], "pte", 1)(rows)
    int8_table = InferenceProgram(programs[True], "pte", 1)(rows)
    assert np.abs(int8_table - fp32_table).max() > 1e-5  # the rows really are rounded
    agree = agreement(model, InferenceProgram(programs[True], "pte", 1), rows, lengths)
    assert agree["top1"] >= 0.98 and agree["max_abs_err"] < 0.1


def test_tied_table_stays_fp32(tmp_path):
    """Tied models keep the fp32 table (it is also the output matmul's weight): same size."""
    cfg = ModelConfig(vocab_size=500, embedding_dim=16, hidden_dim=24, projection_dim=16, tie_embeddings=True)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    sizes = {table: len(pte_program(model, SEQ_LEN, "int8", quantize_embedding=table))
             for table in (False, True)}
    assert sizes[False] == sizes[True]
