"""Write an sbatch script that runs ``seektrain train`` on a Slurm allocation.

Why a generated script rather than a launcher that talks to Slurm: clusters differ (accounts, QOS,
modules, containers), so users keep, read and edit the script, and submit it with their own ``sbatch``.
What the script must get right, and what each line is for:

* One ``srun`` task per node (``--ntasks-per-node=1``); inside it ``seektrain train`` starts the
  node's worker processes through torchrun. The c10d rendezvous lives on the allocation's first node
  (``scontrol show hostnames``) and its id is the job id, so two jobs never meet. ``SLURM_NODEID`` is
  read inside each task (by ``bash -c``), not in the batch shell, where it is always 0.
* Preemption and time limits: Slurm sends SIGTERM to the training processes (``--signal=TERM@S``,
  S seconds before the time limit; ``scancel --signal=TERM``; preemption). The trainer stops every
  rank after the same step, saves a checkpoint within ``checkpoint.preempt_grace_s`` and exits with
  143 (train/faults.py). The script then requeues the job (``--requeue`` makes it requeueable), and the
  requeued job resumes from that checkpoint because ``checkpoint.resume=auto`` picks the newest one.
  The signal goes to the job steps, not the batch shell (no ``B:``): the shell must live on to see 143.
* Every task may start in another directory on another machine, so ``run.dir`` and the config are
  absolute paths on storage every node sees, and the job runs in the directory it was generated in
  (``--chdir``), so relative paths in the config mean what they meant when it was validated here.
* Since Slurm 22.05 ``srun`` no longer inherits ``--cpus-per-task`` from sbatch; the script passes it on.
"""

from __future__ import annotations

import math
import re
import shlex
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from seektrain.errors import UserError

SIGNAL_MARGIN_S = 30  # on top of checkpoint.preempt_grace_s: finishing the step, exiting, requeueing
MIN_TRAIN_S = 60  # a --time that leaves less than this before the stop signal cannot train
RDZV_PORT_BASE = 29500  # rendezvous port = base + job id % 2000, below Linux's ephemeral port range
CONTAINER_TRAIN = ("seektrain",)  # inside --image the CLI is on PATH (deploy/docker/Dockerfile)

_TIME = re.compile(r"^(?:(?P<d>\d+)-)?(?P<a>\d+)(?::(?P<b>\d+))?(?::(?P<c>\d+))?$")


def parse_slurm_time(text: str) -> int:
    """Seconds in a Slurm time limit: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (``sbatch --time`` forms)."""
    m = _TIME.match(text.strip())
    if not m:
        raise UserError(f"--time {text!r} is not a Slurm time; use minutes, MM:SS, HH:MM:SS or D-HH:MM:SS")
    d, a, b, c = (int(m[k]) if m[k] is not None else None for k in "dabc")
    if d is None:
        if b is None:
            return a * 60  # minutes
        return a * 60 + b if c is None else (a * 60 + b) * 60 + c  # M:S or H:M:S
    return d * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)  # D-H[:M[:S]]


@dataclass
class SlurmJob:
    """Everything the script says, resolved and checked by ``plan_slurm_job``."""

    config: Path  # absolute
    overrides: list[str]
    nodes: int
    gpus_per_node: int
    nproc_per_node: int
    cpus_per_task: int
    run_dir: Path  # absolute
    workdir: Path  # absolute: the job's working directory (where the script was generated)
    job_name: str
    signal_s: int  # SIGTERM this many seconds before the time limit
    train_command: list[str]  # the program that is `seektrain` on the nodes
    partition: str = ""
    time: str = ""
    account: str = ""
    image: str = ""
    notes: list[str] = field(default_factory=list)  # things worth telling the user, not errors

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node


def plan_slurm_job(
    config: str,
    overrides: list[str],
    nodes: int,
    gpus_per_node: int,
    *,
    nproc_per_node: int | None = None,
    cpus_per_task: int | None = None,
    partition: str = "",
    time: str = "",
    account: str = "",
    image: str = "",
    python: str = "",
    workdir: Path | None = None,
) -> SlurmJob:
    """Validate the config and the layout for ``nodes`` × workers now, before anything is queued.
    ``python`` is the interpreter the nodes run (default: this one; ignored with ``image``).
    Raises ValueError (one line)."""
    from seektrain.config.loader import load_config
    from seektrain.launch.preflight import check_layout

    if nodes < 1:
        raise UserError(f"--nodes must be >= 1, got {nodes}")
    if gpus_per_node < 0:
        raise UserError(f"--gpus-per-node must be >= 0 (0 = CPU nodes), got {gpus_per_node}")
    if nproc_per_node is None:
        nproc_per_node = gpus_per_node or 1
    if nproc_per_node < 1:
        raise UserError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    if gpus_per_node and nproc_per_node != gpus_per_node:
        raise UserError(
            f"--nproc-per-node {nproc_per_node} differs from --gpus-per-node {gpus_per_node}; "
            "seektrain runs one worker per GPU (drop --nproc-per-node)"
        )
    if cpus_per_task is None:
        cpus_per_task = 8 * nproc_per_node
    if cpus_per_task < nproc_per_node:
        raise UserError(
            f"--cpus-per-task {cpus_per_task} is fewer than the {nproc_per_node} worker processes "
            "per node; give each worker at least one CPU"
        )

    config_path = Path(config).expanduser().absolute()
    cfg = load_config(config_path, overrides)
    run_dir = Path(cfg.run.dir)  # not expanded: the trainer does not expand ~ either
    if not run_dir.is_absolute():
        raise UserError(
            f"run.dir={cfg.run.dir!r} is relative, but Slurm tasks may start in another directory on "
            "another node; set run.dir to an absolute path on storage every node shares"
        )
    check_layout(cfg, nodes * nproc_per_node)

    signal_s = math.ceil(cfg.checkpoint.preempt_grace_s) + SIGNAL_MARGIN_S
    if time and parse_slurm_time(time) < signal_s + MIN_TRAIN_S:
        raise UserError(
            f"--time {time} is too short: Slurm is asked to stop training {signal_s} s before the "
            f"limit (checkpoint.preempt_grace_s + {SIGNAL_MARGIN_S} s); ask for at least "
            f"{signal_s + MIN_TRAIN_S} s"
        )
    notes = []
    if cfg.checkpoint.resume != "auto":
        notes.append(
            f"checkpoint.resume={cfg.checkpoint.resume!r}: a requeued job starts from that again, not "
            "from the checkpoint it saved when preempted; checkpoint.resume=auto resumes from the newest"
        )
    train_command = list(CONTAINER_TRAIN) if image else [python or sys.executable, "-m", "seektrain.cli.main"]
    return SlurmJob(
        config=config_path,
        overrides=list(overrides),
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        nproc_per_node=nproc_per_node,
        cpus_per_task=cpus_per_task,
        run_dir=run_dir,
        workdir=(workdir or Path.cwd()).absolute(),
        job_name=_job_name(cfg.run.name or run_dir.name),
        signal_s=signal_s,
        train_command=train_command,
        partition=partition,
        time=time,
        account=account,
        image=image,
        notes=notes,
    )


def _job_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "seektrain"


def generator_command(job: SlurmJob) -> str:
    """The `seektrain launch slurm` command line that writes this script (for its header)."""
    argv = [
        "seektrain",
        "launch",
        "slurm",
        "--config",
        str(job.config),
        "--nodes",
        str(job.nodes),
        "--gpus-per-node",
        str(job.gpus_per_node),
    ]
    if not job.gpus_per_node:
        argv += ["--nproc-per-node", str(job.nproc_per_node)]
    argv += ["--cpus-per-task", str(job.cpus_per_task)]
    for flag, value in (
        ("--partition", job.partition),
        ("--time", job.time),
        ("--account", job.account),
        ("--image", job.image),
    ):
        if value:
            argv += [flag, value]
    for item in job.overrides:
        argv += ["--set", item]
    return shlex.join(argv)


def _sbatch_lines(job: SlurmJob) -> list[str]:
    opts = [
        f"--job-name={job.job_name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={job.cpus_per_task}",
    ]
    if job.gpus_per_node:
        opts.append(f"--gpus-per-node={job.gpus_per_node}")
    for flag, value in (("partition", job.partition), ("time", job.time), ("account", job.account)):
        if value:
            opts.append(f"--{flag}={value}")
    opts += [
        f"--chdir={job.workdir}",
        f"--output={job.run_dir}/slurm-%j.out",
        "--open-mode=append",
        f"--signal=TERM@{job.signal_s}",
        "--requeue",
    ]
    return [f"#SBATCH {shlex.quote(o)}" for o in opts]


def _srun_options(job: SlurmJob) -> list[str]:
    opts = [
        '--nodes="$SLURM_NNODES"',
        "--ntasks-per-node=1",
        '--cpus-per-task="$SLURM_CPUS_PER_TASK"',
        "--kill-on-bad-exit=1",
    ]
    if job.gpus_per_node:  # explicit, so the step holds every GPU of the node whatever the site's defaults
        opts.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.image:  # pyxis/enroot: the run dir, the config and the working directory at the same paths
        mounts = sorted({str(job.run_dir), str(job.config.parent), str(job.workdir)})
        opts += [
            f"--container-image={shlex.quote(job.image)}",
            f"--container-mounts={shlex.quote(','.join(mounts))}",
            f"--container-workdir={shlex.quote(str(job.workdir))}",
        ]
    return opts


def render_sbatch(job: SlurmJob) -> str:
    """The sbatch script for ``job`` (see the module docstring for why each part is there)."""
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    train = [
        job.train_command,
        ["train", "--config", str(job.config)],
        *(["--set", o] for o in job.overrides),
    ]
    train_lines = "\n    ".join(shlex.join(words) for words in train)
    where = f"inside {job.image} (pyxis)" if job.image else f"with {job.train_command[0]}"
    lines = [
        "#!/bin/bash",
        f"# Generated by `seektrain launch slurm` on {stamp}; regenerate rather than edit:",
        f"#   {generator_command(job)}",
        f"# {job.nodes} node(s) x {job.nproc_per_node} worker(s) = world size {job.world_size}; "
        f"run.dir {job.run_dir}.",
        f"# Each node runs `seektrain train` {where}; the c10d rendezvous is on the first node.",
        f"# Preemption: Slurm sends SIGTERM {job.signal_s} s before --time ends (or on scancel --signal=TERM);",
        "# every rank saves a checkpoint and exits 143, and this script requeues the job, which resumes",
        "# from that checkpoint (checkpoint.resume=auto). Stop for good with a plain `scancel JOBID`.",
        *_sbatch_lines(job),
        "",
        "set -uo pipefail",
        "export PYTHONUNBUFFERED=1",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        f"RDZV_PORT=$(( {RDZV_PORT_BASE} + SLURM_JOB_ID % 2000 ))",
        'echo "seektrain: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_NNODES node(s):'
        ' $SLURM_JOB_NODELIST; rendezvous $HEAD_NODE:$RDZV_PORT"',
        "",
        "TRAIN=(",
        f"    {train_lines}",
        f'    --nnodes "$SLURM_NNODES" --nproc-per-node {job.nproc_per_node}',
        '    --rdzv-endpoint "$HEAD_NODE:$RDZV_PORT" --rdzv-id "$SLURM_JOB_ID"',
        ")",
        "# SLURM_NODEID differs per node: expand it inside each task, not here.",
        "srun " + " ".join(_srun_options(job)) + " \\",
        '    bash -c \'exec "$@" --node-rank "$SLURM_NODEID"\' seektrain-node "${TRAIN[@]}"',
        "rc=$?",
        'if [ "$rc" -eq 143 ]; then',
        '    echo "seektrain: training saved a checkpoint after SIGTERM; requeueing job $SLURM_JOB_ID to resume"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)
