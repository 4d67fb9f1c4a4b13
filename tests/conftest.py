"""Shared fixtures. Tests run on 1 torch thread so results are deterministic and cores are shared."""

import os
import signal
import sys

import pytest
import torch

# Bytecode is cached (in the git-ignored __pycache__ folders) even where PYTHONDONTWRITEBYTECODE is
# set, as on this project's machines: without it every xdist worker rewrote the test modules' asserts
# and compiled dpfleet anew, and so did every `dpfleet` subprocess a test starts (a worker's
# collection took 34 s instead of 14 s on a 2-core AMD EPYC).
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
torch.set_num_threads(1)
# Ctrl-C as in a terminal, however pytest was started: a non-interactive shell starts a background
# job (`pytest ... &`) with SIGINT ignored, Python then installs no KeyboardInterrupt handler, and
# every process the tests start inherits the ignored signal, so the Ctrl-C tests (a SIGINT to the
# run itself, or to a `dpfleet` child) would test nothing but the launcher.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if torch.cuda.is_available():  # bit-exact resume checks hold on CUDA only with deterministic kernels
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first CUDA call
    torch.use_deterministic_algorithms(True)  # docs/offline_gpu_server.md, "Devices and determinism"


@pytest.fixture(scope="session")
def shakespeare_records():
    from dpfleet.edge.datasets import load_records

    return load_records("shakespeare")


def _mixed_public_lines(n: int) -> list[str]:
    """Real text of the pool's three styles (encyclopedic, biblical, Elizabethan)."""
    from dpfleet.edge.datasets import load_records

    out = []
    for name in ("wikitext2", "kjv", "shakespeare-collab"):
        out += [r.text for r in load_records(name)[: n // 3]]
    return out


def build_tiny_teacher(folder, lines, vocab_size, spread_logits=False, **spm_options):
    """A real Hugging Face teacher folder: a random 2-layer Llama whose SentencePiece BPE
    vocabulary (Gemma's special-id order: pad 0, eos 1, bos 2, unk 3) is trained on `lines`.
    `spread_logits` widens the output layer so a top-k has no near-ties."""
    import sentencepiece as spm
    from transformers import LlamaConfig, LlamaForCausalLM

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(folder / "tokenizer"), model_type="bpe",
        vocab_size=vocab_size, byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        num_threads=1, minloglevel=2, **spm_options,
    )
    (folder / "tokenizer.vocab").unlink()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    if spread_logits:
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_teacher_builder():
    """`build_tiny_teacher`, for test modules that need a teacher with other properties."""
    return build_tiny_teacher


@pytest.fixture(scope="session")
def tiny_teacher_dir(tmp_path_factory):
    """A tiny teacher whose vocabulary is trained on the public pool's styles."""
    return build_tiny_teacher(tmp_path_factory.mktemp("tiny-teacher"), _mixed_public_lines(3000), 900)


@pytest.fixture(scope="session")
def tiny_teacher_vocab(tiny_teacher_dir, tmp_path_factory):
    """The tiny teacher's vocabulary trimmed to 700 on-device pieces."""
    from dpfleet.public.teacher_tokenizer import build_teacher_vocab, load_teacher_spm

    out = tmp_path_factory.mktemp("tiny-vocab")
    return build_teacher_vocab(load_teacher_spm(tiny_teacher_dir), _mixed_public_lines(1500), 700,
                               out, str(tiny_teacher_dir))


@pytest.fixture(scope="module")
def wide_tiny_teacher(tiny_teacher_dir):
    """The tiny teacher loaded on CPU with a wide output layer, so top-k lists have no near-ties."""
    import torch

    from dpfleet.public.teacher import load_teacher

    t = load_teacher(str(tiny_teacher_dir), device="cpu")
    torch.manual_seed(1)
    with torch.no_grad():
        t.model.lm_head.weight.normal_(0.0, 0.5)
    return t


@pytest.fixture(scope="module")
def ray_local():
    """A private 2-CPU Ray instance for one test module (skipped where Ray is not installed)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: 1.5 workers per core. Many tests wait (deadlines, long-polls, subprocesses that
    start a coordinator) rather than compute, so a third worker on 2 cores fills the idle time."""
    return max(1, (3 * (os.cpu_count() or 1)) // 2)
