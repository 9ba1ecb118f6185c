"""How members are grouped into fused learn passes under a memory budget (evollm.algorithms.memory_plan)."""
from conftest import make_grpo

from evollm.algorithms import memory_plan
from evollm.algorithms.memory_plan import (FUSE_MAX_ACTIVATION_OVER_STATE, activation_bytes_per_token, member_chunks,
                                           member_state_bytes)


def test_member_chunks_follow_the_memory_budget(tiny, monkeypatch):

    model, tok = tiny
    pop = make_grpo(model, tok, n=8)
    monkeypatch.setattr(memory_plan, "FUSE_MAX_ACTIVATION_OVER_STATE", float("inf"))  # fusing allowed: the budget decides
    per_member = 16 * 20 * activation_bytes_per_token(pop[0].shared.model)
    for a in pop:
        a.config.logits_budget_mb = 3 * per_member / 2**20
    chunks = member_chunks(pop, 16, 20)
    assert [len(c) for c in chunks] == [3, 3, 2] and sum(chunks, []) == list(range(8))
    m = pop[0].shared.model
    partial = 16 * (20 * activation_bytes_per_token(m, logits=False)
                    + 5 * (activation_bytes_per_token(m) - activation_bytes_per_token(m, logits=False)))
    for a in pop:  # logits only on the last 5 (completion) positions: more members fit
        a.config.logits_budget_mb = 4 * partial / 2**20
    assert partial < per_member and [len(c) for c in member_chunks(pop, 16, 20, logit_width=5)] == [4, 4]
    for a in pop:
        a.config.logits_budget_mb = 1e6
    assert member_chunks(pop, 16, 20) == [list(range(8))]
    for a in pop:
        a.config.logits_budget_mb = 1e-6
    assert member_chunks(pop, 16, 20) == [[i] for i in range(8)]


def test_default_fuses_only_while_activations_are_small_against_the_state(tiny, monkeypatch):

    monkeypatch.setattr(memory_plan, "FUSE_SMALL_ACTIVATION_MB", 0.0)
    model, tok = tiny
    pop = make_grpo(model, tok, n=4)
    state = member_state_bytes(pop[0])
    adapter = sum(p.numel() * p.element_size() for p in pop[0].shared.parameters(pop[0].adapter_name()))
    assert state == 3 * adapter  # adapter + two Adam moments (before the optimizer has state)
    per_token = activation_bytes_per_token(pop[0].shared.model)
    big = int(FUSE_MAX_ACTIVATION_OVER_STATE * state / per_token) + 1  # tokens per member over the limit
    assert member_chunks(pop, big, 1) == [[0], [1], [2], [3]]
    assert member_chunks(pop, max(1, big // 2 - 1), 1) == [[0, 1, 2, 3]]
    monkeypatch.setattr(memory_plan, "FUSE_SMALL_ACTIVATION_MB", 1.01 * big * per_token / 2**20)  # small in absolute terms
    assert member_chunks(pop, big, 1) == [[0, 1, 2, 3]]
    for a in pop:
        a.config.learn_chunk_members = 2  # the override wins
    assert member_chunks(pop, big, 1) == [[0, 1], [2, 3]]
