"""What a population's search cost and found (evollm.run.search), against hand-counted tables."""
import pandas as pd

from evollm.run.search import describe, search_cost


def _lineage(default=(True, False, False), with_flag=True):
    frame = pd.DataFrame({"member": [0, 1, 2, 3], "parent": pd.array([None, None, None, 1], dtype="Int64"),
                          "step": [0, 0, 0, 4], "hp_lr": [5e-5, 5e-4, 1e-5, 6e-4], "hp_beta": [0.0] * 4,
                          "default_founder": [*default, default[1]]})
    return frame if with_flag else frame.drop(columns="default_founder")


# 3 founders train steps 1-4 (12 member-steps); 2 is released at 4; 1's clone 3 and 1 train 5-6 (4 more)
METRICS = pd.DataFrame({"step": [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 6, 6],
                        "member": [0, 1, 2] * 4 + [1, 3, 1, 3]})


def test_the_share_of_member_steps_behind_the_member_returned_and_its_founder():
    cost = search_cost(_lineage(), METRICS, member=3, step=6)
    assert (cost["member_steps"], cost["steps"]) == (16, 6) and cost["share"] == 6 / 16
    assert (cost["founder"], cost["default_founder"], cost["from_default_founder"]) == (1, 0, False)
    assert cost["founder_hyperparameters"] == {"lr": 5e-4}  # beta is the same for every founder: not searched
    assert cost["default_hyperparameters"]["lr"] == 5e-5
    lines = describe(cost)
    assert lines[0] == "the search: 6 of the 16 member-steps (38%) trained the best member's weights"
    assert lines[1] == "  it descends from founder m1 (lr=0.0005); the default founder m0 started at lr=5e-05"  # only what differs
    early = search_cost(_lineage(), METRICS, member=0, step=4)  # an evaluation at step 4 counts steps 1-4 only
    assert (early["member_steps"], early["share"], early["from_default_founder"]) == (12, 4 / 12, True)
    assert "the search found nothing better" in describe(early)[1]
    lineage = pd.concat([_lineage(), pd.DataFrame({"member": [4], "parent": pd.array([0], dtype="Int64"), "step": [4],
                                                   "hp_lr": [6e-5], "hp_beta": [0.0], "default_founder": [True]})])
    mutated = search_cost(lineage, METRICS, member=4, step=4)  # a mutated clone of the default founder
    assert mutated["from_default_founder"] and mutated["member_hyperparameters"]["lr"] == 6e-5
    assert describe(mutated)[1].endswith("its lineage mutated them to lr=6e-05 (from lr=5e-05)")


def test_without_a_default_founder_or_a_population():
    cost = search_cost(_lineage(default=(False, False, False)), METRICS, member=3, step=6)
    assert cost["default_founder"] is None and not cost["from_default_founder"]
    assert describe(cost)[1] == "  it descends from founder m1 (lr=0.0005)"
    old = search_cost(_lineage(with_flag=False), METRICS, member=3, step=6)  # files written before the column
    assert old["default_founder"] is None and old["founder"] == 1
    one = pd.DataFrame({"member": [0], "parent": pd.array([None], dtype="Int64"), "step": [0]})
    assert search_cost(one, METRICS[METRICS["member"] == 0], member=0, step=4) is None
    unknown = search_cost(_lineage(), METRICS, member=9, step=6)  # not in the lineage (e.g. a kept state)
    assert unknown["founder"] is None and len(describe(unknown)) == 1
