"""What a run's DP guarantee does not cover: the privacy report's "Not covered" list.

The (eps, delta) statement is about the released models (and a DP vocabulary, when there is
one). Everything else a run reads or writes about people is outside it, and a reader of the
report must see that list instead of assuming "everything is covered".
"""

from __future__ import annotations

from collections.abc import Sequence

from dpfleet.coordinator.config import SimulationConfig, public_words

# what one client (the unit of the guarantee) is in each dataset
CLIENT_UNIT = {
    "shakespeare": "one (play, speaker) pair. A character who speaks in several plays (e.g. "
                   "Falstaff) is several clients, and the one real author of every play is all "
                   "of them: the guarantee protects one character's lines in one play, not a "
                   "person who wrote or speaks across plays",
    "jsonl": "one distinct `user` value of the file. A person who appears under several user "
             "values is several clients and is protected only by group privacy (eps grows with "
             "the number of their ids)",
    "wikitext2": "one Wikipedia article (the records are keyed by title); an editor who wrote "
                 "several articles is several clients",
    "kjv": "one Bible chapter; not a person",
}
for _fmt in ("tff_sqlite", "tff_h5", "leaf"):
    CLIENT_UNIT[_fmt] = ("one client id of the file (TFF's StackOverflow: one user; TFF's and LEAF's "
                         "Shakespeare: one (play, character) pair). A person under several ids is "
                         "several clients, protected only by group privacy")
CLIENT_UNIT["shakespeare-solo"] = CLIENT_UNIT["shakespeare"]
CLIENT_UNIT["shakespeare-collab"] = CLIENT_UNIT["shakespeare"]


def nonprivate_vocabulary(cfg: SimulationConfig) -> bool:
    """The run's word vocabulary is chosen from the training clients without DP (a caveat)."""
    tok = cfg.tokenizer
    return tok.kind == "word" and not tok.path and not public_words(tok) and tok.allow_nonprivate_vocabulary


def vocabulary_source(cfg: SimulationConfig) -> dict:
    """Where the run's vocabulary came from and whether the guarantee covers it (privacy.json's
    `vocabulary_source`; the report's vocabulary line). A public file or fixed character set
    reads no private data, so it is covered at no privacy cost."""
    tok = cfg.tokenizer
    if tok.path:
        return {"kind": "folder", "source": f"the tokenizer folder {tok.path}", "covered": None,
                "privacy_cost": "unknown: covered only if it was built from public data"}
    if tok.kind == "char":
        return {"kind": "char", "source": "TFF Shakespeare's fixed character set (86 characters + OOV)",
                "covered": True, "privacy_cost": "none: no data is read"}
    if tok.kind == "sentencepiece":
        return {"kind": "sentencepiece", "source": f"the public corpus {tok.corpus}", "covered": True,
                "privacy_cost": "none: public text outside the private data"}
    if public := public_words(tok):
        what = "word-count file" if tok.word_counts else "word list"
        return {"kind": "word", "source": f"the public {what} {public} (top words, "
                f"{tok.oov_buckets} OOV bucket(s))", "covered": True,
                "privacy_cost": "none: a public file outside the private data"}
    if tok.allow_nonprivate_vocabulary:
        return {"kind": "word", "source": "the private training clients' top words, without DP",
                "covered": False, "privacy_cost": "not accounted: outside the guarantee"}
    return {"kind": "word", "source": "the private training clients' words, chosen with user-level DP",
            "covered": True, "privacy_cost": "accounted: composed with training (see Vocabulary)"}


def not_covered(cfg: SimulationConfig, *, public_data: Sequence[str] = (),
                debug_file: bool = False) -> list[str]:
    """Markdown bullet texts, most important first."""
    data, tok = cfg.data, cfg.tokenizer
    items = []
    if data.generated_population:
        items.append(f"**Everyone, in fact: a generated population** (data.generated_population = "
                     f"{data.generated_population:,}). Real users are cycled to that size, so each "
                     "one's data is in several clients, each accounted as a different person: the "
                     "epsilon of this run protects no real person.")
    if nonprivate_vocabulary(cfg):
        items.append("**The word vocabulary** (`checkpoint/tokenizer/tokenizer.json`): the top "
                     f"{tok.vocab_size - 4} words of every training client's text, chosen without "
                     "DP (tokenizer.allow_nonprivate_vocabulary = true). A word only one client "
                     "used can be in it, so the shipped tokenizer can reveal that client's text.")
    if tok.path:
        items.append(f"The tokenizer loaded from `{tok.path}`: this run cannot tell what data it "
                     "was built from; it is covered only if that was public data (or a DP "
                     "release accounted elsewhere).")
    if debug_file:
        items.append("`debug_nonprivate.jsonl` (debug_nonprivate = true): the mean train loss, "
                     "update norm and clipped fraction of each round's few clients, without "
                     "noise. Anyone who reads it learns about those clients' data.")
    items += [
        f"Held-out evaluation data: the held-out clients ({data.test_fraction:.0%} of users) are "
        "not protected. Accuracy, loss and perplexity in metrics.jsonl, summary.json, "
        "accuracy.png and the progress bar are computed on their data without noise, and the "
        "unigram baseline is fitted on other held-out clients.",
        "Hyper-parameter tuning: choosing this config (noise, clip norm, learning rates, rounds, "
        "vocabulary) from earlier runs on the same private data is not accounted.",
        f"What a client is in this dataset ({data.dataset}): "
        + CLIENT_UNIT.get(data.dataset, "one distinct user key of the dataset") + ".",
    ]
    items += [f"Public data (not private, so not protected and not accounted): {p}."
              for p in public_data]
    return items
