"""A custom module (not from the zoo) in a signed phone bundle with on-device training.

The bundle's training program is exported from the module itself; the reference device client
trains one epoch from it and suggests words from its window program, and its delta matches the
eager loop (`edge/runtime.py` LocalSGD) within the device client's tolerance
(tests/test_device_client.py: max |delta - eager| <= 1e-6 + 1e-4 * max |eager|). A module the
exporter cannot trace is refused in one line naming the operation; nothing is left behind.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from bundle_helpers import sentences
from test_api import CONFIG, USERS, TinyLM, WordIds
from test_export_custom_model import ValueBranch
from torch import nn

import dpfleet
from dpfleet.edge.bundle_format import verify_bundle
from dpfleet.edge.device_client import BundleClient
from dpfleet.edge.runtime import LocalSGD
from dpfleet.edge.tokenizer import WordTokenizer
from dpfleet.errors import DpfleetError
from dpfleet.export.bundle import BundleExport
from dpfleet.export.checkpoint import save_checkpoint
from dpfleet.export.console_capture import ExportRefused
from dpfleet.export.params import get_flat

pytest.importorskip("onnxruntime")
SEQ_LEN, VOCAB = 8, 24


class PositionalLM(nn.Module):
    """One causal attention layer over token + learned positional embeddings (an `nn.Embedding`
    of seq_len rows, which the vocabulary check must not read as the vocabulary)."""

    def __init__(self, vocab: int = VOCAB, d: int = 8, positions: int = SEQ_LEN):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(positions, d)
        self.qkv, self.head = nn.Linear(d, 3 * d), nn.Linear(d, vocab)
        self.register_buffer("causal", torch.tril(torch.ones(positions, positions, dtype=torch.bool)),
                             persistent=False)

    def forward(self, ids):
        t = ids.shape[1]
        h = self.tok(ids) + self.pos(torch.arange(t))
        q, k, v = self.qkv(h).chunk(3, -1)
        scores = (q @ k.transpose(1, 2)).masked_fill(~self.causal[:t, :t], float("-inf"))
        return self.head(h + scores.softmax(-1) @ v)


@pytest.fixture(scope="module")
def custom_bundle(tmp_path_factory):
    """(bundle, summary, the checkpoint's module, tokenizer): one export, ~25 s on 2 cores."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("custom-bundle")
    tok = WordTokenizer.build(sentences(200, 0), VOCAB)
    torch.manual_seed(0)
    trained = PositionalLM()
    save_checkpoint(root / "ckpt", trained, None, tok)
    given = PositionalLM().train()  # its own random weights: the bundle must ship the checkpoint's
    before = copy.deepcopy(given.state_dict())
    summary = BundleExport(root / "ckpt", root / "bundle", seq_len=SEQ_LEN, batch_size=4, model=given).run()
    assert given.training and all(torch.equal(before[k], v) for k, v in given.state_dict().items())
    return root / "bundle", summary, trained, tok


@pytest.mark.slow
def test_a_custom_module_gets_a_signed_bundle_without_a_step_program(custom_bundle):
    bundle, summary, trained, _ = custom_bundle
    verified = verify_bundle(bundle, summary["public_key"])
    assert set(verified.files) == {"train.onnx", "infer.onnx", "weights.bin", "signing_key.pub",
                                   "tokenizer/tokenizer.json", "ort_required_operators.config"}
    m = verified.manifest
    assert m["model"]["config"] is None and m["model"]["vocab_size"] == VOCAB
    assert m["model"]["custom"]["class"] == "PositionalLM"
    assert [p["name"] for p in m["model"]["parameters"]] == [n for n, _ in trained.named_parameters()]
    assert set(m["inference"]) == {"window"}  # no streaming program for a custom module
    names = [p["name"] for p in m["model"]["parameters"]]
    assert [i["name"] for i in m["training"]["onnx"]["inputs"]] == ["inputs", "targets",
                                                                   *(f"p.{n}" for n in names)]
    assert m["measured"]["window_vs_eager"]["top1"] == 1.0
    parity = m["measured"]["train_vs_eager"]
    assert parity["rows"] == 9 and parity["max_abs_err"] <= parity["bound"]
    assert parity["bound"] == pytest.approx(1e-6 + 1e-4 * parity["ref_max_abs"])
    np.testing.assert_array_equal(np.frombuffer(verified.read("weights.bin"), "<f4"), get_flat(trained))


@pytest.mark.slow
def test_the_device_client_trains_and_suggests_from_a_custom_bundle(custom_bundle):
    bundle, summary, trained, tok = custom_bundle
    client = BundleClient(bundle, summary["public_key"])
    assert not client.streaming
    rows = client.examples(sentences(9, 1))
    assert len(rows) % client.batch_size  # a partial last minibatch
    theta0 = client.weights()
    delta = client.train_epoch(theta0, rows, lr=0.5, seed=7)
    eager = copy.deepcopy(trained).train()
    LocalSGD()(eager, torch.from_numpy(rows), lr=0.5, batch_size=client.batch_size, seed=7)
    reference = get_flat(eager) - theta0
    assert np.abs(reference).max() > 1e-3  # the epoch really moved the weights
    assert np.abs(delta - reference).max() <= 1e-6 + 1e-4 * np.abs(reference).max()
    words = client.suggest("alice ")
    assert 1 <= len(words) <= 3 and set(words) <= set(tok.words)
    with torch.no_grad():  # the first suggestion is eager's likeliest word after "alice"
        prompt = torch.tensor([[1, *tok.encode("alice")]])
        logits = trained(prompt)[0, -1]
    best = max((i for i in range(4, tok.vocab_size)), key=lambda i: float(logits[i]))
    assert words[0] == tok.words[best]


def test_an_untraceable_module_is_refused_in_one_line_naming_the_operation(tmp_path):
    tok = WordTokenizer(["a", "b"])
    save_checkpoint(tmp_path / "ckpt", ValueBranch(), None, tok)
    with pytest.raises(ExportRefused) as refused:
        BundleExport(tmp_path / "ckpt", tmp_path / "bundle", seq_len=SEQ_LEN, batch_size=4,
                     model=ValueBranch()).run()
    message = str(refused.value)
    assert "\n" not in message and message.startswith("ONNX export refused this model")
    assert "data-dependent" in message
    assert not (tmp_path / "bundle").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".bundle.partial")]


def test_a_bundle_needs_a_tokenizer_the_device_client_reads(tmp_path):
    run = dpfleet.simulate({**CONFIG, "rounds": 1}, model=TinyLM(), users=USERS, tokenizer=WordIds(),
                           progress=False, run_dir=tmp_path / "run")
    with pytest.raises(DpfleetError, match=r"this run's is WordIds: train with dpfleet\.edge\.tokenizer"):
        run.export_bundle(tmp_path / "bundle", accept_caveats=True)
    assert not (tmp_path / "bundle").exists()


@pytest.mark.slow
def test_result_export_bundle_of_a_custom_run_with_executorch(tmp_path):
    """simulate -> Result.export_bundle with both runtimes -> one .pte epoch matches eager."""
    pytest.importorskip("executorch")
    tok = WordTokenizer.build([t for texts in USERS.values() for t in texts], 40)
    torch.manual_seed(0)
    run = dpfleet.simulate({**CONFIG, "rounds": 1}, model=PositionalLM(vocab=tok.vocab_size), users=USERS,
                           tokenizer=tok, progress=False, run_dir=tmp_path / "run")
    summary = run.export_bundle(tmp_path / "bundle", runtimes=("onnx", "executorch"), accept_caveats=True)
    client = BundleClient(tmp_path / "bundle", summary["public_key"])
    assert client.seq_len == CONFIG["data"]["seq_len"] and client.batch_size == 4
    rows = client.examples(USERS["user1"])
    theta0 = client.weights()
    eager = copy.deepcopy(run.model).train()
    LocalSGD()(eager, torch.from_numpy(rows), lr=client.lr, batch_size=4, seed=3)
    reference = get_flat(eager) - theta0
    for runtime in ("onnx", "executorch"):
        delta = client.train_epoch(theta0, rows, seed=3, runtime=runtime)
        assert np.abs(delta - reference).max() <= 1e-6 + 1e-4 * np.abs(reference).max()
    assert client.suggest("the ")
