"""The training job: start up (``startup.build_run``), run ``train.steps`` optimizer steps with their
evaluations and checkpoints, and summarise.

Runs as one process or as one worker of a torchrun/elastic launch; everything that differs between
the two is hidden in ``init_distributed`` and the run's meshes. ``_train`` is the loop, in the order a
step happens; what a step ends with (the one step-end all-reduce, the commit of an async save, the
preemption's save) is ``_end_step``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch.distributed as dist

from seektrain.checkpoint.manager import step_dir_name
from seektrain.config.schema import JobConfig
from seektrain.data.blocks import ShardDamaged
from seektrain.parallel.layout_record import layout_ran
from seektrain.parallel.parallelize import unwrap
from seektrain.parallel.process_group import init_distributed, release_environment
from seektrain.train.preemption import Preemption, ReportLine, print_line
from seektrain.train.readable_failure import FailedAt, readable_failure
from seektrain.train.run_hooks import run_hook
from seektrain.train.startup import Run, build_run, local_numel
from seektrain.train.step import StepRecord, train_step

log = logging.getLogger("seektrain.train")


def train(cfg: JobConfig, report_line: ReportLine = print_line) -> dict:
    """Train ``cfg`` in this process (one worker of a launch, or the whole run); ``report_line``: how the
    SIGTERM watchdog's one line is shown (the CLI's; default: printed to stderr)."""
    # [faults] SIGTERM is handled from here on, at every moment of the run (preemption.py)
    preemption = Preemption(cfg.checkpoint.preempt_grace_s, report_line=report_line)
    preemption.run_dir = Path(cfg.run.dir)
    run_hook("at_startup", preemption.rank, preemption)  # [faults] the tests' hooks; nothing otherwise
    try:
        with preemption.start_up():
            preemption.phase = "process-group initialisation"
            env = init_distributed(cfg.dist)
        try:
            return _train(build_run(cfg, env, preemption))
        finally:
            release_environment(env)  # a world of one leaves no torchrun variables nor process group behind
    finally:
        preemption.close()


def _train(run: Run) -> dict:
    ctx, ckpt, cfg = run.ctx, run.ckpt, run.plan.job
    ctx.model.train()
    t_run = time.perf_counter()
    step = run.start_step
    try:
        for step in range(run.start_step + 1, cfg.train.steps + 1):
            run.sync.begin_step(step)  # [faults] what a collective failure names
            run.monitor.before_step(step)
            record = train_step(ctx, step)
            evaluating = run.evaluator.due(step)
            abandoned = False  # [faults] the evaluation gave way to a SIGTERM: this step is saved as it is
            if evaluating:
                run.preemption.phase = f"the evaluation after step {step}"
                val_loss = run.evaluator.val_loss(ctx, stop=run.preemption.agreed)
                abandoned = val_loss is None
                if not abandoned:
                    record.values["val_loss"] = val_loss
            run.steps_log.add(step, record)
            interval = cfg.checkpoint.interval
            saving = bool(interval) and step % interval == 0 and step < cfg.train.steps and not abandoned
            if saving:
                run.steps_log.settle()  # [faults] a bad loss stops the run before a checkpoint holds its step
                run.preemption.phase = f"the checkpoint of step {step}"
                ckpt.save(step, ctx.model, ctx.optimizer, run.trainer_state(step), retry_later=True)
            _end_step(run, step, record, saving, evaluating, abandoned)
        run.steps_log.flush()
        if step > run.start_step or run.start.checkpoint is None:
            ckpt.save(step, ctx.model, ctx.optimizer, run.trainer_state(step))
        ckpt.wait()
    except BaseException as err:
        run.steps_log.salvage(err)  # the steps completed before the error still reach metrics.jsonl
        if isinstance(err, ShardDamaged):  # [data] every rank stops at this batch: keep the save in flight
            ckpt.wait()
        if isinstance(err, (RuntimeError, MemoryError)):  # [faults] out of memory, a dead or hung rank
            env = run.env
            at = FailedAt(
                env.rank, run.sync.step, run.preemption.phase, env.facts, cfg.dist.collective_timeout_s
            )
            failure = readable_failure(err, run.plan, at)
            if failure is not None:
                raise failure from None
        raise
    finally:
        run.data.close()  # the prefetch thread ends here: after the last step, on errors and on preemption
        ckpt.close()
        run.monitor.close()
    elapsed, ran = time.perf_counter() - t_run, layout_ran(ctx.parallel, run.meshes.world)
    summary = run.monitor.summarise(elapsed, local_numel(ctx.model), ran)
    if dist.is_initialized():
        dist.barrier()
    model = unwrap(ctx.model) if run.env.world_size == 1 else None
    return {"final_step": step, "records": run.monitor.records, "summary": summary, "model": model}


def _end_step(
    run: Run, step: int, record: StepRecord, saving: bool, evaluating: bool, abandoned: bool
) -> None:
    """The end of ``step``: agree on a SIGTERM and on the async save written everywhere (one all-reduce),
    commit that save, log the step, and on a SIGTERM save this step on every rank and leave (exit 143)."""
    ckpt = run.ckpt
    # [faults] a SIGTERM during a sync save that was committed: that save is the preemption's
    saved = saving and not ckpt.async_save and ckpt.last_step == step
    if abandoned or (saved and run.preemption.agreed()):
        preempted, written = True, None
    else:  # [faults] one all-reduce: SIGTERM on any rank, and an async checkpoint written everywhere
        preempted, written = run.sync.end_step(step, ckpt.in_flight(), ckpt.pending_step)
    ckpt.commit(written)
    stall = ckpt.take_stall_s()  # what this step's checkpoint save or commit blocked training for
    if stall is not None:
        record.values["checkpoint_stall_s"] = stall
    run.monitor.after_step(step, record.values)
    if saving or evaluating or preempted or run.steps_log.due(step):
        run.steps_log.flush()
    if preempted:  # [faults] SIGTERM on any rank: every rank saves this step, exits 143
        ckpt.save(step, run.ctx.model, run.ctx.optimizer, run.trainer_state(step), blocking=True)
        what = f"stopped after step {step} and saved {ckpt.root / step_dir_name(step)}"
        if abandoned:
            what += f" (the evaluation after step {step} was abandoned: no val_loss for it)"
        raise run.preemption.leave(what)
