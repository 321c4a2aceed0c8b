"""The overlap schedule's bookkeeping: a mixin of `glmrt.engine.engine.Engine`.

The overlapped step body launches decode step N+1 on the device before it reads step N's
tokens, so the host's scheduling hides behind the GPU's work; its requests run ahead on
PLACEHOLDER outputs until the step's one host sync fills them in. This module holds that body,
the launched step it keeps (`_inflight`: created by the engine, read by `has_work`) and the
`overlap` switch between step bodies. What the read tokens then do (`_emit`, `_step_done`,
`_cache_pages`) is shared with the synchronous body, so it stays with the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from glmrt.engine.runner import PLACEHOLDER

if TYPE_CHECKING:
    from glmrt.engine.engine import RequestOutput


class OverlapSchedule:
    @property
    def overlap(self) -> bool:
        """Whether `step` runs the overlapped body (chosen at construction; a bench may switch
        it between runs, never while a step is in flight)."""
        return self._step_body == self._overlap_step

    @overlap.setter
    def overlap(self, on: bool) -> None:
        if self._inflight is not None:
            raise RuntimeError("the step body cannot change while a launched step is in flight")
        if on and self.spec is not None:
            raise ValueError("the overlap schedule is off while speculating")
        self._step_body = self._overlap_step if on else self._spec_step if self.spec is not None else self._normal_step

    def _overlap_step(self) -> list[RequestOutput]:
        """The overlapped step: a decode plan that CUDA graphs and the device sampler run
        without the host is launched before the previous step's tokens are read, so the
        scheduling and launch of step N+1 happen while the GPU runs step N, and the outputs
        returned are step N's. Its inputs that are still PLACEHOLDERs come from step N's
        tokens on the device. Any other plan first waits for the step in flight."""
        plan = self._schedule()
        key = self.runner.async_key(plan) if plan else None
        if key is None:
            outputs = self._resolve_inflight()
            return outputs + (self._apply(plan, self._execute(plan)) if plan else [])
        launched = self.runner.launch(plan, self._inflight, key)
        self._mark_launched(launched)
        outputs = self._resolve_inflight()
        self._inflight = launched
        return outputs

    def _mark_launched(self, launched) -> None:
        """Advance the launched requests as if their tokens were known: num_computed, and a
        PLACEHOLDER output (so the next plan decodes it) unless the count alone ends them."""
        launched.placeholder_at = []
        for w in launched.plan.work:
            req = w.req
            req.num_computed = w.start + w.num
            n_out = len(req.output_ids) + 1
            if n_out >= req.params.max_tokens or len(req.prompt_ids) + n_out >= self.context_length:
                launched.placeholder_at.append(None)  # its last token: nothing more to schedule
            else:
                launched.placeholder_at.append(len(req.output_ids))
                req.output_ids.append(PLACEHOLDER)

    def _resolve_inflight(self) -> list[RequestOutput]:
        """Read the launched step's tokens (the one host sync) and apply them."""
        launched, self._inflight = self._inflight, None
        if launched is None:
            return []
        tokens = launched.tokens.tolist()
        outputs = []
        for req, tok, at in zip(launched.reqs, tokens, launched.placeholder_at):
            if req.finished or req.finishing is not None:
                continue
            if at is None:
                req.output_ids.append(tok)
                at = len(req.output_ids) - 1
            else:
                req.output_ids[at] = tok
            outputs.append(self._emit(req, tok, None, None, at + 1))
        for req in {id(r): r for r in launched.reqs}.values():
            if not req.finished and req.finishing is None:
                self._cache_pages(req)
        self._step_done(launched.plan)
        return outputs
