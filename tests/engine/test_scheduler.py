"""The scheduler on data only: admission policies, prefill budgets, chunking, checkpoints,
restores, forks and retraction, with no model (a step's "forward" is the bookkeeping the
engine does after it: positions computed, one token appended per sampled row)."""

from __future__ import annotations

import itertools

import pytest

from glmrt.cache.page_manager import PageManager
from glmrt.cache.radix import RadixCache
from glmrt.cache.slot_manager import CHECKPOINT, SlotManager
from glmrt.engine.config import EngineConfig
from glmrt.engine.request import Request, Status
from glmrt.engine.scheduler import Scheduler, SchedulerConfig, StepPlan
from glmrt.sampling_params import SamplingParams

PS = 4
_arrival = itertools.count()


def make(num_pages=64, num_slots=16, radix=True, **cfg) -> Scheduler:
    cfg.setdefault("max_running_requests", 8)
    pages, slots = PageManager(num_pages), SlotManager(num_slots)
    return Scheduler(SchedulerConfig(page_size=PS, **cfg), pages, slots,
                     RadixCache(PS, pages, slots, enabled=radix))


def submit(s: Scheduler, prompt: list[int], n: int = 1) -> Request:
    req = Request(f"r{next(_arrival)}", list(prompt), SamplingParams(max_tokens=8, n=n), next(_arrival))
    s.add(req)
    for i in range(1, n):
        child = Request(f"{req.rid}-{i}", list(prompt), req.params, next(_arrival), fork_parent=req)
        req.fork_children.append(child)
        s.add(child)
    return req


def advance(s: Scheduler, plan: StepPlan, token: int = 7) -> None:
    """What the engine does after the forward, without the model."""
    for w in plan.work:
        w.req.num_computed = w.start + w.num
        if w.sample:
            w.req.output_ids.append(token)
    for f in plan.forks:
        f.child.output_ids.append(token)
    for r in plan.restores:
        r.checkpoint.pins -= 1
    for sv in plan.saves:
        s.tree.insert(sv.req.key_ids[:sv.req.num_computed], sv.req.pages)
        if s.tree.add_checkpoint(sv.req.key_ids, sv.position, sv.dst_slot, sv.dst_page) is None:
            s.slots.free(sv.dst_slot)  # no tree (or the same state twice): the copy is dropped
            if sv.dst_page is not None:
                s.pages.release([sv.dst_page])


def finish(s: Scheduler, req: Request) -> None:
    """A finished request leaves its full pages in the tree and gives its own back."""
    s.tree.insert(req.key_ids[:req.num_computed], req.pages)
    s.free_request(req)
    req.status = Status.FINISHED


def work_of(plan: StepPlan) -> list[tuple[str, int, int, bool]]:
    return [(w.req.rid, w.start, w.num, w.sample) for w in plan.work]


def test_engine_config_refuses_unknown_policies_and_empty_budgets():
    # the scheduler's config is built from an EngineConfig, whose declared bounds are the one check
    with pytest.raises(ValueError, match="schedule_policy"):
        EngineConfig(schedule_policy="random")
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        EngineConfig(chunked_prefill_size=0)
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        EngineConfig(max_prefill_tokens=0)
    assert EngineConfig(max_running_requests=64, max_num_batched_tokens=64).max_num_batched_tokens == 64
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_running_requests"):
        EngineConfig(max_running_requests=64, max_num_batched_tokens=63)   # vLLM's rule
    with pytest.raises(ValueError, match=r"max_num_batched_tokens must be >= speculative_num_steps \+ 1 \(6\)"):
        EngineConfig(speculative_algorithm="MTP", speculative_num_steps=5, max_num_batched_tokens=5)
    assert EngineConfig(speculative_algorithm="MTP", max_num_batched_tokens=4).max_num_batched_tokens == 4


def test_fcfs_admits_in_arrival_order_within_the_running_cap():
    s = make(max_running_requests=2)
    a, b, c = (submit(s, [i] * 5) for i in (1, 2, 3))
    plan = s.schedule()
    assert work_of(plan) == [(a.rid, 0, 5, True), (b.rid, 0, 5, True)]
    assert s.running == [a, b] and s.waiting == [c]
    assert a.pages and a.slot is not None and c.slot is None


def test_the_prefill_budget_and_chunk_size_split_long_prompts():
    s = make(chunked_prefill_size=6, max_prefill_tokens=10)
    a, b = submit(s, list(range(14))), submit(s, list(range(100, 105)))
    plan = s.schedule()
    assert work_of(plan) == [(a.rid, 0, 6, False), (b.rid, 0, 4, False)]  # b gets the rest of the budget
    advance(s, plan)
    plan = s.schedule()                              # b's last prompt token is a decode row: first
    assert work_of(plan) == [(b.rid, 4, 1, True), (a.rid, 6, 6, False)]
    advance(s, plan)
    plan = s.schedule()
    assert work_of(plan) == [(b.rid, 5, 1, True), (a.rid, 12, 2, True)]
    assert sum(w.num for w in plan.work) <= 10


def test_a_page_shortage_retracts_the_newest_running_request():
    s = make(num_pages=4, radix=False)
    old, new = submit(s, [1] * 8), submit(s, [2] * 7)
    plan = s.schedule()
    advance(s, plan)                                 # old: 9 tokens (3 pages), new: 8 tokens (2 pages)
    assert s.pages.num_free == 0 and [len(r.pages) for r in (old, new)] == [2, 2]
    plan = s.schedule()                              # old needs a third page: new makes room
    assert plan.retracted == [new] and work_of(plan) == [(old.rid, 8, 1, True)]
    assert new.status is Status.WAITING and s.waiting[0] is new
    assert (new.num_computed, new.pages, new.slot) == (0, [], None)
    assert new.output_ids == [7]                     # outputs are kept and recomputed with the prompt
    s.pages.check()
    s.slots.check()


def test_a_request_retracts_itself_when_only_planned_requests_hold_pages():
    s = make(num_pages=4, radix=False)
    old, new = submit(s, [1] * 7), submit(s, [2] * 8)
    advance(s, s.schedule())
    plan = s.schedule()                              # old's decode fits its pages and is planned first;
    assert plan.retracted == [new]                   # new needs a third page that nobody can give
    # its pages are free again: it is re-admitted at once, recomputing from position 0
    assert work_of(plan) == [(old.rid, 7, 1, True), (new.rid, 0, 8, False)]
    assert new.output_ids == [7] and s.pages.num_free == 0


def test_admission_saves_the_state_at_the_prompt_end_and_every_interval():
    s = make(state_checkpoint_interval=4, chunked_prefill_size=100)
    r = submit(s, list(range(10)))
    plan = s.schedule()
    assert work_of(plan) == [(r.rid, 0, 4, False)]   # chunks end where a state is saved
    assert r.save_at == [8, 10]
    assert [(sv.position, sv.src_page) for sv in plan.saves] == [(4, None)]
    advance(s, plan)
    plan = s.schedule()
    assert work_of(plan) == [(r.rid, 4, 4, False)]
    advance(s, plan)
    plan = s.schedule()
    (save,) = plan.saves                             # 10 is not page-aligned: its partial page is copied
    assert work_of(plan) == [(r.rid, 8, 2, True)] and save.position == 10
    assert save.src_page == r.pages[2] and save.dst_page is not None
    assert s.slots.kind(save.dst_slot) == CHECKPOINT


def test_a_cached_checkpoint_is_restored_and_pinned_until_the_restore_ran():
    s = make()
    prompt = list(range(10))
    first = submit(s, prompt + [50, 51])
    advance(s, s.schedule())                         # saves at the prompt end (12)
    finish(s, first)
    r = submit(s, prompt + [50, 51, 60, 61, 62])
    plan = s.schedule()
    (restore,) = plan.restores
    assert restore.checkpoint.position == 12 and restore.checkpoint.pins == 1
    assert r.num_computed == 12 and r.cached_tokens == 12
    assert work_of(plan) == [(r.rid, 12, 3, True)]
    assert r.pages[:3] == s.tree.match_pages(prompt + [50, 51], 12)[0]   # shared, not copied
    advance(s, plan)
    assert restore.checkpoint.pins == 0


def test_lpm_admits_the_longest_cached_prefix_first():
    s = make(policy="lpm", max_running_requests=1)
    system = list(range(12))
    done = submit(s, system)
    advance(s, s.schedule())
    finish(s, done)
    cold = submit(s, [99] * 6)
    warm = submit(s, system + [40, 41])
    plan = s.schedule()
    assert [w.req for w in plan.work] == [warm] and s.waiting == [cold]
    fcfs = make(max_running_requests=1)
    cold2, warm2 = submit(fcfs, [99] * 6), submit(fcfs, system + [40, 41])
    assert [w.req for w in fcfs.schedule().work] == [cold2] and fcfs.waiting == [warm2]


def test_a_request_waits_for_a_running_prefill_of_its_prefix():
    s = make(chunked_prefill_size=8, max_prefill_tokens=8)
    system = list(range(12))
    a = submit(s, system + [70, 71])
    advance(s, s.schedule())                         # a is half way through the shared prefix
    b = submit(s, system + [80, 81])
    plan = s.schedule()
    assert [w.req for w in plan.work] == [a] and b in s.waiting
    assert work_of(plan) == [(a.rid, 8, 4, False)]  # a stops where b diverges, and saves there
    assert [sv.position for sv in plan.saves] == [12]
    advance(s, plan)
    plan = s.schedule()
    assert b in s.running and b.num_computed == 12   # b resumes from a's checkpoint


def test_n_choices_fork_from_the_parents_prompt_end():
    s = make()
    parent = submit(s, list(range(6)), n=3)
    plan = s.schedule()
    assert work_of(plan) == [(parent.rid, 0, 6, True)]   # the children wait, unscheduled
    assert [f.child.rid for f in plan.forks] == [f"{parent.rid}-1", f"{parent.rid}-2"]
    for f in plan.forks:
        child = f.child
        assert child.status is Status.RUNNING and child.num_computed == 6 and child.cached_tokens == 6
        assert child.pages[0] == parent.pages[0] and child.pages[1] != parent.pages[1]
        assert f.src_page == parent.pages[1] and f.dst_page == child.pages[1]
    assert s.pages.refcount(parent.pages[0]) == 3
    assert not s.waiting and not parent.fork_children


def test_free_request_gives_everything_back_and_forked_children_alone_are_no_work():
    s = make()
    assert not s.has_work()
    parent = submit(s, list(range(6)), n=2)
    plan = s.schedule()
    (child,) = [r for r in s.running if r is not parent]
    for r in (parent, child):
        s.free_request(r)
    assert not s.running and not s.has_work()
    (save,) = plan.saves                             # the planned checkpoint copy is not theirs to free
    assert s.pages.num_free == s.pages.num_pages - 1 and save.dst_page is not None
    assert s.slots.num_live == 0 and s.slots.num_checkpoint == 1
    waiting_child = Request("c", [1, 2], SamplingParams(), next(_arrival), fork_parent=parent)
    s.add(waiting_child)                             # waits for a parent's prefill: not work by itself
    assert not s.has_work()


def decoding(s: Scheduler, n: int, length: int = 3) -> list[Request]:
    """n running requests whose prompts are computed: each is a decode row in the next step."""
    reqs = [submit(s, [50 + i] * length) for i in range(n)]
    plan = s.schedule()
    assert sorted(w.req.rid for w in plan.work) == sorted(r.rid for r in reqs)
    advance(s, plan)
    assert all(r.num_uncomputed == 1 for r in reqs)
    return reqs


def test_a_token_budget_gives_prefills_what_the_decodes_leave():
    s = make(max_num_batched_tokens=20, chunked_prefill_size=100)
    decodes = decoding(s, 4)
    long = submit(s, list(range(200)))
    for start in (0, 16):                            # admitted, then a running prefill chunk
        plan = s.schedule()
        assert work_of(plan) == [(r.rid, 3 + start // 16, 1, True) for r in decodes] + [(long.rid, start, 16, False)]
        assert plan.num_tokens == 20
        advance(s, plan)
    s2 = make(max_num_batched_tokens=20, chunked_prefill_size=100)
    submit(s2, list(range(200)))                     # no decode: min(N, max_prefill_tokens)
    assert [w.num for w in s2.schedule().work] == [20]


def test_a_drafting_decode_costs_its_draft_tokens_too():
    pages, slots = PageManager(64), SlotManager(16)
    s = Scheduler(SchedulerConfig(page_size=PS, max_running_requests=8, max_num_batched_tokens=12), pages, slots,
                  RadixCache(PS, pages, slots), draft_depth=lambda r: 3, max_drafting=1)
    a, b = decoding(s, 2)
    long = submit(s, list(range(100)))
    plan = s.schedule()                              # a: 1 + 3 drafts, b (no snapshot left): 1
    assert [(w.req, w.num, w.draft) for w in plan.work] == [(a, 1, 3), (b, 1, 0), (long, 7, 0)]


def test_decodes_over_the_budget_run_alone_and_a_starved_prompt_gets_its_floor_the_step_after():
    s = make(max_num_batched_tokens=3, chunked_prefill_size=2)
    decodes = decoding(s, 3, length=1)               # 3 decodes: the whole budget
    late = submit(s, [90])
    plan = s.schedule()
    assert [w.req for w in plan.work] == decodes and s.starved   # no prefill; it waited for the budget
    advance(s, plan)
    plan = s.schedule()                              # the floor: min(N, chunked_prefill_size) = 2
    assert [w.req for w in plan.work] == decodes + [late] and not s.starved
    advance(s, plan)
    decodes.append(late)                             # 4 decodes > N: never dropped for the budget
    long = submit(s, list(range(100, 110)))
    got = []
    for _ in range(6):
        plan = s.schedule()
        assert [w.req for w in plan.work[:4]] == decodes
        got.append([(w.req.rid, w.start, w.num) for w in plan.work[4:]])
        advance(s, plan)
    r = long.rid                                     # a prompt waits one step at most
    assert got == [[], [(r, 0, 2)], [], [(r, 2, 2)], [], [(r, 4, 2)]]


def test_without_a_token_budget_prefills_get_max_prefill_tokens_beside_any_decodes():
    s = make(max_prefill_tokens=10, chunked_prefill_size=100)
    decodes = decoding(s, 4, length=2)
    long = submit(s, list(range(200)))
    for start in (0, 10):
        plan = s.schedule()
        assert [w.req for w in plan.work[:4]] == decodes and work_of(plan)[4:] == [(long.rid, start, 10, False)]
        assert not s.starved
        advance(s, plan)
