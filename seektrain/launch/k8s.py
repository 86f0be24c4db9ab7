"""Kubernetes manifests that run one `seektrain train` job on N pods of G GPUs each.

Three workload kinds, one pod template:

- ``indexed-job``: a plain ``batch/v1`` Indexed Job plus a headless Service. Needs nothing installed in
  the cluster. Pod K is ``<name>-K``, reachable as ``<name>-K.<name>``; its node rank is its completion
  index, and pod 0 hosts the c10d rendezvous.
- ``jobset``: a JobSet (``jobset.x-k8s.io/v1alpha2``) of one replicated job. JobSet makes the headless
  Service and restarts the whole set when a pod fails.
- ``pytorchjob``: a Kubeflow ``PyTorchJob`` (``kubeflow.org/v1``) with an ``elasticPolicy`` on c10d.
  The training operator makes one Service per pod and sets the ``PET_*`` torchrun variables; the
  container passes the same values as explicit flags, so the command reads the same on every kind.

Every kind carries the resolved config as a ConfigMap (mounted read-only at ``/etc/seektrain``), a
PersistentVolumeClaim mounted as the working directory ``/workspace`` that holds run.dir and every other
relative path of the config (checkpoints outlive pods, so a restarted pod resumes), a
memory-backed ``/dev/shm``, ``nvidia.com/gpu`` limits, NCCL variables, Prometheus scrape annotations,
and a termination grace long enough for the preemption checkpoint.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from seektrain.errors import UserError
from seektrain.launch.image import DEFAULT_IMAGE, IMAGE_UID

KINDS = ("indexed-job", "jobset", "pytorchjob")
CONFIG_DIR = "/etc/seektrain"
CONFIG_PATH = f"{CONFIG_DIR}/config.toml"
WORKSPACE = "/workspace"  # the PVC, mounted as the working directory: relative config paths lie on it
RDZV_PORT = 29400  # torchrun's customary c10d port
JOBSET_REPLICATED_JOB = "node"
MAX_NAME_LEN = 40  # JobSet pod host names add "-node-0-<index>" and must stay within 63
NCCL_ENV = {
    "NCCL_DEBUG": "WARN",
    # tear the process group down on a failed or timed-out collective, so torchrun (and then the
    # cluster) restarts the workers instead of leaving them hanging
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
}
# a model.hf_path given as a hub id is read from this cache: fill it once on the volume, every pod sees it
HF_HOME = f"{WORKSPACE}/.cache/huggingface"

_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


@dataclass
class K8sOptions:
    """What `seektrain launch k8s` was asked for; ``check`` turns a mistake into one line."""

    nodes: int
    gpus_per_node: int
    image: str = DEFAULT_IMAGE
    kind: str = "indexed-job"
    name: str = ""  # default: the run's name, made a DNS label
    namespace: str = ""
    pvc: str = ""  # an existing claim for the run folder; empty = emit one
    pvc_size: str = ""  # empty = estimated from the model and checkpoint.keep
    storage_class: str = ""
    max_restarts: int = 3
    env: dict[str, str] = field(default_factory=dict)

    def check(self) -> None:
        if self.nodes < 1:
            raise UserError(f"--nodes must be >= 1 (got {self.nodes})")
        if self.gpus_per_node < 1:
            raise UserError(f"--gpus-per-node must be >= 1 (got {self.gpus_per_node})")
        if self.kind not in KINDS:
            raise UserError(f"--kind {self.kind!r} is not one of: {', '.join(KINDS)}")
        if not self.image or any(ch.isspace() for ch in self.image):
            raise UserError(f"--image {self.image!r} is not an image reference (e.g. {DEFAULT_IMAGE})")
        if self.name and not (_DNS_LABEL.fullmatch(self.name) and len(self.name) <= MAX_NAME_LEN):
            raise UserError(
                f"--name {self.name!r} must be lowercase letters, digits and '-', start with a "
                f"letter and have at most {MAX_NAME_LEN} characters"
            )
        if self.namespace and not (_DNS_LABEL.fullmatch(self.namespace) and len(self.namespace) <= 63):
            raise UserError(f"--namespace {self.namespace!r} is not a valid namespace name")
        if self.pvc and not (_DNS_SUBDOMAIN.fullmatch(self.pvc) and len(self.pvc) <= 253):
            raise UserError(
                f"--pvc {self.pvc!r} is not a valid claim name (lowercase letters, digits, '-', '.')"
            )
        if self.pvc_size and not _QUANTITY.fullmatch(self.pvc_size):
            raise UserError(f"--pvc-size {self.pvc_size!r} is not a quantity such as 500Gi or 2Ti")
        if self.max_restarts < 0:
            raise UserError(f"--max-restarts must be >= 0 (got {self.max_restarts})")
        for key in self.env:
            if not _ENV_NAME.fullmatch(key):
                raise UserError(f"--env {key!r}: not a valid environment variable name")


def job_name(run_name: str, run_dir: str) -> str:
    """A DNS label from the run's name (or its folder's name): what the pods and services are called."""
    raw = (run_name or os.path.basename(os.path.normpath(run_dir)) or "seektrain").lower()
    name = re.sub(r"[^a-z0-9-]+", "-", raw).lstrip("-0123456789")[:MAX_NAME_LEN].strip("-")
    return name or "seektrain"


def cluster_config(config_path: str | None, overrides: list[str], world_size: int):
    """The job config as the pods will read it: run.dir on the volume, /metrics reachable from outside
    the pod; validated, and its layout resolved for ``world_size`` ranks before anything is written.

    The volume is the pods' working directory, so every relative path of the config (run.dir, a prepared
    data.path, a tokenizer file) lies on it; an absolute run.dir elsewhere would lose the checkpoints."""
    from seektrain.config.loader import load_config
    from seektrain.launch.preflight import check_layout

    cfg = load_config(config_path, overrides)
    run_dir = os.path.normpath(os.path.join(WORKSPACE, cfg.run.dir))
    if not run_dir.startswith(WORKSPACE + "/"):
        raise UserError(
            f"run.dir={cfg.run.dir!r} is outside the run volume; use a relative path "
            f"(it then lies on the volume, mounted at {WORKSPACE}) or one under {WORKSPACE}/"
        )
    extra = [f"run.dir={run_dir}"]
    if cfg.metrics.prometheus_port and cfg.metrics.prometheus_host in ("127.0.0.1", "localhost"):
        extra.append("metrics.prometheus_host=0.0.0.0")  # Prometheus scrapes the pod's IP
    cfg = load_config(config_path, overrides + extra)
    check_layout(cfg, world_size)  # the absolute in-pod run.dir does not exist here: a fresh run's plan
    return cfg


def checkpoint_volume_size(cfg) -> str:
    """A claim size that holds ``checkpoint.keep`` checkpoints plus the one being written: fp32 weights
    and two fp32 AdamW moments (12 bytes a parameter), a quarter on top, at least 10Gi."""
    from seektrain.models import count_params
    from seektrain.train.setup_model import configured_model_config

    counts = count_params(configured_model_config(cfg))
    total_bytes = (counts.total + counts.mtp) * 12 * (cfg.checkpoint.keep + 1) * 1.25
    return f"{max(10, math.ceil(total_bytes / 2**30))}Gi"


def build_manifests(cfg, opts: K8sOptions, config_toml: str) -> list[dict]:
    """ConfigMap, PVC (unless --pvc), headless Service (indexed-job) and the workload, in apply order."""
    opts.check()
    metrics = cfg.metrics
    serving = opts.gpus_per_node if metrics.all_ranks else 1  # ports port .. port + local ranks - 1
    served = range(metrics.prometheus_port, metrics.prometheus_port + serving)
    if metrics.prometheus_port and RDZV_PORT in served:
        raise UserError(
            f"metrics.prometheus_port={metrics.prometheus_port} collides with the rendezvous port "
            f"{RDZV_PORT} in the pods; pick another, e.g. 9400"
        )
    name = opts.name or job_name(cfg.run.name, cfg.run.dir)
    claim = opts.pvc or f"{name}-workspace"
    docs = [_config_map(name, opts, config_toml)]
    if not opts.pvc:
        docs.append(_claim(claim, name, opts, opts.pvc_size or checkpoint_volume_size(cfg)))
    pod = _pod_template(name, claim, cfg, opts)
    if opts.kind == "indexed-job":
        docs += [_headless_service(name, opts, cfg.metrics.prometheus_port), _indexed_job(name, opts, pod)]
    elif opts.kind == "jobset":
        docs.append(_jobset(name, opts, pod))
    else:
        docs.append(_pytorchjob(name, opts, pod))
    return docs


def rendezvous_endpoint(name: str, kind: str) -> str:
    """The stable DNS name of the pod that hosts the c10d store, with the port."""
    host = {
        "indexed-job": f"{name}-0.{name}",
        "jobset": f"{name}-{JOBSET_REPLICATED_JOB}-0-0.{name}",
        "pytorchjob": f"{name}-worker-0",
    }[kind]
    return f"{host}:{RDZV_PORT}"


def train_args(name: str, opts: K8sOptions) -> list[str]:
    """The `seektrain train` command line each pod runs (the image's entrypoint is `seektrain`)."""
    args = [
        "train",
        "--config",
        CONFIG_PATH,
        "--nnodes",
        str(opts.nodes),
        "--nproc-per-node",
        str(opts.gpus_per_node),
        "--max-restarts",
        str(opts.max_restarts),
    ]
    if opts.nodes > 1:
        args += ["--rdzv-endpoint", rendezvous_endpoint(name, opts.kind), "--rdzv-id", name]
        if opts.kind != "pytorchjob":  # the operator's rendezvous assigns ranks; elsewhere the index does
            args += ["--node-rank", "$(NODE_RANK)"]
    return args


def _metadata(name: str, opts: K8sOptions, job: str = "") -> dict:
    meta = {"name": name, "labels": _labels(job or name)}
    if opts.namespace:
        meta["namespace"] = opts.namespace
    return meta


def _labels(name: str) -> dict:
    return {"app.kubernetes.io/name": "seektrain", "app.kubernetes.io/instance": name}


def _config_map(name: str, opts: K8sOptions, config_toml: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(f"{name}-config", opts, name),
        "data": {"config.toml": config_toml},
    }


def _claim(claim: str, name: str, opts: K8sOptions, size: str) -> dict:
    meta = _metadata(claim, opts, name)
    # every node writes its own checkpoint shards into the same folder: several nodes need ReadWriteMany
    spec = {
        "accessModes": ["ReadWriteMany" if opts.nodes > 1 else "ReadWriteOnce"],
        "resources": {"requests": {"storage": size}},
    }
    if opts.storage_class:
        spec["storageClassName"] = opts.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}


def _headless_service(name: str, opts: K8sOptions, metrics_port: int) -> dict:
    ports = [{"name": "rdzv", "port": RDZV_PORT, "targetPort": RDZV_PORT, "protocol": "TCP"}]
    if metrics_port:
        ports.append({"name": "metrics", "port": metrics_port, "targetPort": metrics_port, "protocol": "TCP"})
    # publishNotReadyAddresses: the pods' DNS names exist from the start, before any pod is Ready,
    # so the rendezvous can be reached while the others are still starting
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(name, opts),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": _labels(name),
            "ports": ports,
        },
    }


def _pod_template(name: str, claim: str, cfg, opts: K8sOptions) -> dict:
    metrics_port = cfg.metrics.prometheus_port
    rdzv_port_name = "pytorchjob-port" if opts.kind == "pytorchjob" else "rdzv"  # the operator looks for it
    ports = [{"name": rdzv_port_name, "containerPort": RDZV_PORT, "protocol": "TCP"}]
    env = []
    if opts.kind != "pytorchjob" and opts.nodes > 1:
        env.append(
            {
                "name": "NODE_RANK",
                "valueFrom": {
                    "fieldRef": {
                        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
                    }
                },
            }
        )
    defaults = {**NCCL_ENV, "HF_HOME": HF_HOME}
    env += [{"name": key, "value": value} for key, value in {**defaults, **opts.env}.items()]
    gpus = str(opts.gpus_per_node)
    container = {
        "name": "pytorch" if opts.kind == "pytorchjob" else "seektrain",  # PyTorchJob requires "pytorch"
        "image": opts.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["seektrain"],
        "workingDir": WORKSPACE,
        "args": train_args(name, opts),
        "env": env,
        "ports": ports,
        "resources": {"limits": {"nvidia.com/gpu": gpus}, "requests": {"nvidia.com/gpu": gpus}},
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "workspace", "mountPath": WORKSPACE},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    meta = {"labels": _labels(name)}
    if metrics_port:
        ports.append({"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"})
        meta["annotations"] = {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(metrics_port),
            "prometheus.io/path": "/metrics",
        }
    # SIGTERM (eviction, deletion) makes the workers save a checkpoint within checkpoint.preempt_grace_s;
    # torchrun waits up to 30 s more for them, so the pod must not be killed before both have passed
    grace = max(60, math.ceil(cfg.checkpoint.preempt_grace_s) + 35)
    spec = {
        "restartPolicy": "OnFailure",
        "terminationGracePeriodSeconds": grace,
        "securityContext": {"fsGroup": IMAGE_UID},  # the non-root image user can write the run volume
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": f"{name}-config"}},
            {"name": "workspace", "persistentVolumeClaim": {"claimName": claim}},
            # NCCL and the data loader workers share memory through /dev/shm; the default 64 MiB is too small
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        ],
    }
    return {"metadata": meta, "spec": spec}


def _indexed_job(name: str, opts: K8sOptions, pod: dict) -> dict:
    pod["spec"]["subdomain"] = name  # pod K answers as <name>-K.<name> through the headless Service
    # OnFailure restarts a failed container in place (same DNS name); the restarted node rejoins the
    # rendezvous and every node resumes from the newest checkpoint. One failure usually fails all N pods.
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(name, opts),
        "spec": {
            "completionMode": "Indexed",
            "completions": opts.nodes,
            "parallelism": opts.nodes,
            "backoffLimit": max(1, opts.max_restarts) * opts.nodes,
            "template": pod,
        },
    }


def _jobset(name: str, opts: K8sOptions, pod: dict) -> dict:
    # a failed pod fails its Job at once (backoffLimit 0, restartPolicy Never); JobSet then recreates
    # every pod (failurePolicy.maxRestarts times) and they resume together from the newest checkpoint
    pod["spec"]["restartPolicy"] = "Never"
    job = {
        "completionMode": "Indexed",
        "completions": opts.nodes,
        "parallelism": opts.nodes,
        "backoffLimit": 0,
        "template": pod,
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": _metadata(name, opts),
        "spec": {
            "failurePolicy": {"maxRestarts": max(1, opts.max_restarts)},
            "network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
            "replicatedJobs": [{"name": JOBSET_REPLICATED_JOB, "replicas": 1, "template": {"spec": job}}],
        },
    }


def _pytorchjob(name: str, opts: K8sOptions, pod: dict) -> dict:
    # elasticPolicy without min/max replicas: a fixed-size job on the c10d rendezvous at worker 0
    # (the operator's default rdzvHost), the port named "pytorchjob-port" in the container
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _metadata(name, opts),
        "spec": {
            "nprocPerNode": str(opts.gpus_per_node),
            "elasticPolicy": {"rdzvBackend": "c10d", "rdzvPort": RDZV_PORT, "maxRestarts": opts.max_restarts},
            "runPolicy": {"backoffLimit": max(1, opts.max_restarts) * opts.nodes},
            "pytorchReplicaSpecs": {
                "Worker": {"replicas": opts.nodes, "restartPolicy": "OnFailure", "template": pod}
            },
        },
    }
