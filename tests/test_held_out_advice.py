"""Too few held-out users: the error says what helps (more users), before planning or training,
and the number it names is one that works (the docs' 2-user example failed with "raise
data.test_fraction", which cannot help 2 users: held-out users are whole users)."""

import pytest
from torch import nn

import dpfleet
from dpfleet.coordinator.engine.evaluation import HELD_OUT_NEEDED, fewest_users, too_few_held_out
from dpfleet.edge.client_data import split_users
from dpfleet.errors import DpfleetError

VOCAB = 16


class Letters:
    vocab_size = VOCAB

    def encode(self, text: str) -> list[int]:
        return [4 + ord(c) % (VOCAB - 4) for c in text]


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 4), nn.Linear(4, VOCAB)

    def forward(self, ids):
        return self.head(self.embed(ids))


CONFIG = {"rounds": 1, "eval_every": 1, "checkpoint_every": 0,
          "data": {"seq_len": 6, "test_fraction": 0.1},
          "dp": {"noise_multiplier": 1.0, "report_goal": 2}, "participation": {"mode": "uniform"}}


def users(n: int) -> dict[str, list[str]]:
    return {f"u{i}": ["see you at noon", "on my way"] for i in range(n)}


@pytest.mark.parametrize("fraction", [0.1, 0.2, 0.25, 0.3, 0.5, 0.05, 0.01])
def test_the_advised_number_of_users_is_the_fewest_that_holds_out_enough(fraction):
    fewest = fewest_users(fraction)

    def split(n):
        return split_users([f"u{i}" for i in range(n)], fraction, seed=0)

    train, test = split(fewest)
    assert len(test) >= HELD_OUT_NEEDED and train
    train, test = split(fewest - 1)
    assert len(test) < HELD_OUT_NEEDED or not train


def test_a_zero_fraction_is_told_to_hold_out_users():
    message = too_few_held_out(0, 0.0)
    assert "test_fraction = 0 holds out no user" in message and "at least 15 users" in message


def test_two_users_are_told_to_bring_more_users_before_planning(tmp_path):
    planned = {**CONFIG, "dp": {"target_epsilon": 8.0}, "participation": {}}
    with pytest.raises(DpfleetError) as error:
        dpfleet.simulate(planned, users=users(2), model=Tiny(), tokenizer=Letters(), progress=False,
                         run_dir=tmp_path / "two")
    message = str(error.value)
    assert "this run has 0" in message and "give at least 15 users" in message
    assert not (tmp_path / "two" / "plan.json").exists()  # failed before the planner ran
    # the advice holds: 15 users run
    result = dpfleet.simulate(CONFIG, users=users(15), model=Tiny(), tokenizer=Letters(),
                              progress=False, run_dir=tmp_path / "fifteen")
    assert [m["round"] for m in result.metrics] == [1]
