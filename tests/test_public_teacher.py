"""Teacher loading, teacher tokenizer trimming, top-k corpus and the `public` CLI.

Everything runs on a tiny real Hugging Face teacher built here: a 2-layer Llama with a
SentencePiece BPE vocabulary whose special ids follow Gemma's order (pad 0, eos 1, bos 2,
unk 3), so the remap to dpfleet's 0/1/2/3 is exercised. The real Gemma checks are in
test_public_gemma.py (slow).
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from dpfleet.cli import main
from dpfleet.edge.tokenizer import BOS, EOS, PAD, UNK
from dpfleet.errors import DpfleetError
from dpfleet.public.teacher import load_teacher
from dpfleet.public.teacher_tokenizer import (
    TeacherVocab,
    build_teacher_vocab,
    load_teacher_spm,
    processor,
    spm_from_gguf,
)
from dpfleet.public.topk import TopKCorpus, TopKExtractor, build_corpus, student_sequences

torch.set_num_threads(1)

_WORDS = [
    "the", "of", "and", "to", "in", "a", "is", "was", "for", "on", "as", "with", "by", "he",
    "at", "from", "his", "an", "were", "are", "which", "this", "be", "had", "not", "or", "but",
    "its", "first", "new", "one", "their", "after", "been", "two", "they", "has", "also", "who",
    "all", "she", "her", "other", "into", "more", "than", "time", "during", "city", "when",
    "only", "most", "there", "some", "would", "about", "up", "over", "between", "later",
    "years", "while", "game", "season", "united", "series", "film", "war", "three", "world",
    "second", "state", "national", "under", "played", "called", "music", "football", "until",
    "song", "number", "british", "north", "south"
]


def _lines(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 18))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(1, 2000)))
        if rng.random() < 0.2:
            words.append(rng.choice(["café", "naïve", "Zürich", ","]))
        line = " ".join(words).capitalize() + " ."
        out.append(line.replace(" ,", ",", 1) if rng.random() < 0.5 else line)
    return out


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tiny_teacher_builder):
    """A tiny Llama teacher with Gemma-like tokenizer quirks: split digits, a whitespace-only
    piece, no dummy prefix, identity normalisation."""
    return tiny_teacher_builder(
        tmp_path_factory.mktemp("teacher"), _lines(3000, seed=0), 700, spread_logits=True,
        split_digits=True, user_defined_symbols=["\u2581\u2581"], add_dummy_prefix=False,
        remove_extra_whitespaces=False, normalization_rule_name="identity",
    )


@pytest.fixture(scope="module")
def vocab(teacher_dir, tmp_path_factory) -> TeacherVocab:
    out = tmp_path_factory.mktemp("vocab")
    return build_teacher_vocab(load_teacher_spm(teacher_dir), _lines(2000, 1), 600, out, "tiny")


def test_load_local_folder_on_cpu(teacher_dir):
    teacher = load_teacher(str(teacher_dir), device="cpu")
    assert teacher.vocab_size == 700 and teacher.device.type == "cpu"
    ids = torch.tensor([[2, 40, 41, 0]])
    logits = teacher.logits(ids, torch.tensor([[1, 1, 1, 0]]))
    assert logits.shape == (1, 4, 700) and logits.dtype == torch.float32
    assert not teacher.model.training


def test_unknown_teacher_is_a_user_error(tmp_path):
    with pytest.raises(DpfleetError, match="neither a packaged name"):
        load_teacher(str(tmp_path / "nope"))


def test_trimmed_vocab_specials_budget_and_exact_id_map(teacher_dir, vocab):
    tok = vocab.tokenizer
    assert tok.vocab_size == 600 and vocab.meta["vocab_size"] == 600
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (PAD, BOS, EOS, UNK)
    teacher = processor(load_teacher_spm(teacher_dir))
    # Gemma order in the teacher: pad 0, eos 1, bos 2, unk 3
    assert list(vocab.student_to_teacher[:4]) == [0, 2, 1, 3]
    for sid, tid in enumerate(vocab.student_to_teacher):
        assert tok.piece(sid) == teacher.id_to_piece(int(tid))
        assert vocab.teacher_to_student[tid] == sid
    assert sum(tok.piece(i).startswith("<0x") for i in range(tok.vocab_size)) == 256
    assert 0.5 < vocab.meta["token_coverage"] < 1.0


def test_trimmed_encoding_agrees_with_teacher_where_covered(teacher_dir, vocab):
    teacher = processor(load_teacher_spm(teacher_dir))
    s2t = vocab.student_to_teacher
    kept = set(s2t.tolist())
    lines = [*_lines(1500, 7), "Café  Zürich 1999 naïve", "日本語 text ☃ with  double spaces"]
    covered = identical = 0
    for line in lines:
        ref = teacher.encode(line)
        ours = vocab.tokenizer.encode(line)
        assert UNK not in ours  # byte fallback: nothing is out of vocabulary
        assert vocab.tokenizer.decode(ours) == line
        if all(t in kept for t in ref):
            covered += 1
            assert [int(s2t[i]) for i in ours] == ref, line
            identical += 1
    # the trimmed pieces are rare, so many lines are covered, and some are not
    assert 100 < covered < len(lines)
    assert identical == covered


def test_every_kept_piece_is_reachable(vocab):
    tok = vocab.tokenizer
    for sid in range(4 + 256, tok.vocab_size):
        text = tok.piece(sid).replace("\u2581", " ")
        assert tok.encode(text) == [sid], tok.piece(sid)


def test_trimmed_pieces_map_to_their_fallbacks_first_piece(teacher_dir, vocab):
    teacher = processor(load_teacher_spm(teacher_dir))
    trimmed = [
        t for t in range(teacher.get_piece_size())
        if vocab.teacher_to_student[t] >= 0 and t not in set(vocab.student_to_teacher.tolist())
    ]
    assert trimmed
    for t in trimmed:
        text = teacher.id_to_piece(t).replace("\u2581", " ")
        assert vocab.teacher_to_student[t] == vocab.tokenizer.encode(text)[0]


def test_vocab_budget_is_checked(teacher_dir, tmp_path):
    with pytest.raises(DpfleetError, match="vocab size"):
        build_teacher_vocab(load_teacher_spm(teacher_dir), ["a b"], 100, tmp_path, "tiny")
    with pytest.raises(DpfleetError, match="no tokenizer.model"):
        load_teacher_spm(tmp_path)


def _permute_for_gguf(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (rotary halves interleaved); transformers undoes it on load."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def _write_gguf(teacher_dir, path) -> None:
    """The tiny teacher as llama.cpp writes a GGUF: float32 tensors under GGUF names, and
    whitespace-only user-defined pieces stored with plain spaces."""
    import gguf
    from transformers import LlamaForCausalLM

    proto = load_teacher_spm(teacher_dir)
    model = LlamaForCausalLM.from_pretrained(teacher_dir)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_tokenizer_model("llama")
    w.add_token_list([
        p.piece.replace("\u2581", " ") if p.type == 4 else p.piece for p in proto.pieces
    ])
    w.add_token_scores([p.score for p in proto.pieces])
    w.add_token_types([3 if p.type == 2 else p.type for p in proto.pieces])
    w.add_pad_token_id(0)
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)
    w.add_add_space_prefix(False)
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        names.update({f"model.layers.{i}.{hf}.weight": f"blk.{i}.{gg}.weight"
                      for hf, gg in layer.items()})
    for name, tensor in model.state_dict().items():
        array = tensor.numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            array = _permute_for_gguf(array, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            array = _permute_for_gguf(array, cfg.num_key_value_heads)
        w.add_tensor(names[name], array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def gguf_file(teacher_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_gguf(teacher_dir, path)
    return path


def test_sentencepiece_rebuilt_from_gguf_fields_encodes_identically(teacher_dir, gguf_file):
    rebuilt = processor(spm_from_gguf(gguf_file))
    original = processor(load_teacher_spm(teacher_dir))
    lines = [*_lines(500, 3), "two  spaces   three", "digits 12345 ☃"]
    assert rebuilt.encode(lines) == original.encode(lines)
    assert (rebuilt.bos_id(), rebuilt.eos_id(), rebuilt.pad_id(), rebuilt.unk_id()) == (2, 1, 0, 3)


def _fake_packaged(gguf_file, cache, monkeypatch, sha256=None):
    """Ship `gguf_file` as three chunk wheels plus an empty front wheel in the wheel cache."""
    import hashlib
    import zipfile

    from dpfleet.public import teacher as teacher_mod

    data = gguf_file.read_bytes()
    wheels = cache / "wheels"
    wheels.mkdir(parents=True)
    reqs = ["tinyteach==1.0"]
    zipfile.ZipFile(wheels / "tinyteach-1.0-py3-none-any.whl", "w").close()
    third = len(data) // 3 + 1
    for i in range(3):
        pkg = f"tinyteach_part{i + 1}"
        with zipfile.ZipFile(wheels / f"{pkg}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{pkg}/data/tiny.gguf.part{i:02d}", data[i * third : (i + 1) * third])
        reqs.append(f"tinyteach-part{i + 1}==1.0")
    monkeypatch.setenv("DPFLEET_CACHE", str(cache))
    monkeypatch.setenv("DPFLEET_OFFLINE", "1")  # everything must come from the cache
    spec = teacher_mod.PackagedGGUF(
        tuple(reqs), "tiny.gguf", sha256 or hashlib.sha256(data).hexdigest()
    )
    monkeypatch.setitem(teacher_mod.PACKAGED, "tiny", spec)


def test_packaged_gguf_is_reassembled_converted_and_cached(
    teacher_dir, gguf_file, tmp_path, monkeypatch
):
    from transformers import LlamaForCausalLM

    _fake_packaged(gguf_file, tmp_path, monkeypatch)
    teacher = load_teacher("tiny", device="cpu")
    folder = tmp_path / "teachers" / "tiny"
    assert teacher.path == folder and (folder / "tokenizer.model").is_file()
    assert not (tmp_path / "gguf" / "tiny.gguf").exists()  # only the converted copy stays
    x = torch.tensor([[2, 50, 60, 70, 80, 90]])
    original = LlamaForCausalLM.from_pretrained(teacher_dir).eval()
    with torch.no_grad():
        expected = original(x).logits
    assert torch.allclose(teacher.logits(x, torch.ones_like(x)), expected, atol=1e-5)
    original_sp = processor(load_teacher_spm(teacher_dir))
    assert processor(load_teacher_spm(folder)).encode(_lines(50, 4)) == original_sp.encode(
        _lines(50, 4)
    )
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    load_teacher("tiny", device="cpu")
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # no second conversion


def test_packaged_gguf_with_wrong_checksum_is_refused(gguf_file, tmp_path, monkeypatch):
    _fake_packaged(gguf_file, tmp_path, monkeypatch, sha256="0" * 64)
    with pytest.raises(DpfleetError, match="SHA-256"):
        load_teacher("tiny", device="cpu")


def _expected_rows(teacher, vocab, seq, k):
    """Independent reference: full logits, top-k, map, merge by summing probabilities."""
    t2s = vocab.teacher_to_student
    inputs = [int(vocab.student_to_teacher[BOS])] + [int(vocab.student_to_teacher[s]) for s in seq]
    logits = teacher.logits(torch.tensor([inputs[: len(seq)]]), torch.ones(1, len(seq)))[0]
    rows = []
    for row in logits:
        values, ids = row.topk(k)
        mass: dict[int, float] = {}
        for v, t in zip(values.tolist(), ids.tolist(), strict=True):
            s = int(t2s[t])
            if s >= 0 and s not in (PAD, BOS, UNK):
                mass[s] = mass.get(s, 0.0) + math.exp(v)
        rows.append(sorted(((math.log(m), s) for s, m in mass.items()), reverse=True))
    return rows


def test_topk_corpus_round_trip_matches_direct_computation(teacher_dir, vocab, tmp_path):
    teacher = load_teacher(str(teacher_dir), device="cpu")
    k = 6
    sequences = student_sequences(_lines(12, 11), vocab.tokenizer, seq_len=9)
    manifest = build_corpus(
        TopKExtractor(teacher, vocab, k), sequences, tmp_path, shard_sequences=7,
        batch_tokens=40, progress=False,
    )
    n_tokens = sum(map(len, sequences))
    assert manifest["tokens"] == n_tokens and len(manifest["shards"]) == math.ceil(
        len(sequences) / 7
    )
    stored = 0
    for name in manifest["shards"]:
        with np.load(tmp_path / name) as z:
            stored += sum(z[a].nbytes for a in ("tokens", "topk_ids", "topk_logits"))
    assert stored == 4 * k * n_tokens  # 2 + 2k + 2(k - 1) bytes per token
    overhead = 1200 * len(manifest["shards"]) / n_tokens  # npz headers
    assert manifest["bytes_per_token"] < 4 * k + overhead
    assert manifest["tokens_per_s"] > 0

    corpus = TopKCorpus(tmp_path)
    assert len(corpus) == len(sequences)
    batch = corpus.batch(range(len(sequences)))
    merged_any = False
    for b, seq in enumerate(sequences):
        assert batch.targets[b, : len(seq)].tolist() == seq
        assert batch.inputs[b, 0] == BOS and batch.inputs[b, 1 : len(seq)].tolist() == seq[:-1]
        assert (batch.targets[b, len(seq) :] == PAD).all()
        assert torch.isinf(batch.topk_logits[b, len(seq) :]).all()
        for i, expected in enumerate(_expected_rows(teacher, vocab, seq, k)):
            n = len(expected)
            merged_any |= n < k
            assert batch.topk_ids[b, i, :n].tolist() == [s for _, s in expected]
            rel = [v - expected[0][0] for v, _ in expected]
            assert np.allclose(batch.topk_logits[b, i, :n].numpy(), rel, atol=2e-2, rtol=1e-3)
            assert (batch.topk_ids[b, i, n:] == PAD).all()
            assert torch.isneginf(batch.topk_logits[b, i, n:]).all()
    assert merged_any  # some trimmed teacher pieces collapsed onto one student id


def test_topk_corpus_resumes_and_refuses_other_settings(teacher_dir, vocab, tmp_path):
    teacher = load_teacher(str(teacher_dir), device="cpu")
    sequences = student_sequences(_lines(10, 5), vocab.tokenizer, seq_len=8)
    extractor = TopKExtractor(teacher, vocab, 4)
    manifest = build_corpus(extractor, sequences, tmp_path, shard_sequences=4, progress=False)
    shards = [tmp_path / s for s in manifest["shards"]]
    before = {s: (s.stat().st_mtime_ns, s.read_bytes()) for s in shards}
    shards[1].unlink()
    build_corpus(extractor, sequences, tmp_path, shard_sequences=4, progress=False)
    for s in shards:
        assert s.read_bytes() == before[s][1]
        if s != shards[1]:
            assert s.stat().st_mtime_ns == before[s][0]  # finished shards are not redone
    with pytest.raises(DpfleetError, match="other settings"):
        build_corpus(TopKExtractor(teacher, vocab, 5), sequences, tmp_path, 4, progress=False)
    with pytest.raises(DpfleetError, match="other settings"):
        build_corpus(extractor, sequences[:-1], tmp_path, 4, progress=False)


def test_cli_builds_tokenizer_and_corpus(teacher_dir, tmp_path, capsys):
    records = tmp_path / "public.jsonl"
    records.write_text(
        "\n".join(json.dumps({"user": f"u{i}", "text": t}) for i, t in enumerate(_lines(60, 9)))
    )
    tok_dir, corpus_dir = tmp_path / "tok", tmp_path / "corpus"
    main(["public", "teacher-tokenizer", "--teacher", str(teacher_dir), "--vocab-size", "560",
          "--dataset", "jsonl", "--path", str(records), "--out", str(tok_dir)])
    assert json.loads(capsys.readouterr().out)["vocab_size"] == 560
    main(["public", "distill-corpus", "--teacher", str(teacher_dir), "--tokenizer", str(tok_dir),
          "--dataset", "jsonl", "--path", str(records), "--out", str(corpus_dir), "--k", "10",
          "--device", "cpu", "--max-records", "20"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["tokens"] > 0 and summary["device"] == "cpu"
    assert len(TopKCorpus(corpus_dir)) == summary["sequences"]


def test_cli_user_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["public", "teacher-tokenizer", "--teacher", str(tmp_path / "missing"),
              "--out", str(tmp_path / "o")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1
    with pytest.raises(SystemExit) as exc:
        main(["public", "distill-corpus", "--tokenizer", str(tmp_path), "--out", str(tmp_path)])
    assert exc.value.code == 2 and "teacher tokenizer" in capsys.readouterr().err
