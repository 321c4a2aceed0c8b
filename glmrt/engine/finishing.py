"""How a request ends: a mixin of `glmrt.engine.engine.Engine`.

Which token ends a request (`_finish_reason`), and what its memory becomes when it does
(`_finish`): its full pages join the radix tree and its live state becomes the tree's
checkpoint, so a later prompt sharing the prefix starts from them, and the rest goes back to
the pools; a prefill-role request keeps its pages and slot until the decode side has its state.
`_cache_pages` is here because the end's checkpoint needs the request's path in the tree; each
step also calls it, to share full pages before the request ends.
"""

from __future__ import annotations

from glmrt.cache.slot_manager import CHECKPOINT, LIVE
from glmrt.engine.request import Request, Status


class RequestFinishing:
    def _finish_reason(self, req: Request, token: int, n_out: int) -> str | None:
        """Why the n_out-th output token `token` ends the request (None: it goes on)."""
        if self.config.role == "prefill" and n_out == 1:
            normal = self._finish_reason_unified(req, token, n_out)
            return normal if normal is not None else "handoff"
        return self._finish_reason_unified(req, token, n_out)

    def _finish_reason_unified(self, req: Request, token: int, n_out: int) -> str | None:
        p = req.params
        if n_out >= p.min_tokens and (token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids)):
            return "stop"
        if n_out >= p.max_tokens or len(req.prompt_ids) + n_out >= self.context_length:
            return "length"
        return None

    def _cache_pages(self, req: Request, force: bool = False) -> None:
        """Put the request's full computed pages in the tree; adopt the tree's copies of them.

        Walking the path costs O(prompt) in Python, so it happens when a page has completed
        since the last walk (not on every decode step), or when `force`d for a checkpoint.
        """
        ps = self.config.page_size
        n_full = min(req.num_computed // ps, len(req.pages))
        if not self.tree.enabled or n_full == 0 or (n_full <= req.num_tree_pages and not force):
            return
        req.num_tree_pages = n_full
        canon = self.tree.insert(req.key_ids[:req.num_computed], req.pages[:n_full])
        for i, p in enumerate(canon):
            if p != req.pages[i]:
                self.pages.retain([p])
                self.pages.release([req.pages[i]])
                req.pages[i] = p

    def _finish(self, req: Request, reason: str) -> None:
        if reason == "handoff":
            # keep the pages and the live slot until the decode side has the state
            # (glmrt.engine.handoff); the scheduler stops running it
            self.scheduler.running.remove(req)
            req.finish_reason = reason
            self.handoffs[req.rid] = req
            return
        req.finish_reason = reason
        if reason != "abort" and req.status is Status.RUNNING and req.slot is not None and req.num_computed > 0:
            self._checkpoint_at_end(req)
        for child in req.fork_children:  # never forked: run as ordinary requests
            child.fork_parent = None
        req.fork_children = []
        if reason == "abort" and req.fork_parent is not None:
            req.fork_parent.fork_children.remove(req)
            req.fork_parent = None
        self.scheduler.free_request(req)
        req.status = Status.FINISHED
        req.save_at = []
        self.runner.forget(req)
        self.counters["finished"] += 1
        if req.cached_tokens:
            self.counters["cached_prompt_tokens"] += req.cached_tokens

    def _checkpoint_at_end(self, req: Request) -> None:
        """The finished request's live state becomes the tree's checkpoint (no copy)."""
        if not self.tree.enabled:
            return
        self._cache_pages(req, force=True)
        pos, ps = req.num_computed, self.config.page_size
        if self.tree.has_checkpoint(req.key_ids, pos):
            return
        partial = req.pages[pos // ps] if pos % ps else None
        self.slots.convert(req.slot, CHECKPOINT)
        if self.tree.add_checkpoint(req.key_ids, pos, req.slot, partial) is None:
            self.slots.convert(req.slot, LIVE)
            return
        req.slot = None
        if partial is not None:
            req.pages.remove(partial)  # the checkpoint owns it now
