"""The field's file formats: TFF SQLite / HDF5, LEAF JSON and jsonl, written here exactly as TFF's
and LEAF's own writers write them, read back record for record; bad files are one error line."""

from __future__ import annotations

import json
import re
import sqlite3
import struct
import tracemalloc

import pytest
from google.protobuf import descriptor_pb2, message_factory

from dpfleet.edge import data_files
from dpfleet.edge.client_data import build_federated, stream_federated
from dpfleet.edge.client_store import write_store
from dpfleet.edge.datasets import load_records
from dpfleet.edge.tf_example import ExampleError, parse_example
from dpfleet.edge.tokenizer import WordTokenizer
from dpfleet.errors import DpfleetError
from tests.cli_helpers import run_here


def _example_class():
    """tf.train.Example from tensorflow/core/example/{feature,example}.proto, without TensorFlow."""
    f = descriptor_pb2.FileDescriptorProto(name="tf_example_test.proto", package="tensorflow",
                                           syntax="proto3")
    lab_rep, lab_opt = (descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED,
                        descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    T = descriptor_pb2.FieldDescriptorProto
    for name, kind in (("BytesList", T.TYPE_BYTES), ("FloatList", T.TYPE_FLOAT), ("Int64List", T.TYPE_INT64)):
        f.message_type.add(name=name).field.add(name="value", number=1, type=kind, label=lab_rep)
    feature = f.message_type.add(name="Feature")
    feature.oneof_decl.add(name="kind")
    for i, (name, kind) in enumerate((("bytes_list", "BytesList"), ("float_list", "FloatList"),
                                      ("int64_list", "Int64List")), 1):
        feature.field.add(name=name, number=i, type=T.TYPE_MESSAGE, type_name=f".tensorflow.{kind}",
                          label=lab_opt, oneof_index=0)
    features = f.message_type.add(name="Features")
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=T.TYPE_STRING, label=lab_opt)
    entry.field.add(name="value", number=2, type=T.TYPE_MESSAGE, type_name=".tensorflow.Feature",
                    label=lab_opt)
    features.field.add(name="feature", number=1, type=T.TYPE_MESSAGE, label=lab_rep,
                       type_name=".tensorflow.Features.FeatureEntry")
    f.message_type.add(name="Example").field.add(name="features", number=1, type=T.TYPE_MESSAGE,
                                                 type_name=".tensorflow.Features", label=lab_opt)
    return message_factory.GetMessages([f])["tensorflow.Example"]


Example = _example_class()


def serialize(**features) -> bytes:
    """What TFF's `_build_serializer` makes of one element: str -> bytes_list, float -> float_list,
    int -> int64_list."""
    ex = Example()
    for key, value in features.items():
        feat = ex.features.feature[key]
        if isinstance(value, str):
            feat.bytes_list.value.append(value.encode())
        elif isinstance(value, float):
            feat.float_list.value.append(value)
        else:
            feat.int64_list.value.extend(value if isinstance(value, list) else [value])
    return ex.SerializeToString()


def write_tff_sqlite(path, clients: dict[str, list[dict]], split: str = "N/A") -> None:
    """`sql_client_data_utils.save_to_sql_client_data`'s tables and inserts, client by client."""
    with sqlite3.connect(path) as con:
        if not con.execute("SELECT name FROM sqlite_master WHERE name = 'examples'").fetchone():
            con.execute("CREATE TABLE examples (split_name TEXT NOT NULL, client_id TEXT NOT NULL, "
                        "serialized_example_proto BLOB NOT NULL);")
            con.execute("CREATE TABLE client_metadata (client_id TEXT NOT NULL, split_name TEXT NOT "
                        "NULL, num_examples INTEGER NOT NULL);")
        for client_id, elements in clients.items():
            for elem in elements:
                con.execute("INSERT INTO examples (split_name, client_id, serialized_example_proto) "
                            "VALUES (?, ?, ?);", (split, client_id, serialize(**elem)))
            con.execute("INSERT INTO client_metadata (client_id, split_name, num_examples) VALUES "
                        "(?, ?, ?);", (client_id, split, len(elements)))
    con.close()


def stackoverflow(user: str, n: int) -> list[dict]:
    return [{"tokens": f"post {k} of {user} ? é", "title": f"title {k}", "tags": "python|sql",
             "creation_date": "2010-01-08 09:34:05.073 UTC", "score": k - 1, "type": "question"}
            for k in range(n)]


SO = {"00000001": stackoverflow("00000001", 3), "00000003": stackoverflow("00000003", 1),
      "00000002": stackoverflow("00000002", 2)}


def test_example_decoder_reads_protobufs_encoding():
    blob = serialize(tokens="a b c", score=-3, ids=[1, 300, 2**40], weight=0.5)
    assert parse_example(blob) == {"tokens": [b"a b c"], "score": [-3], "ids": [1, 300, 2**40],
                                   "weight": [0.5]}
    # unpacked repeated scalars (another writer) read the same as packed ones
    def length_delimited(field: int, body: bytes) -> bytes:
        return bytes([field << 3 | 2, len(body)]) + body

    def example(name: bytes, kind: int, values: bytes) -> bytes:
        entry = length_delimited(1, name) + length_delimited(2, length_delimited(kind, values))
        return length_delimited(1, length_delimited(1, entry))

    assert parse_example(example(b"n", 3, b"\x08\x05\x08\x07")) == {"n": [5, 7]}  # varint 5, 7
    assert parse_example(example(b"f", 2, b"\x0d" + struct.pack("<f", 1.5))) == {"f": [1.5]}
    with pytest.raises(ExampleError, match="claims"):
        parse_example(blob[:-3])


def test_tff_sqlite_round_trips_every_record_by_split(tmp_path):
    db = tmp_path / "stackoverflow.sqlite"
    write_tff_sqlite(db, SO, split="train")
    write_tff_sqlite(db, {"00000009": stackoverflow("00000009", 2)}, split="test")
    got = list(data_files.iter_clients(db, "tff_sqlite", "train"))
    assert got == [(u, [e["tokens"] for e in SO[u]]) for u in sorted(SO)]
    assert [u for u, _ in data_files.iter_clients(db, split="test")] == ["00000009"]
    assert len(list(data_files.iter_clients(db, split=""))) == 4
    records = load_records("tff_sqlite", "train", db, feature="title")
    assert [(r.user, r.text) for r in records] == [(u, e["title"]) for u in sorted(SO) for e in SO[u]]


def test_tff_sqlite_shakespeare_snippets_written_with_tffs_default_split(tmp_path):
    db = tmp_path / "shakespeare.sqlite"
    plays = {"THE_TEMPEST_MIRANDA": [{"snippets": "O, I have suffered\nWith those that I saw suffer!"}],
             "HAMLET_HAMLET": [{"snippets": "To be, or not to be"}, {"snippets": "Words, words, words."}]}
    write_tff_sqlite(db, plays)  # save_to_sql_client_data writes split_name 'N/A'
    assert dict(data_files.iter_clients(db, split="N/A")) == {
        u: [e["snippets"] for e in ex] for u, ex in plays.items()}
    with pytest.raises(DpfleetError, match=r"no split 'train'; the file has N/A \(data.split, or --split\)"):
        list(data_files.iter_clients(db, split="train"))


def _cli_error(*args) -> str:
    out = run_here("data", "inspect", *args)
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    return lines[0]


def test_tff_sqlite_bad_files_are_one_error_line_naming_file_row_and_expectation(tmp_path):
    db = tmp_path / "bad.sqlite"
    write_tff_sqlite(db, {"u1": [{"tokens": "fine"}]}, split="train")
    with sqlite3.connect(db) as con:
        con.execute("INSERT INTO examples VALUES ('train', 'u2', ?)", (serialize(tokens="ok")[:-2],))
    con.close()
    line = _cli_error(str(db))
    assert f"{db}: examples row 2 (client 'u2'): expected a serialized tf.train.Example" in line

    wrong = tmp_path / "wrong.sqlite"
    write_tff_sqlite(wrong, {"u1": [{"pixels": 0.5}]}, split="train")
    assert (f"{wrong}: examples row 1 (client 'u1'): expected a text feature (tokens, snippets, "
            "text), found pixels") in _cli_error(str(wrong))

    no_meta = tmp_path / "nometa.sqlite"
    with sqlite3.connect(no_meta) as con:
        con.execute("CREATE TABLE examples (split_name TEXT, client_id TEXT, serialized_example_proto BLOB)")
    con.close()
    assert f"{no_meta}: no table client_metadata; expected TFF's SqlClientData" in _cli_error(str(no_meta))

    big = tmp_path / "big.sqlite"
    write_tff_sqlite(big, {f"u{i:03d}": stackoverflow(f"u{i}", 20) for i in range(40)}, split="train")
    truncated = tmp_path / "truncated.sqlite"
    truncated.write_bytes(big.read_bytes()[: big.stat().st_size // 2])
    line = _cli_error(str(truncated), "--format", "tff_sqlite")
    assert str(truncated) in line and ("truncated or corrupt" in line or "not a readable SQLite" in line)


def test_tff_h5_round_trips_tffs_layout(tmp_path):
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "shakespeare_train.h5"
    plays = {"ALL_S_WELL_THAT_ENDS_WELL_KING": ["No, no, no, your son was misled", "Come, sir."],
             "THE_TEMPEST_ARIEL": ["All hail, great master! grave sir, hail!"]}
    with h5py.File(path, "w") as f:  # TFF's HDF5ClientData: examples/<client_id>/<feature>
        for client, snippets in plays.items():
            f.create_dataset(f"examples/{client}/snippets", data=[s.encode() for s in snippets],
                             dtype=h5py.string_dtype(encoding="utf-8"))
    assert dict(data_files.iter_clients(path)) == plays
    assert data_files.client_ids(path) == sorted(plays)
    assert data_files.infer_format(path) == "tff_h5"

    bad = tmp_path / "bad.h5"
    with h5py.File(bad, "w") as f:
        f.create_dataset("clients/u1/snippets", data=[b"x"])
    assert f"{bad}: no group 'examples'; expected TFF's layout examples/<client_id>/<feature>" in (
        _cli_error(str(bad)))


def leaf_shakespeare(lines_by_user: dict[str, list[str]], seq_length: int = 80) -> dict:
    """LEAF's `shake_utils.__txt_to_data` / `parse_data_in`: windows of 80 characters -> next one."""
    all_data = {"users": [], "hierarchies": [], "num_samples": [], "user_data": {}}
    for user, lines in lines_by_user.items():
        data_x, data_y = [], []
        for line in [" " * seq_length + re.sub(r"   *", " ", ln) for ln in lines]:
            for i in range(0, len(line) - seq_length):
                data_x.append(line[i : i + seq_length])
                data_y.append(line[i + seq_length])
        all_data["users"].append(user)
        all_data["hierarchies"].append("PLAY")
        all_data["num_samples"].append(len(data_y))
        all_data["user_data"][user] = {"x": data_x, "y": data_y}
    return all_data


def test_leaf_shakespeare_windows_join_back_into_lines_and_sent140_keeps_text(tmp_path):
    pytest.importorskip("ijson")
    speeches = {"THE_TEMPEST_MIRANDA": ["If by your art, my dearest father, you have\n",
                                        "Put the wild waters in this roar, allay them.\n"],
                "HAMLET_HORATIO": ["Well, sit we down,\n"]}
    folder = tmp_path / "train"
    folder.mkdir()
    with open(folder / "all_data_0.json", "w") as fh:
        json.dump(leaf_shakespeare(speeches), fh)
    tweets = {"user_a": [["1467810369", "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY", "user_a", "upset"]],
              "user_b": [["1", "d", "NO_QUERY", "user_b", "hello"], ["2", "d", "NO_QUERY", "user_b", "hi"]]}
    with open(folder / "all_data_1.json", "w") as fh:  # data_to_json.py: x = row[1:], y = 0 / 1
        json.dump({"users": list(tweets), "num_samples": [len(v) for v in tweets.values()],
                   "user_data": {u: {"x": x, "y": [0] * len(x)} for u, x in tweets.items()}}, fh)
    got = dict(data_files.iter_clients(folder))
    assert got == {**{u: [ln.strip() for ln in lines] for u, lines in speeches.items()},
                   **{u: [row[-1] for row in x] for u, x in tweets.items()}}
    assert data_files.infer_format(folder) == "leaf"
    assert data_files.client_ids(folder) == [*speeches, *tweets]


def test_leaf_bad_files_are_one_error_line(tmp_path):
    pytest.importorskip("ijson")
    good = json.dumps(leaf_shakespeare({"A": ["a line of verse\n"], "B": ["another line\n"]}))
    cut = tmp_path / "cut.json"
    cut.write_text(good[: len(good) - 40])
    line = _cli_error(str(cut))
    assert f"{cut}: not valid JSON after 1 users of user_data (parse error: premature EOF); the file is "
    assert "truncated or malformed; expected LEAF's" in line
    head = tmp_path / "head.json"
    head.write_text(good[:20])
    assert f"{head}: not valid JSON (parse error: premature EOF)" in _cli_error(str(head))
    with pytest.raises(DpfleetError, match=r"head.json: not valid JSON \(parse error: premature EOF\); exp"):
        data_files.client_ids(head)
    bad_second_user = tmp_path / "bad_second_user.json"  # valid JSON up to the second user's data
    bad_second_user.write_text(good.replace('"B": {"x"', '"B": {"x" 1'))
    assert f"{bad_second_user}: not valid JSON after 1 users of user_data" in _cli_error(str(bad_second_user))
    femnist = tmp_path / "femnist.json"
    femnist.write_text(json.dumps({"users": ["f0"], "num_samples": [1],
                                   "user_data": {"f0": {"x": [[0.0, 1.0]], "y": [3]}}}))
    assert (f"{femnist}: user_data['f0'], sample 0: x is list; expected text (a string, or a list "
            "ending in one as in Sent140)") in _cli_error(str(femnist))
    lying = tmp_path / "lying.json"
    lying.write_text(json.dumps({"users": ["u"], "num_samples": [5],
                                 "user_data": {"u": {"x": ["a"], "y": [1]}}}))
    assert f"{lying}: user_data['u']: 1 samples, num_samples says 5" in _cli_error(str(lying))


def test_inspect_summarises_users_examples_and_token_percentiles(tmp_path):
    path = tmp_path / "users.jsonl"
    # examples per user 1, 2, 3, 10; tokens per user 2, 4, 9, 10 (lines of 2, 2+2, 3x3, 10x1 words)
    lines = ([("a", "one two")] + [("b", "x y")] * 2 + [("c", "p q r")] * 3 + [("d", "w")] * 10)
    path.write_text("".join(json.dumps({"user": u, "text": t}) + "\n" for u, t in lines))
    out = run_here("data", "inspect", str(path), "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    # numpy's "lower" percentiles of [1, 2, 3, 10]: p50 -> rank 1.5 -> 2, p90 -> 2.7 -> 3, p99 -> 3
    assert info["users"] == 4 and info["examples"] == 16 and info["tokens"] == 25
    assert info["examples_per_user"] == {"p50": 2, "p90": 3, "p99": 3, "max": 10}
    assert info["tokens_per_user"] == {"p50": 4, "p90": 9, "p99": 9, "max": 10}
    text = run_here("data", "inspect", str(path)).stdout.splitlines()
    assert text[0] == f"{path} (jsonl): 4 users, 16 examples, 25 tokens"
    assert text[2].split() == ["examples", "2", "3", "3", "10"]


N_CLIENTS, PER_CLIENT, WORDS = 600, 4, 30
ONE_CLIENT = PER_CLIENT * WORDS * 5  # bytes of one client's text, about


@pytest.fixture(scope="module")
def many_clients(tmp_path_factory):
    """A TFF SQLite file of 600 clients (4 examples of 30 words each), written once."""
    db = tmp_path_factory.mktemp("many") / "many.sqlite"
    write_tff_sqlite(db, {f"{i:06d}": [{"tokens": " ".join(["word"] * WORDS) + f" {i % 7} {k}"}
                                       for k in range(PER_CLIENT)] for i in range(N_CLIENTS)},
                     split="train")
    return db


def test_reading_a_file_of_many_clients_holds_one_client_at_a_time(many_clients):
    tracemalloc.start()
    try:
        clients = 0
        for _, texts in data_files.iter_clients(many_clients, "tff_sqlite", "train"):
            clients += len(texts) == PER_CLIENT
        streamed_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        whole = load_records("tff_sqlite", "train", many_clients)
        whole_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert clients == N_CLIENTS and len(whole) == N_CLIENTS * PER_CLIENT
    # the whole file's records take > 600 clients' worth; streaming stays within a few clients
    assert whole_peak > 100 * ONE_CLIENT
    assert streamed_peak < 20 * ONE_CLIENT, (streamed_peak, ONE_CLIENT)


def test_population_built_from_a_file_streams_into_the_store_and_equals_the_lists(many_clients, tmp_path):
    tokenizer = WordTokenizer(["word", *map(str, range(7))])
    settings = {"seq_len": 20, "max_examples": 8, "test_fraction": 0.1, "seed": 3, "max_clients": None}

    def streamed(db, cache):
        train, held_out = stream_federated(
            lambda: data_files.iter_clients(db, "tff_sqlite", "train"), tokenizer, tuple(settings.values()))
        return write_store(train, tokenizer.vocab_size, cache, "tff_sqlite", chunk_rows=100), held_out

    small = tmp_path / "small.sqlite"  # a first call's one-off costs (numpy.random's lazy import
    # when a client is capped: ~0.5 MB) are not data, so they are paid here first
    write_tff_sqlite(small, {f"u{i}": [{"tokens": "word 1 2"}] * (i + 1) for i in range(20)}, split="train")
    streamed(small, tmp_path / "warm")
    tracemalloc.start()
    try:
        store, held_out = streamed(many_clients, tmp_path / "cache")
        stream_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        lists = build_federated(load_records("tff_sqlite", "train", many_clients), tokenizer, **settings)
        lists_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Held on purpose: the 600 user ids and the 60 held-out clients (about 1 kB each). The 540
    # training clients' text and rows (the lists' peak, about 1.5 MB; streamed about 0.18 MB) are
    # never held together.
    assert lists_peak > 1_000_000 and stream_peak < 300_000, (stream_peak, lists_peak)
    assert store.users == [c.user for c in lists.train] and len(store) == 540
    assert all((store.examples(i) == c.examples).all() for i, c in enumerate(lists.train))
    assert [c.user for c in held_out] == [c.user for c in lists.test]
    assert all((a.examples == b.examples).all() for a, b in zip(held_out, lists.test, strict=True))


def test_a_run_streams_a_tff_file_into_the_same_population_as_the_lists(tmp_path, monkeypatch):
    from dpfleet.coordinator.config import parse_config
    from dpfleet.coordinator.engine import population, simulation
    from dpfleet.coordinator.engine.population import open_population

    db = tmp_path / "so.sqlite"
    write_tff_sqlite(db, {f"{i:04d}": stackoverflow(f"{i:04d}", 1 + i % 5) for i in range(40)}, split="train")
    WordTokenizer(["post", "of", "?", *(f"{i:04d}" for i in range(40))]).save(tmp_path / "tok")
    cfg = parse_config({"data": {"dataset": "tff_sqlite", "path": str(db), "seq_len": 4, "max_examples": 2,
                                 "test_fraction": 0.2},
                        "tokenizer": {"path": str(tmp_path / "tok")}})
    tokenizer, lists = simulation.prepare_data(cfg, tmp_path / "vocab")
    by_lists = open_population(cfg, lists.train, tokenizer.vocab_size, cache=tmp_path / "lists")

    def no_lists(*args, **kwargs):
        raise AssertionError("the list path read the file")

    monkeypatch.setattr(simulation, "load_records", no_lists)
    monkeypatch.setattr(population, "population_cache", lambda: tmp_path / "streamed")
    _, data, streamed = simulation.load_clients(cfg, tmp_path / "vocab", None, None, None)
    assert streamed.users == by_lists.users and len(streamed) == 32
    assert (streamed.rows[:] == by_lists.rows[:]).all() and (streamed.offsets[:] == by_lists.offsets[:]).all()
    assert data.train == [] and [c.user for c in data.test] == [c.user for c in lists.test]


def test_streaming_refuses_a_client_the_files_index_does_not_list(tmp_path):
    db = tmp_path / "unlisted.sqlite"
    write_tff_sqlite(db, {"a": [{"tokens": "post"}], "b": [{"tokens": "of"}]}, split="train")
    with sqlite3.connect(db) as con:  # examples of a client with no client_metadata row
        con.execute("INSERT INTO examples VALUES ('train', 'c', ?)", (serialize(tokens="post of"),))
    con.close()
    assert data_files.client_ids(db, "tff_sqlite", "train") == ["a", "b"]
    train, _ = stream_federated(lambda: data_files.iter_clients(db, "tff_sqlite", "train"),
                                WordTokenizer(["post", "of"]), (4, 2, 0.0, 0, None),
                                data_files.client_ids(db, "tff_sqlite", "train"))
    with pytest.raises(DpfleetError, match="client 'c' has examples but is not in the file's list"):
        list(train)
