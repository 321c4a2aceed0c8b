"""The scheduler: plans "tokens to compute per request" for one step, on data only.

Input: the waiting and running requests, the page and slot managers, the radix cache.
Output: a `StepPlan` — work items (request, first position, token count, sample or not),
state restores to run before the forward, state saves and n>1 forks to run after it, and
the requests retracted to make room. The model runner executes the plan; the engine applies
the sampled tokens. No torch, no sockets: every decision here is testable in milliseconds.

One step, in order:
  1. running requests keep going: decodes (one token each) first, then prefill chunks;
     a page shortage evicts the prefix cache, then retracts the newest running request;
  2. waiting requests are admitted by policy (FCFS, or LPM: longest cached prefix first)
     while the prefill token budget, pages, slots and max_running_requests allow.
The prefill token budget is max_prefill_tokens; with max_num_batched_tokens N it is
min(max_prefill_tokens, N - the decodes' tokens), none when the decodes use N up (they are never
dropped for it). A step after one that ran no prefill while one waited for budget gives prefills
at least min(N, chunked_prefill_size, max_prefill_tokens): a prompt waits one step at most.
Chunks end at checkpoint positions (prompt end, divergence point, every
`state_checkpoint_interval` tokens) so the state there can be saved. A new prompt equal to a
prompt-end checkpoint that kept its output is a full hit: a work item of 0 tokens that only
samples (from the restored last-position hidden state).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from glmrt.cache.page_manager import PageManager
from glmrt.cache.radix import Checkpoint, RadixCache
from glmrt.cache.slot_manager import CHECKPOINT, LIVE, SlotManager
from glmrt.engine.request import Request, Status


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int
    max_running_requests: int
    chunked_prefill_size: int = 8192
    max_prefill_tokens: int = 16384
    policy: str = "fcfs"                     # fcfs | lpm
    state_checkpoint_interval: int = 0       # 0 = off (EngineConfig's default is 8192)
    max_num_batched_tokens: int | None = None  # tokens per forward, decodes first (None: no cap)
    # NOTE: built from an EngineConfig, whose declared bounds these values already meet


@dataclass
class Work:
    req: Request
    start: int          # == req.num_computed when planned
    num: int            # 0: a full hit, sampled from the restored checkpoint's kept hidden state
    sample: bool        # the step computes the request's last uncomputed token -> sample one
    draft: int = 0      # speculative decoding: draft tokens the step verifies after it (pages for them held)


@dataclass
class Restore:
    """Before the forward: checkpoint state -> the request's live slot (+ its partial page)."""

    req: Request
    checkpoint: Checkpoint
    src_slot: int
    dst_slot: int
    src_page: int | None
    dst_page: int | None


@dataclass
class Save:
    """After the forward: the request's state at `position` -> a new checkpoint in the tree."""

    req: Request
    position: int
    src_slot: int
    dst_slot: int
    src_page: int | None
    dst_page: int | None
    with_output: bool = False   # a prompt end sampled in this step: keep its last hidden state too


@dataclass
class Fork:
    """After the forward: an n>1 child takes a copy of its parent's state at the prompt's end."""

    parent: Request
    child: Request
    dst_slot: int
    src_page: int | None
    dst_page: int | None


@dataclass
class StepPlan:
    work: list[Work] = field(default_factory=list)
    restores: list[Restore] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)
    forks: list[Fork] = field(default_factory=list)
    retracted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(w.num for w in self.work)

    def __bool__(self) -> bool:
        return bool(self.work or self.restores)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pages: PageManager, slots: SlotManager, tree: RadixCache,
                 draft_depth: Callable[[Request], int] | None = None, max_drafting: int = 0):
        self.cfg = config
        self.draft_depth = draft_depth  # speculative decoding: draft tokens a decoding request verifies
        # ... and how many decodes may draft in one step: each needs a rollback snapshot slot, and
        # n > 1 forks or a decode side's handoffs can run more requests than the reserve
        self.max_drafting = max_drafting
        self.pages = pages
        self.slots = slots
        self.tree = tree
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # the last step ran no prefill while one waited for the token budget: this one gives it the floor
        self.starved = False

    # ---- queue management ----------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.running) or any(r.fork_parent is None for r in self.waiting)

    def free_request(self, req: Request) -> None:
        """Give back everything a request holds and drop it from the queues (finish, abort)."""
        self._release(req)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)

    def _release(self, req: Request) -> None:
        if req.waits:  # a load from the host tier may still fill these pages or this slot
            self.tree.host.pool.fence()
            req.waits = []
        if req.pages:
            self.pages.release(req.pages)
            req.pages = []
        if req.slot is not None:
            self.slots.free(req.slot)
            req.slot = None

    def retract(self, req: Request, plan: StepPlan) -> None:
        """Preempt: drop the request's cache and queue it to recompute prompt + outputs later."""
        self.free_request(req)  # then back to the front of the queue
        req.num_computed = 0
        req.num_tree_pages = 0
        req.save_at = []
        req.status = Status.WAITING
        self.waiting.insert(0, req)
        plan.retracted.append(req)

    # ---- page helpers --------------------------------------------------------------------
    def _pages_needed(self, req: Request, upto: int) -> int:
        return max(0, -(-upto // self.cfg.page_size) - len(req.pages))

    def _grab_pages(self, n: int) -> list[int] | None:
        if n == 0:
            return []
        if not self.pages.can_allocate(n):
            self.tree.evict(need_pages=n)
        if not self.pages.can_allocate(n):
            return None
        return self.pages.allocate(n)

    def _grab_slot(self) -> int | None:
        if self.slots.num_free == 0:
            self.tree.evict(need_slots=1)
        if self.slots.num_free == 0:
            return None
        return self.slots.allocate(LIVE)

    def _chunk(self, req: Request, budget: int) -> int:
        n = min(req.num_uncomputed, self.cfg.chunked_prefill_size, budget)
        start = req.num_computed
        for p in req.save_at:
            if start < p < start + n:
                return p - start
        return n

    # ---- the step ------------------------------------------------------------------------
    def _loaded(self, req: Request) -> bool:
        """Whether the host-tier loads of the request's prefix have landed (it waits for its own only)."""
        if req.waits and all(self.tree.host.ready(t) for t in req.waits):
            req.waits = []
        return not req.waits

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        ready = [r for r in self.running if self._loaded(r)]
        decodes = [r for r in ready if r.num_uncomputed == 1]
        # 0 uncomputed: a full hit that waited for its load; not a request whose last token is in
        # flight (the overlap schedule leaves it no placeholder), which has nothing to run
        prefills = [r for r in ready if r.num_uncomputed > 1 or (r.num_uncomputed == 0 and not r.output_ids)]
        drafting = 0
        for req in sorted(decodes, key=lambda r: r.arrival):
            if req.status is not Status.RUNNING:
                continue  # retracted while making room for an earlier request
            depth = self.draft_depth(req) if self.draft_depth is not None and drafting < self.max_drafting else 0
            # pages for the drafts only where free or evictable from the prefix cache, as a decode's own
            # page is (a cache full of old prefixes would otherwise end speculation): a draft never
            # retracts a request
            if depth:
                got = self._grab_pages(self._pages_needed(req, req.num_computed + 1 + depth))
                if got is None:
                    depth = 0
                else:
                    req.pages += got
            if depth or self._ensure_pages(req, req.num_computed + 1, plan):
                plan.work.append(Work(req, req.num_computed, 1, True, depth))
                drafting += depth > 0
        num_decodes = len(plan.work)
        budget = granted = self._prefill_budget(plan)
        for req in sorted(prefills, key=lambda r: r.arrival):
            if req.status is not Status.RUNNING or (budget <= 0 and req.num_uncomputed):
                continue
            n = self._chunk(req, budget)
            if self._ensure_pages(req, req.num_computed + n, plan):
                plan.work.append(Work(req, req.num_computed, n, n == req.num_uncomputed))
                budget -= n
        self._admit(plan, budget)
        if self.cfg.max_num_batched_tokens is not None:
            ran = any(w.num for w in plan.work[num_decodes:])
            self.starved = not ran and granted <= 0 and self._wants_prefill(prefills)
        self._plan_saves_and_forks(plan)
        return plan

    def _prefill_budget(self, plan: StepPlan) -> int:
        """Prefill tokens this step may compute, the decodes already planned (module docstring)."""
        cap = self.cfg.max_num_batched_tokens
        if cap is None:
            return self.cfg.max_prefill_tokens
        decode_tokens = sum(w.num + w.draft for w in plan.work)
        budget = max(0, min(cap - decode_tokens, self.cfg.max_prefill_tokens))
        if self.starved:
            budget = max(budget, min(cap, self.cfg.chunked_prefill_size, self.cfg.max_prefill_tokens))
        return budget

    def _wants_prefill(self, prefills: list[Request]) -> bool:
        """Whether a prompt token waits to be computed: a running prefill, or an admissible request."""
        if any(r.status is Status.RUNNING and r.num_uncomputed for r in prefills):
            return True
        return (len(self.running) < self.cfg.max_running_requests
                and any(r.fork_parent is None for r in self.waiting))

    def _ensure_pages(self, req: Request, upto: int, plan: StepPlan) -> bool:
        """Pages for positions < upto; retract the newest other running requests if needed."""
        while True:
            need = self._pages_needed(req, upto)
            got = self._grab_pages(need)
            if got is not None:
                req.pages += got
                return True
            victims = [r for r in self.running if r is not req and not self._planned(r, plan)]
            victim = max(victims or [req], key=lambda r: r.arrival)
            if victim is req:
                self.retract(req, plan)
                return False
            self.retract(victim, plan)

    @staticmethod
    def _planned(req: Request, plan: StepPlan) -> bool:
        return any(w.req is req for w in plan.work)

    def _order_waiting(self) -> list[Request]:
        cands = [r for r in self.waiting if r.fork_parent is None]
        if self.cfg.policy == "lpm":
            scored = [(-self.tree.match(r.key_ids, r.num_tokens - 1).resume, r.arrival, i, r)
                      for i, r in enumerate(cands)]
            return [x[-1] for x in sorted(scored, key=lambda x: x[:3])]
        return cands  # FCFS: arrival order, retracted requests first (they sit at the front)

    def _admit(self, plan: StepPlan, budget: int) -> None:
        for req in self._order_waiting():
            if budget <= 0 or len(self.running) >= self.cfg.max_running_requests:
                return
            if self._wait_for_inflight_prefix(req, plan):
                continue
            before = len(plan.work)
            if not self._admit_one(req, plan, budget):
                return  # keep the order: nothing behind it jumps the queue
            if len(plan.work) > before:  # else it waits for its prefix to load from the host tier
                budget -= plan.work[-1].num

    def _wait_for_inflight_prefix(self, req: Request, plan: StepPlan) -> bool:
        """Defer `req` while a running prefill is computing a longer prefix it shares.

        Requests arriving together with a new shared prefix would otherwise all compute it.
        The running one is told to save its state where the two diverge, and `req` waits
        until that checkpoint exists, then hits it (in-batch prefix sharing).
        """
        ps = self.cfg.page_size
        best, best_d = None, 0
        for a in self.running:
            if a.num_computed >= len(a.prompt_ids):
                continue
            d = RadixCache._token_common(req.key_ids, a.key_prompt_ids)
            d = min(d, req.num_tokens - 1)
            if d >= ps and d > best_d and d > a.num_computed:
                best, best_d = a, d
        if best is None or not self.tree.enabled or best_d <= self.tree.match(req.key_ids, req.num_tokens - 1).resume:
            return False
        if best_d not in best.save_at:
            best.save_at = sorted(set(best.save_at) | {best_d})
        for w in plan.work:
            if w.req is best and w.start < best_d < w.start + w.num:
                w.num = best_d - w.start
                w.sample = False
        return True

    def _admit_one(self, req: Request, plan: StepPlan, budget: int) -> bool:
        slot = self._grab_slot()
        if slot is None:
            return False
        m = self.tree.match(req.key_ids, req.num_tokens - 1, full=not req.output_ids)
        host = self.tree.host
        if host is not None and host.prefetch(req.key_ids, req.num_tokens - 1, not req.output_ids, m.resume):
            m = self.tree.match(req.key_ids, req.num_tokens - 1, full=not req.output_ids)  # the disk's deeper one
        ckpt = m.checkpoint
        if ckpt is not None:
            ckpt.pins += 1  # not evictable until the restore ran
        path = self.tree.load_path(m.nodes, self._grab_pages) if ckpt is not None else ([], [])
        if path is None:  # the host tier holds the prefix, the device has no room for it now
            ckpt.pins -= 1
            self.slots.free(slot)
            return False
        pages, req.waits = path
        self.pages.retain(pages)
        req.pages, req.slot, req.num_computed = list(pages), slot, m.resume
        restore_page = None
        if ckpt is not None and (ckpt.partial_page is not None or ckpt.host_partial is not None):
            got = self._grab_pages(1)
            if got is None:
                ckpt.pins -= 1
                self._release(req)
                req.num_computed = 0
                return False
            restore_page = got[0]
            req.pages.append(restore_page)
        n = self._chunk_for_new(req, m.common, budget)
        need = self._pages_needed(req, req.num_computed + n)
        got = self._grab_pages(need)
        if got is None:
            if ckpt is not None:
                ckpt.pins -= 1
            self._release(req)
            req.num_computed = 0
            return False
        req.pages += got
        if not req.admitted_once:
            req.cached_tokens = min(m.resume, len(req.prompt_ids))
            req.admitted_once = True
        if ckpt is not None and ckpt.slot is None:  # on the host: the tier copies it into the live slot
            ckpt.pins -= 1
            req.waits.append(self.tree.host.restore(ckpt, slot, restore_page))
        elif ckpt is not None:
            plan.restores.append(Restore(req, ckpt, ckpt.slot, slot, ckpt.partial_page, restore_page))
        self.waiting.remove(req)
        self.running.append(req)
        req.status = Status.RUNNING
        if self._loaded(req):
            plan.work.append(Work(req, req.num_computed, n, n == req.num_uncomputed))
        return True

    def _chunk_for_new(self, req: Request, common: int, budget: int) -> int:
        """Pick the checkpoint positions of this admission, then the first chunk."""
        start = req.num_computed
        prompt_end = len(req.prompt_ids)
        marks = set()
        if start < prompt_end:
            marks.add(prompt_end)
        if start < common < req.num_tokens:
            marks.add(common)  # divergence from the cached tree: the next sharer hits here
        k = self.cfg.state_checkpoint_interval
        if k > 0:
            marks.update(range((start // k + 1) * k, min(prompt_end, req.num_tokens), k))
        # the prompt end is saved again when its checkpoint lacks the output a full hit needs
        req.save_at = sorted(p for p in marks if p > start and not self.tree.has_checkpoint(
            req.key_ids, p, with_output=p == prompt_end and not req.output_ids))
        return self._chunk(req, budget)

    def _plan_saves_and_forks(self, plan: StepPlan) -> None:
        ps = self.cfg.page_size
        for w in plan.work:
            req, end = w.req, w.start + w.num
            if end in req.save_at:
                req.save_at.remove(end)
                slot, page = self._slot_and_partial_page(CHECKPOINT, end)
                if slot is not None:
                    src = req.pages[end // ps] if end % ps else None
                    output = w.sample and w.num > 0 and end == len(req.prompt_ids) and not req.output_ids
                    plan.saves.append(Save(req, end, req.slot, slot, src, page, output))
            if w.sample and req.fork_children and end == len(req.prompt_ids):
                for child in list(req.fork_children):
                    self._plan_fork(plan, req, child)
                req.fork_children = []

    def _slot_and_partial_page(self, kind: str, position: int) -> tuple[int | None, int | None]:
        """A state slot, plus a page for the partial page at `position` when it is not
        page-aligned; (None, None) when either cannot be had (the caller skips the copy)."""
        if self.slots.num_free == 0:
            self.tree.evict(need_slots=1)
        if self.slots.num_free == 0:
            return None, None
        slot = self.slots.allocate(kind)
        if position % self.cfg.page_size == 0:
            return slot, None
        got = self._grab_pages(1)
        if got is None:
            self.slots.free(slot)
            return None, None
        return slot, got[0]

    def _plan_fork(self, plan: StepPlan, parent: Request, child: Request) -> None:
        ps = self.cfg.page_size
        end = len(parent.prompt_ids)
        slot, page = self._slot_and_partial_page(LIVE, end)
        child.fork_parent = None
        if slot is None:
            return  # no room: the child runs as an ordinary request (prefix cache helps)
        full = parent.pages[: end // ps]
        self.pages.retain(full)
        child.pages = list(full) + ([page] if page is not None else [])
        child.slot = slot
        child.num_computed = end
        child.cached_tokens = end
        child.admitted_once = True
        child.status = Status.RUNNING
        self.waiting.remove(child)
        self.running.append(child)
        plan.forks.append(Fork(parent, child, slot, parent.pages[end // ps] if end % ps else None, page))
