"""The reference device client: trains and suggests from a signed bundle alone.

It is what a phone app does, in Python: no torch, no dpfleet training code (a test imports it with
torch blocked), only numpy, onnxruntime, SentencePiece and `cryptography`, following the rules
the bundle's `manifest.json` states in words (`rules`). The fleet's emulated devices run it, so
the simulation exercises exactly the bytes a phone would ship.

    client = BundleClient("bundle/", public_key_hex)      # verifies signature + every sha256
    client = BundleClient("bundle/", key, min_serial=n)   # ... and refuses a bundle older than n
    rows = client.examples(user_texts, seed=0)            # the manifest's example rule
    delta = client.train_epoch(round_weights, rows, seed=round_seed)
    clipped, norm = client.clip(delta)                    # what the device uploads
    client.suggest("see you to")                          # ["tomorrow", "today", ...]

`weights()` is the bundle's starting vector (a round's weights come from the server);
`initial_state()` / `step(tokens, state)` stream one token per call (recurrent state, or the
transformer's KV cache of seq_len slots) and
`next_logits(prompts)` runs the window program; both read the weights as inputs, so
`set_inference_weights(flat)` makes suggestions follow a new model.

Every byte handed to ONNX Runtime or SentencePiece comes from `verify_bundle`'s checked copy,
never from a second read of the file. The `.pte` path (`runtime="executorch"`) needs ExecuTorch's
Python bindings, which exchange torch tensors: only that path imports torch (a phone's C++ /
Java / Swift runtime takes plain buffers).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dpfleet.edge.bundle_format import (
    BundleError,
    VerifiedBundle,
    bundle_serial,
    check_serial,
    verify_bundle,
)
from dpfleet.edge.clipping import clip_l2
from dpfleet.edge.minibatch import check_examples, fixed_shape_batches
from dpfleet.edge.ort_session import load_session
from dpfleet.edge.tokenizer import BOS, PAD, tokenizer_from_bytes
from dpfleet.edge.word_search import suggest_words, token_texts


class BundleClient:
    """One phone's view of a bundle: verified once at construction, programs loaded lazily."""

    def __init__(self, bundle_dir: Path | str, public_key, *, threads: int = 1,
                 min_serial: int | None = None):
        """`min_serial`: the highest `bundle_serial` this device accepted from the key; an
        older bundle (or one without a serial) is refused. None: any bundle of the key."""
        self.bundle: VerifiedBundle = verify_bundle(Path(bundle_dir), public_key)
        self.threads = threads
        m = self.bundle.manifest
        self.serial = bundle_serial(m, bundle_dir)
        check_serial(self.serial, min_serial, bundle_dir)
        try:
            self.names = [p["name"] for p in m["model"]["parameters"]]
            self.shapes = [tuple(int(d) for d in p["shape"]) for p in m["model"]["parameters"]]
            model = m["model"]  # a zoo config, or a custom module's own vocab_size
            self.vocab_size = int(model["vocab_size"] if model.get("config") is None
                                  else model["config"]["vocab_size"])
            self.seq_len = int(m["examples"]["seq_len"])
            self.max_examples = int(m["examples"]["max_examples"])
            self.lr = float(m["client"]["lr"])
            self.batch_size = int(m["client"]["batch_size"])
            self.clip_norm = float(m["client"]["clip_norm"])
            self.training = dict(m["training"])
            self.inference = dict(m["inference"])
            self.window = dict(self.inference["window"])
            weights_file, tok = m["weights"]["file"], m["tokenizer"]
            meta_name, tok_folder = tok["meta"], tok["folder"]
        except (KeyError, TypeError, ValueError) as exc:
            raise BundleError(f"{bundle_dir}: manifest lacks a field this client needs ({exc!r})") from exc
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self._weights_file = weights_file
        self.tokenizer = tokenizer_from_bytes(
            self.bundle.read(meta_name), lambda name: self.bundle.read(f"{tok_folder}/{name}"),
            f"{bundle_dir}/{meta_name}",
        )
        self._sessions: dict[str, object] = {}
        self._pte = None
        self._stream = None  # (fed ids, logits, state) of the message so far
        self._texts: list[str] | None = None  # what each token appends after a word (suggest)
        self._fits: dict = {}  # suggest's cache of candidate masks
        self.use_streaming = True  # suggest() through step.onnx when the bundle has it
        self._weight_feed: dict[str, np.ndarray] | None = None  # p.<name> inputs of infer / step
        self.last_loss = float("nan")  # mean minibatch loss of the last train_epoch

    def set_inference_weights(self, flat: np.ndarray) -> None:
        """Suggest with this weight vector from now on (default: the bundle's `weights.bin`)."""
        views = self._split(np.array(flat, dtype=np.float32))
        self._weight_feed = {f"p.{n}": w for n, w in zip(self.names, views, strict=True)}
        self._stream = None  # the kept state belongs to the old weights

    def _weights_feed(self) -> dict[str, np.ndarray]:
        if self._weight_feed is None:
            self.set_inference_weights(self.weights())
        return self._weight_feed

    # ---- weights and examples -------------------------------------------------------------
    def weights(self) -> np.ndarray:
        """The bundle's starting weights as one float32 vector (parameters' order)."""
        flat = np.frombuffer(self.bundle.read(self._weights_file), dtype="<f4").astype(np.float32)
        if flat.size != sum(self.sizes):
            raise BundleError(f"{self._weights_file} holds {flat.size} values, the model {sum(self.sizes)}")
        return flat

    def examples(self, texts: Sequence[str], seed: int = 0) -> np.ndarray:
        """The user's texts as int64 rows [n, seq_len + 1] (the manifest's `examples` rule)."""
        rows = []
        for text in texts:
            ids = self.tokenizer.encode(text)
            for start in range(0, len(ids), self.seq_len):
                row = np.full(self.seq_len + 1, PAD, dtype=np.int64)
                chunk = ids[start : start + self.seq_len]
                row[0], row[1 : 1 + len(chunk)] = BOS, chunk
                rows.append(row)
        out = np.stack(rows) if rows else np.zeros((0, self.seq_len + 1), dtype=np.int64)
        if len(out) > self.max_examples:
            keep = np.random.default_rng(seed).choice(len(out), self.max_examples, replace=False)
            out = out[np.sort(keep)]
        return out

    # ---- training ---------------------------------------------------------------------------
    def _session(self, key: str, file: str):
        if key not in self._sessions:
            self._sessions[key] = load_session(self.bundle.read(file), f"{self.bundle.folder}/{file}",
                                               self.threads)
        return self._sessions[key]

    def _split(self, flat: np.ndarray) -> list[np.ndarray]:
        if flat.shape != (sum(self.sizes),):
            raise BundleError(f"weight vector has shape {flat.shape}, expected ({sum(self.sizes)},)")
        parts = np.split(flat, np.cumsum(self.sizes)[:-1])
        return [p.reshape(s) for p, s in zip(parts, self.shapes, strict=True)]

    def train_epoch(
        self,
        weights: np.ndarray,
        examples: np.ndarray,
        lr: float | None = None,
        batch_size: int | None = None,
        seed: int = 0,
        runtime: str = "onnx",
    ) -> np.ndarray:
        """One local epoch of SGD from `weights` over `examples`; returns the (unclipped) delta."""
        lr = self.lr if lr is None else float(lr)
        batch_size = batch_size or self.batch_size
        rows = check_examples(np.asarray(examples), self.vocab_size, self.seq_len)
        theta0 = np.array(weights, dtype=np.float32)
        if runtime == "executorch":
            return self._train_pte(theta0, rows, lr, batch_size, seed) - theta0
        if runtime != "onnx" or "onnx" not in self.training:
            raise BundleError(f"this bundle has no {runtime!r} training program")
        session = self._session("train", self.training["onnx"]["file"])
        theta = theta0.copy()
        views = self._split(theta)  # SGD writes through these views into `theta`
        feeds = [f"p.{n}" for n in self.names]
        step = np.float32(lr)
        losses = []
        for x, y in fixed_shape_batches(rows, batch_size, seed, self.seq_len, pad_rows=False):
            feed = {"inputs": x, "targets": y, **dict(zip(feeds, views, strict=True))}
            loss, *grads = session.run(None, feed)
            losses.append(float(loss))
            for w, g in zip(views, grads, strict=True):
                w -= step * g
        self.last_loss = float(np.mean(losses)) if losses else float("nan")  # the runtimes' mean_loss
        return theta - theta0

    def _train_pte(self, theta0: np.ndarray, rows: np.ndarray, lr: float, batch_size: int, seed: int):
        """The same epoch inside the `.pte` (static batch; its weights live in the program)."""
        import torch  # ExecuTorch's Python bindings take torch tensors

        spec = self.training.get("pte")
        if spec is None:
            raise BundleError("this bundle has no ExecuTorch training program")
        if batch_size != spec["batch"]:
            raise BundleError(f"the .pte program trains batches of {spec['batch']}, not {batch_size}")
        if self._pte is None:
            from dpfleet.edge.pte_module import PteModule

            self._pte = PteModule(self.bundle.read(spec["file"]), Path(spec["file"]))
        method, n = spec["method"], len(self.names)
        pad = np.zeros((batch_size, self.seq_len), dtype=np.int64)
        outs = self._pte.run(method, (torch.from_numpy(pad), torch.from_numpy(pad)))
        params = list(outs[n + 1 : 2 * n + 1])  # the program's own weight tensors (aliases)
        with torch.no_grad():
            for p, w in zip(params, self._split(theta0), strict=True):
                p.copy_(torch.from_numpy(w))
            losses = []
            for x, y in fixed_shape_batches(rows, batch_size, seed, self.seq_len, pad_rows=True):
                outs = self._pte.run(method, (torch.from_numpy(x), torch.from_numpy(y)))
                losses.append(float(outs[0]))
                for p, g in zip(params, outs[1 : n + 1], strict=True):
                    p.add_(g, alpha=-lr)
        self.last_loss = float(np.mean(losses)) if losses else float("nan")
        return torch.cat([p.reshape(-1) for p in params]).numpy().copy()

    def clip(self, delta: np.ndarray, clip_norm: float | None = None) -> tuple[np.ndarray, float]:
        """(clipped delta, its norm before clipping): the manifest's `clipping` rule."""
        if not np.isfinite(delta).all():  # diverged local training contributes nothing
            return np.zeros_like(delta), float("inf")
        return clip_l2(delta, self.clip_norm if clip_norm is None else clip_norm)

    # ---- suggestions ------------------------------------------------------------------------
    def next_logits(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """Next-token logits [len(prompts), V] of token-id prompts (the manifest's window rule)."""
        keep = self.seq_len - 1
        windows = np.full((len(prompts), self.seq_len), PAD, dtype=np.int64)
        last = np.zeros(len(prompts), dtype=np.int64)
        for i, ids in enumerate(prompts):
            p = [BOS, *list(ids)[-keep:]] if keep > 0 else [BOS]
            windows[i, : len(p)] = p
            last[i] = len(p) - 1
        feed = {"tokens": windows, **self._weights_feed()}
        logits = self._session("window", self.window["file"]).run(None, feed)[0]
        return logits[np.arange(len(prompts)), last]

    # ---- streaming (recurrent state or the transformer's KV cache) -------------------------
    @property
    def streaming(self) -> bool:
        return "step" in self.inference or "kv_step" in self.inference

    @property
    def _kv(self) -> dict | None:
        """The KV-cache step's manifest entry (transformer bundles), else None."""
        return self.inference.get("kv_step")

    def _step_spec(self) -> dict:
        if not self.streaming:
            raise BundleError("this bundle has no streaming step program")
        return self._kv or self.inference["step"]

    def initial_state(self, batch: int = 1) -> tuple:
        """The state a message starts from; feed bos_id first. Recurrent: zero (state_h, state_c);
        transformer: zero (keys, values) caches and the next position, 0."""
        spec = self._step_spec()
        try:
            shapes = [spec["cache"]["keys"], spec["cache"]["values"]] if self._kv else \
                [spec["state"]["state_h"], spec["state"]["state_c"]]
            zeros = tuple(np.zeros([batch if d == "batch" else int(d) for d in shape], np.float32)
                          for shape in shapes)
        except (KeyError, TypeError, ValueError) as exc:
            raise BundleError(f"manifest's step entry lacks its state shapes ({exc!r})") from exc
        return (*zeros, 0) if self._kv else zeros

    def step(self, tokens: Sequence[int], state: tuple):
        """Feed one token per row of the batch: (next-token logits [b, V], new state). A KV cache
        is full after `slots` tokens (BOS included): a further step is refused (use the window)."""
        spec = self._step_spec()
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size)):
            raise BundleError(f"step takes a 1-D batch of token ids in [0, {self.vocab_size})")
        session = self._session("step", spec["file"])
        if self._kv:
            keys, values, position = state
            if not 0 <= position < int(spec["slots"]):
                raise BundleError(f"the KV cache holds {spec['slots']} tokens (BOS included); "
                                  "past that use the window program (manifest rules.kv_step)")
            feed = {"token": ids, "position": np.array(position, np.int64), "keys": keys, "values": values}
            logits, keys, values = session.run(None, {**feed, **self._weights_feed()})
            return logits, (keys, values, position + 1)
        feed = {"token": ids, "state_h": state[0], "state_c": state[1], **self._weights_feed()}
        logits, h, c = session.run(None, feed)
        return logits, (h, c)

    def _context(self, ids: list[int]):
        """(next-token logits [V], state) after [BOS, *ids], reusing the last message's state when
        `ids` extends it: a keystroke that completes a word costs one step per new token."""
        full = (BOS, *ids)
        cached = self._stream
        if cached is not None and full[: len(cached[0])] == cached[0]:
            done, logits, state = cached
        else:
            done, logits, state = (), None, self.initial_state()
        for t in full[len(done):]:
            out, state = self.step([t], state)
            logits = out[0]
        self._stream = (full, logits, state)
        return logits, state

    # ---- suggestions ------------------------------------------------------------------------
    def _extend(self, handles: list, tokens: list[int]) -> tuple[np.ndarray, list]:
        """Feed one token to each candidate; (logits [k, V], their new handles)."""
        if isinstance(handles[0], tuple):  # states: batch axis 1 of every array; KV positions agree
            parts = list(zip(*handles, strict=True))
            if self._kv and len(set(parts[-1])) != 1:
                raise BundleError("KV-cache candidates must share one position")
            state = tuple(np.concatenate(x, axis=1) if isinstance(x[0], np.ndarray) else x[0] for x in parts)
            logits, state = self.step(tokens, state)
            return logits, [tuple(x[:, i : i + 1] if isinstance(x, np.ndarray) else x for x in state)
                            for i in range(len(tokens))]
        prompts = [[*ids, t] for ids, t in zip(handles, tokens, strict=True)]
        return self.next_logits(prompts), prompts

    def suggest(self, prefix: str, k: int = 3, max_pieces: int = 8) -> list[str]:
        """Up to k words that complete the word being typed (or, after a space, the next word),
        kept to the tokenizer's lexicon (shipped in the bundle's tokenizer folder): the keyboard's
        word search of `edge.word_search`, the same as `edge.suggest.Predictor.suggest`, so a
        run's keyboard figures are this strip's.

        Each search step runs its candidates as one batch: through the step program while BOS,
        the context and the candidate fit `seq_len` tokens (the context's state is kept between
        calls, so a keystroke costs a step per new token), through the window program past that.
        Within the window both programs see the same tokens, so they give the same strip; a
        longer message is read as the window reads it, the model's training view.
        """
        if self._texts is None:
            self._texts = token_texts(self.tokenizer.encode, self.tokenizer.decode, self.tokenizer.vocab_size)
        return suggest_words(prefix, encode=self.tokenizer.encode, decode=self.tokenizer.decode,
                             texts=self._texts, next_logits=self._search_logits(), k=k,
                             max_pieces=max_pieces, lexicon=getattr(self.tokenizer, "lexicon", None),
                             fits=self._fits)

    def _search_logits(self):
        """`suggest_words`' next-token logits: candidates' states are kept by their token ids
        (each search step extends the survivors of the last by one token)."""
        states: dict[tuple[int, ...], tuple] = {}

        def next_logits(context: list[int], beams: list[tuple[int, ...]]) -> np.ndarray:
            seen = 1 + len(context) + len(beams[0])  # BOS + context + candidate
            stream = self.streaming and self.use_streaming and seen <= self.seq_len
            if stream and not beams[0]:
                logits, states[()] = self._context(context)
                return logits[None]
            if stream and all(b[:-1] in states for b in beams):
                logits, handles = self._extend([states[b[:-1]] for b in beams], [b[-1] for b in beams])
                states.clear()
                states.update(zip(beams, handles, strict=True))
                return logits
            return self.next_logits([[*context, *b] for b in beams])

        return next_logits
