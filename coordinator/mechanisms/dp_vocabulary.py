"""A word vocabulary built with user-level DP: Gaussian-thresholded partition selection.

A word vocabulary built from the private clients is itself a release: the top words of the
training text put a word said by one client into the shipped `tokenizer.json`. Here the set of
words is chosen as in Gopi et al. 2020 ("Differentially Private Set Union", Gaussian policy with
weight 1/sqrt(k)) and Google's DP partition selection (Desfontaines, Voss, Gipson, Mandayam
2022, "Differentially private partition selection"):

1. Contribution bounding: each user keeps at most k distinct words (their k most frequent;
   ties by the word itself) and gives each weight 1/sqrt(k), so one user's vector of weights has
   L2 norm <= 1 whatever their text.
2. Gaussian noise N(0, sigma^2) is added to every word's summed weight.
3. A word is kept if its noisy weight passes the threshold tau, chosen so that the words only
   one user holds (at most k of them, each weight 1/sqrt(k)) are released with probability at
   most delta_vocab:  1 - Phi((tau - 1/sqrt(k)) / sigma)^k = delta_vocab.
4. At most `vocab_size - 4` words are kept, by noisy weight (post-processing).

Privacy (add/remove one user, which is zero-out adjacency here: a zeroed user has no words):
on the words both neighbours hold, step 2 is the Gaussian mechanism with L2 sensitivity 1, i.e.
rho-zCDP with rho = 1 / (2 sigma^2); the words only the added user holds are released with
probability <= delta_vocab. So the vocabulary is (eps(rho, delta), delta + delta_vocab)-DP for
every delta, and composed with DP-FTRL's rho_train the run is
(eps(rho_train + rho_vocab, delta), delta + delta_vocab)-DP: Gaussian mechanisms compose by
adding rho exactly (their PLDs compose into a Gaussian's), and the thresholding delta adds.

This module is the mechanism only (selection and its privacy event), over each user's words:
how a text becomes words, and the tokenizer over the kept words, are the caller's
(`engine.vocabulary`), so the privacy layer depends on no tokenizer.

The noise is the AES-CTR Gaussian of `noise_stream` under a fresh 256-bit key that is never
stored: rebuilding the vocabulary of a run is neither possible nor needed (the run directory
keeps the result). Like the default DP-FTRL noise it samples Gaussians in floating point.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable
from dataclasses import dataclass
from statistics import NormalDist

import dp_accounting
import numpy as np

from dpfleet.coordinator.mechanisms.noise_stream import NodeStream, new_noise_key, standard_normals
from dpfleet.errors import DpfleetError

CITATION = ("Gaussian-thresholded partition selection with user-level contribution bounding "
            "(Gopi et al. 2020; Desfontaines et al. 2022)")


@dataclass(frozen=True)
class VocabularyDP:
    """Parameters of the DP word vocabulary (config keys tokenizer.dp_*)."""

    noise: float = 1.0  # sigma of the Gaussian noise on each word's weight (L2 sensitivity 1)
    words_per_user: int = 128  # k: distinct words one user contributes at most
    delta: float = 1e-7  # delta_vocab: chance that a word only one user holds is kept

    def __post_init__(self) -> None:
        if not (self.noise > 0 and math.isfinite(self.noise)):
            raise DpfleetError("tokenizer.dp_noise must be a finite number > 0")
        if not (isinstance(self.words_per_user, int) and self.words_per_user >= 1):
            raise DpfleetError("tokenizer.dp_words_per_user must be an integer >= 1")
        if not 0 < self.delta < 1:
            raise DpfleetError("tokenizer.dp_delta must be in (0, 1)")

    @property
    def weight(self) -> float:
        return 1.0 / math.sqrt(self.words_per_user)

    @property
    def threshold(self) -> float:
        """tau: words held by one user alone pass it with probability <= delta (module doc)."""
        k = self.words_per_user
        per_word = -math.expm1(math.log1p(-self.delta) / k)  # 1 - (1 - delta)^(1/k)
        return self.weight - self.noise * NormalDist().inv_cdf(per_word)

    @property
    def zcdp(self) -> float:
        return 1.0 / (2.0 * self.noise**2)

    def event(self) -> dp_accounting.DpEvent:
        """The selection's privacy event on the words both neighbours hold: the Gaussian of std
        `noise` on weights of L2 sensitivity 1 (the threshold adds `delta`, module doc)."""
        return dp_accounting.GaussianDpEvent(self.noise)

    def describe(self) -> dict:
        return {"mechanism": CITATION, "noise": self.noise, "words_per_user": self.words_per_user,
                "weight": self.weight, "threshold": self.threshold, "zcdp": self.zcdp,
                "delta": self.delta}


def user_words(words: Iterable[str], k: int) -> list[str]:
    """The user's k most frequent distinct words (ties by the word): their bounded contribution."""
    counts = collections.Counter(words)
    return [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k]]


def dp_word_weights(users: Iterable[Iterable[str]], k: int) -> dict[str, float]:
    """Each word's summed weight: the number of users who contribute it, times 1/sqrt(k).

    `users`: each user's words, read once, one user at a time, so a generator over a file
    (`simulation.load_clients`, `engine.vocabulary.words_by_user`) holds one user's words and the
    count table, never the training text; the counts do not depend on the users' order."""
    counts: collections.Counter[str] = collections.Counter()
    for words in users:
        counts.update(user_words(words, k))
    weight = 1.0 / math.sqrt(k)
    return {w: c * weight for w, c in counts.items()}


def select_words(users: Iterable[Iterable[str]], vocab_size: int, params: VocabularyDP,
                 key: bytes | None = None) -> tuple[list[str], dict]:
    """The DP vocabulary's words (best noisy weight first) and a summary without any word;
    `users`: each user's words.

    The noise is the project's CSPRNG Gaussian (AES-256-CTR, `noise_stream`, domain b"vocab")
    under `key`, a fresh 256-bit secret by default (tests pass their own)."""
    if vocab_size < 5:
        raise DpfleetError("tokenizer.vocab_size must leave room for words (>= 5)")
    weights = dp_word_weights(users, params.words_per_user)
    words = sorted(weights)
    stream = NodeStream(new_noise_key() if key is None else key, 0, 0, 0, domain=b"vocab")
    noisy = np.array([weights[w] for w in words]) + params.noise * standard_normals(stream, len(words))
    passed = np.flatnonzero(noisy > params.threshold)
    order = passed[np.argsort(-noisy[passed], kind="stable")][: vocab_size - 4]
    kept = [words[i] for i in order]
    return kept, {**params.describe(), "candidates": len(words), "passed": int(len(passed)),
                  "kept": len(kept)}
