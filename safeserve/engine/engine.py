"""The engine of a group leader: `schedule -> run -> postprocess`, one step at a time.

The leader owns the scheduler and the requests; each step's plan goes to every rank of the
group (a gloo broadcast), every rank runs its part through its `ModelRunner`, and the tokens
sampled on each rank come back to the leader (a gloo gather).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from safeserve.config import ServerArgs
from safeserve.engine.eplb import EplbController
from safeserve.engine.isolation import bisect_step
from safeserve.engine.kv_cache import BlockAllocator
from safeserve.engine.model_runner import ModelRunner
from safeserve.engine.outcome import (
    RankResult,
    SeqResult,
    StepError,
    StepFailed,
    describe,
    is_fatal,
    per_request,
)
from safeserve.engine.overlap import decide_split
from safeserve.engine.plan import (
    EplbOp,
    EplbRankReport,
    Faults,
    SeqPlan,
    StepPlan,
    TableReceiver,
    TableSender,
)
from safeserve.engine.request import Request
from safeserve.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from safeserve.engine.warm_up import warm_up
from safeserve.guards.prefill_sizing import PrefillSizer, PrefillSizing
from safeserve.messages import (
    EngineStats,
    EplbCommand,
    EplbReply,
    GuardSizing,
    InjectFault,
    RequestOutput,
    SamplingParams,
)
from safeserve.model.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

PhaseCallback = Callable[[int, str], None]


class Engine:
    """The leader's engine; `runner` is rank 0's ModelRunner (it starts the group's collectives)."""

    def __init__(
        self,
        args: ServerArgs,
        runner: ModelRunner | None = None,
        on_phase: PhaseCallback | None = None,
    ) -> None:
        self.args = args
        self.runner = runner or ModelRunner(args, 0, on_phase=on_phase)
        self.on_phase = on_phase or self.runner.on_phase
        cfg = self.config = self.runner.config
        self.num_blocks = self.runner.num_blocks
        max_len = self.runner.max_model_len
        capacity = self.num_blocks * args.block_size
        if max_len > capacity:
            logger.warning(
                "max model length lowered from %d to %d: the KV cache holds no more",
                max_len,
                capacity,
            )
            max_len = capacity
        self.max_model_len = max_len
        dp_size = self.runner.layout.dp_size
        self.tables = TableSender()  # block tables to the other ranks, by difference
        self.scheduler = Scheduler(
            [BlockAllocator(self.num_blocks, args.block_size) for _ in range(dp_size)],
            args.max_running_requests,
            args.max_num_batched_tokens,
            args.prefill_chunk,
        )
        guard = self.runner.guard_sizing()
        self.sizer = PrefillSizer(
            args.prefill_sizing,
            guard.dispatch_budget_tokens,
            dp_size,
            args.max_num_batched_tokens,
            args.chunked_prefill_size,
        )
        self._apply_sizing(self.sizer.sizing)
        self.guard_info = guard
        self.faults = Faults()
        runner = self.runner
        self.eplb = (
            EplbController(
                args,
                lambda: runner.expert_map,  # type: ignore[arg-type,return-value]
                runner.dispatcher.balance if runner.dispatcher is not None else None,
                counts_summed=runner.layout.dp_attention,
                num_groups=getattr(cfg, "n_group", 1) or 1,
            )
            if runner.expert_map is not None
            else None
        )
        self.replies: list[EplbReply] = []  # answers to admin commands, for the next outputs
        self.tbo_steps: dict[str, int] = {}  # forward steps by two-batch-overlap decision
        # The tokenizer's files (generation_config.json, eos_token) may name more stop ids.
        tokenizer = load_tokenizer(args.model, cfg.eos_token_ids, args.load_format == "dummy")
        self.eos_token_ids = set(tokenizer.eos_token_ids)
        self.step_id = 0
        kv_gib = sum(k.nbytes + v.nbytes for k, v in self.runner.kv.layers) / 2**30
        logger.info(
            "engine ready: %d attention rank(s) x %d KV blocks of %d tokens (%d tokens, %.1f GiB "
            "a rank, cache dtype %s), max model length %d, chunk %d, step budget %d per attention "
            "rank",
            dp_size,
            self.num_blocks,
            args.block_size,
            self.num_blocks * args.block_size,
            kv_gib,
            str(self.runner.kv.dtype).removeprefix("torch."),
            self.max_model_len,
            self.scheduler.chunk,
            self.scheduler.token_budget,
        )

    def _apply_sizing(self, sizing: PrefillSizing) -> None:
        self.scheduler.token_budget = sizing.step_tokens
        self.scheduler.chunk = min(sizing.chunk, sizing.step_tokens)

    @property
    def tbo(self) -> bool:
        """Whether two-batch overlap splits this group's steps: only where it has more than one
        rank (on one there is no dispatch or combine to overlap with)."""
        return self.args.enable_two_batch_overlap and self.runner.layout.tp_size > 1

    def guards(self) -> GuardSizing:
        """Effective admission budget and prefill sizing (GET /admin/config shows them)."""
        return replace(self.guard_info, prefill=self.sizer.sizing)

    def inject_fault(self, fault: InjectFault) -> None:
        corrupt = self.faults.corrupt_ranks  # damaged weights stay damaged: `clear` keeps them
        if fault.kind == "clear":
            self.faults = Faults(corrupt_ranks=corrupt)
        elif fault.kind == "route_skew":
            self.faults = Faults(fault.expert, dict(self.faults.delay_s), corrupt)
        elif fault.kind == "slow_rank":
            delays = dict(self.faults.delay_s)
            if fault.rank is None or fault.delay_s <= 0:
                delays.pop(fault.rank, None)  # type: ignore[arg-type]
            else:
                delays[fault.rank] = fault.delay_s
            self.faults = Faults(self.faults.route_skew_expert, delays, corrupt)
        elif fault.kind == "corrupt" and fault.rank is not None:
            more = tuple(sorted({*corrupt, fault.rank}))
            self.faults = Faults(self.faults.route_skew_expert, dict(self.faults.delay_s), more)
        logger.warning("fault injection: %s -> %s", fault, self.faults)

    # -- start-up -------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Runs the start-up warm-up (engine/warm_up.py) before the group reports READY, then
        tells every rank that start-up is over (an idle plan): serving begins here, not at the
        group's first idle moment, which a group under load from its first request never has
        (its EPLB would never count a pass)."""
        warm_up(self)
        self.tbo_steps.clear()  # the warm-up's steps are not traffic: the metric counts served ones
        self.runner.begin_serving()
        self.broadcast_idle()

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("empty prompt")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError("prompt plus max_tokens exceeds the context length")
        if max(prompt_ids) >= self.config.vocab_size or min(prompt_ids) < 0:
            raise ValueError("prompt holds token ids outside the vocabulary")
        req = Request(rid, list(prompt_ids), params)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]  # the first prompt token has no logprob
        self.scheduler.add(req)

    def abort_request(self, rid: str) -> bool:
        return self.scheduler.abort(rid) is not None

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        return EngineStats(
            step=self.step_id,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.scheduler.num_blocks_used,
            kv_blocks_total=self.scheduler.num_blocks_total,
            num_preemptions=self.scheduler.num_preemptions,
            eplb=self.eplb.status() if self.eplb is not None else None,
            tbo_steps=dict(self.tbo_steps),
        )

    def eplb_command(self, cmd: EplbCommand) -> None:
        """An admin command about the expert placement; its reply goes out with the next
        outputs (`replies`)."""
        if self.eplb is None:
            reply = EplbReply(cmd.request_id, False, error="the model has no routed experts")
        else:
            reply = self.eplb.command(cmd, self.run_eplb)
        self.replies.append(reply)

    def run_eplb(self, op: EplbOp) -> list[EplbRankReport]:
        """An EPLB step on every rank (a plan with no sequences); each rank's report. A rank
        that fails it fails the group: the placement may differ between its ranks."""
        self.step_id += 1
        plan = StepPlan(
            self.step_id,
            [[] for _ in range(self.scheduler.dp_size)],
            faults=self.faults,
            eplb=op,
        )
        comm = self.runner.comm
        if comm.active:
            comm.broadcast_object(self.tables.wire(plan, []))
        mine = self.runner.execute_step(plan)
        gathered = comm.gather_objects(mine)
        assert gathered is not None
        failed = [g for g in gathered if isinstance(g, StepFailed)]
        if failed:
            raise RuntimeError(f"step {plan.step}: EPLB step {op!r} failed: {failed[0]}")
        reports = [g.eplb for g in gathered]  # type: ignore[union-attr]
        assert all(r is not None for r in reports)
        return reports  # type: ignore[return-value]

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step. An exception of the step that every rank got past
        (outcome.py) stays with the request(s) it comes from (isolation.py): they end with an
        error output and the others go on; an exception out of here fails the group."""
        if self.eplb is not None and (op := self.eplb.next_op()) is not None:
            self.eplb.done(op, self.run_eplb(op))
        self.step_id += 1
        self.on_phase(self.step_id, "schedule")
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        failed: dict[int, str] = {}
        try:
            results = dict(enumerate(self.run_scheduled(sched.scheduled)))
        except StepError as e:
            results, failed = bisect_step(self.step_id, sched.scheduled, e, self.run_scheduled)
            if not results and not e.request_fault:
                self._probe(e)  # every request failed: is it the rank?
        return self._postprocess(sched, results, failed)

    def run_scheduled(self, scheduled: list[ScheduledRequest]) -> list[SeqResult]:
        """One group step of these requests: each one's results (raises StepError)."""
        plan = self.build_plan(SchedulerOutput(scheduled))
        ranks = self.run(plan)
        return per_request(
            [s.req.dp_rank for s in scheduled], [s.samples for s in scheduled], ranks
        )

    def _probe(self, error: StepError) -> None:
        """Runs one token of a throwaway request; raises (the group fails) if that fails too."""
        alloc = self.scheduler.allocators[0]
        req = Request("__probe__", [0], SamplingParams(max_tokens=1, temperature=0.0))
        if not alloc.can_allocate(req, 1):
            return  # no block to probe with: the requests take the blame
        alloc.allocate(req, 1)
        try:
            self.run_scheduled([ScheduledRequest(req, 1)])
        except StepError as e:
            raise RuntimeError(
                f"step {self.step_id}: every request fails, alone too, and so does a probe step "
                f"({e}); first failure: {error}"
            ) from e
        finally:
            alloc.free(req)
        logger.warning("step %d: a probe step runs: the failure is the requests'", self.step_id)

    def build_plan(self, sched: SchedulerOutput) -> StepPlan:
        per_rank: list[list[SeqPlan]] = [[] for _ in range(self.scheduler.dp_size)]
        for s in sched.scheduled:
            req = s.req
            start = req.num_computed
            seq = SeqPlan(
                req.token_ids[start : start + s.num_tokens],
                start,
                req.block_ids,  # not copied: the plan is run (or pickled) in this step
                req.params if s.samples else None,
                req.params.output_offset + req.num_output_tokens,
                req.table_id,
                fault=req.params.fault,
            )
            acc = req.prompt_logprobs
            if acc is not None and not req.prompt_logprobs_sent:
                # Rows j of this chunk score prompt token j + 1; those already held (a request
                # preempted mid-prompt recomputes them) are not computed again.
                first = max(start, len(acc) - 1)
                last = min(start + s.num_tokens, req.num_prompt_tokens - 1)
                if first < last:
                    seq.prompt_lp_targets = req.prompt_ids[first + 1 : last + 1]
                    seq.prompt_lp_first = first
                    seq.prompt_lp_top = max(0, int(req.params.prompt_logprobs or 0))
            per_rank[req.dp_rank].append(seq)
        plan = StepPlan(self.step_id, per_rank, faults=self.faults)
        if self.tbo:
            plan.split, decision = self.tbo_decision(plan)
            self.tbo_steps[decision] = self.tbo_steps.get(decision, 0) + 1
        return plan

    def tbo_decision(self, plan: StepPlan) -> tuple[list[int] | None, str]:
        """Two-batch overlap's split of a forward step (`StepPlan.split`) and its decision
        (`messages.TBO_DECISIONS`). A step that a decode CUDA graph runs stays whole: the bucket
        is picked from the plan as `ModelRunner._run` picks it, and every rank of the group
        captured the same buckets, so the leader's graphs answer for every rank. Otherwise the
        rule of `overlap.decide_split` over each attention rank's query lengths."""
        graphs = self.runner.cuda_graphs
        if graphs is not None:
            ranks = plan.per_rank if self.runner.layout.dp_attention else [plan.per_rank[0]]
            if graphs.group_bucket(ranks) is not None:
                return None, "cuda_graph"
        return decide_split(
            [[len(s.token_ids) for s in seqs] for seqs in plan.per_rank],
            self.args.tbo_token_distribution_threshold,
            self.args.tbo_min_decode_batch,
        )

    def run(self, plan: StepPlan) -> list[RankResult]:
        """Every rank runs the plan; returns each attention rank's results. Raises StepError
        when a rank's part raised an exception it survived (each rank reports it through the
        gather instead of its results); an exception that leaves the rank unusable
        (outcome.is_fatal) is raised as it is."""
        comm = self.runner.comm
        retired = [t for a in self.scheduler.allocators for t in a.drain_retired()]
        if comm.active:  # the other ranks get the tables' new entries only
            comm.broadcast_object(self.tables.wire(plan, retired))
        mine: RankResult | StepFailed
        try:
            mine = self.runner.execute_step(plan)
        except Exception as e:
            if is_fatal(e):
                raise
            logger.warning("step %d failed on rank 0: %s", plan.step, describe(e))
            mine = StepFailed(0, describe(e))
        gathered = comm.gather_objects(mine)
        assert gathered is not None
        failures = [g for g in gathered if isinstance(g, StepFailed)]
        if failures:
            raise StepError(failures)
        if self.eplb is not None and self.runner.serving:
            self.eplb.on_pass()
        dispatcher = self.runner.dispatcher
        changed = self.sizer.observe(dispatcher.step_peak_share if dispatcher else None)
        if changed is not None:
            self._apply_sizing(changed)
        if self.runner.layout.dp_attention:
            return gathered  # type: ignore[return-value]
        return [mine]  # type: ignore[list-item]

    def broadcast_idle(self) -> None:
        """Tells the other ranks the leader is alive while there is no work."""
        plan = StepPlan(self.step_id, idle=True, faults=self.faults)
        self.runner.comm.broadcast_object(plan)
        self.runner.apply_faults(plan.faults)

    def shutdown(self) -> None:
        self.runner.comm.broadcast_object(StepPlan(self.step_id, shutdown=True))
        self.runner.comm.shutdown()

    def _postprocess(
        self, sched: SchedulerOutput, results: dict[int, SeqResult], failed: dict[int, str]
    ) -> list[RequestOutput]:
        """Advances the requests that ran (`results`, by index in sched.scheduled) and ends
        those that failed (`failed`: their error). Per-request work that raises ends that
        request alone."""
        samples = [s.samples for s in sched.scheduled]  # before num_computed moves on
        for i, s in enumerate(sched.scheduled):
            if i in results:
                s.req.num_computed += s.num_tokens
        outputs = []
        for i, s in enumerate(sched.scheduled):
            if i in failed:
                outputs.append(self._fail(s.req, failed[i]))
                continue
            try:
                out = self._advance(s.req, samples[i], results[i])
            except Exception as e:
                logger.warning("request %s: postprocessing failed: %s", s.req.rid, describe(e))
                out = self._fail(s.req, f"postprocess: {describe(e)}")
            if out is not None:
                outputs.append(out)
        return outputs

    def _advance(self, req: Request, samples: bool, res: SeqResult) -> RequestOutput | None:
        """One request's results of the step: its output when it sampled."""
        if res.prompt_logprobs and req.prompt_logprobs is not None:
            req.prompt_logprobs.extend(res.prompt_logprobs)
        if not samples:
            return None
        tok = res.token
        if not isinstance(tok, int):
            return self._fail(req, str(tok))  # its row could not be sampled
        req.token_ids.append(tok)
        reason = self._finish_reason(req, tok)
        new = [] if reason == "stop" else [tok]  # the stop token is not part of the answer
        out = RequestOutput(req.rid, new, reason, req.num_prompt_tokens, req.num_output_tokens)
        if req.params.logprobs is not None:
            if new and res.logprob is None:
                raise RuntimeError("no logprobs came back for the sampled token")
            out.logprobs = [res.logprob] if new else []  # type: ignore[list-item]
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            if len(req.prompt_logprobs) != req.num_prompt_tokens:
                raise RuntimeError(
                    f"{len(req.prompt_logprobs)} prompt logprobs for {req.num_prompt_tokens} "
                    "prompt tokens"
                )
            out.prompt_logprobs = req.prompt_logprobs
            req.prompt_logprobs_sent = True
        if reason is not None:
            self.scheduler.finish(req, reason)
        return out

    def _fail(self, req: Request, error: str) -> RequestOutput:
        """Ends `req` with an error output (the group goes on)."""
        logger.warning("request %s failed: %s", req.rid, error)
        self.scheduler.finish(req, "error")
        return RequestOutput(
            req.rid, [], "error", req.num_prompt_tokens, req.num_output_tokens, error=error
        )

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return "stop"
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None


def follower_loop(runner: ModelRunner, on_plan: Callable[[int, bool], None]) -> None:
    """Ranks 1..n-1: run every plan the leader broadcasts until it says shut down.
    `on_plan(step, idle)` is called for every plan received. Block tables arrive by difference
    (`TableSender`) and are rebuilt here. A step that raises here is reported to the leader
    through the step's gather (`StepFailed`) and the loop goes on: survivable where every rank
    got past the step's collectives (outcome.py); one that raises mid-collective leaves the
    group blocked, and the watchdog fences it."""
    tables = TableReceiver()
    while True:
        plan = runner.comm.broadcast_object(None)
        assert isinstance(plan, StepPlan)
        tables.expand(plan)
        if plan.shutdown:
            runner.comm.shutdown()
            return
        on_plan(plan.step, plan.idle)
        if plan.idle:  # the leader's first idle plan ends start-up (Engine.warm_up sends one)
            runner.begin_serving()
            runner.apply_faults(plan.faults)
            continue
        result: RankResult | StepFailed
        try:
            result = runner.execute_step(plan)
        except Exception as e:  # the leader learns of it through the gather, and goes on
            if is_fatal(e):
                raise
            logger.warning("step %d failed on this rank: %s", plan.step, describe(e))
            result = StepFailed(runner.layout.rank, describe(e))
        runner.comm.gather_objects(result)
