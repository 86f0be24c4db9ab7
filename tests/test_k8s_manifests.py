"""`seektrain launch k8s`: the manifests of every kind are valid Kubernetes objects, run the right command,
and carry the config, the run volume, /dev/shm, GPUs, NCCL settings and Prometheus annotations.

Offline validation: the core kinds (and the pod and job templates inside the custom resources) with
`kubernetes-validate`'s strict schemas; PyTorchJob and JobSet against the openAPIV3Schema their CRDs
publish (tests/data/k8s/, see its README), made strict the way `kubectl apply --validate=strict` is.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from seektrain.cli.main import build_parser, main
from seektrain.config.loader import load_config
from seektrain.launch.image import DEFAULT_IMAGE
from seektrain.launch.k8s import KINDS, WORKSPACE
from seektrain.launch.yaml_text import to_yaml, to_yaml_documents

K8S_VERSION = (
    "1.33.0"  # a release kubernetes-validate ships; Indexed Jobs and their pod index annotation are GA
)
DATA = Path(__file__).parent / "data" / "k8s"
CRD_SCHEMAS = {
    ("kubeflow.org/v1", "PyTorchJob"): "pytorchjob-v1.schema.json",
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset-v1alpha2.schema.json",
}
NODES, GPUS = 2, 4
# a tiny run whose layout fits 2 x 4 = 8 ranks: micro 2 x data-parallel 8 divides 32
RUN_SETS = [
    "train.global_batch_size=32",
    "train.micro_batch_size=2",
    "metrics.prometheus_port=9400",
    "run.dir=runs/tiny-k8s",
]


def generate(tmp_path: Path, *extra: str) -> list[dict]:
    out = tmp_path / "job.yaml"
    argv = ["launch", "k8s", "--nodes", str(NODES), "--gpus-per-node", str(GPUS), "-o", str(out)]
    for item in RUN_SETS:
        argv += ["--set", item]
    assert main(argv + list(extra)) == 0
    return list(yaml.safe_load_all(out.read_text()))


@pytest.fixture(scope="module", params=KINDS)
def manifests(request, tmp_path_factory) -> tuple[str, list[dict]]:
    return request.param, generate(tmp_path_factory.mktemp(request.param), "--kind", request.param)


def by_kind(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def workload(docs: list[dict]) -> dict:
    return docs[-1]


def pod_template(doc: dict) -> dict:
    if doc["kind"] == "Job":
        return doc["spec"]["template"]
    if doc["kind"] == "JobSet":
        return doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    return doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]


def container(doc: dict) -> dict:
    (c,) = pod_template(doc)["spec"]["containers"]
    return c


# --- validation ------------------------------------------------------------------------------------


def validate_core(doc: dict) -> None:
    """kubernetes-validate (strict: unknown fields fail), plus the API server's rule the OpenAPI schema
    leaves out: a container of a workload needs an image."""
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    template = doc.get("template") or doc.get("spec", {}).get("template")
    for c in (template or {}).get("spec", {}).get("containers", []):
        if not c.get("image"):
            raise jsonschema.ValidationError(f"{doc['kind']}: container {c.get('name')!r} has no image")


def _strict(schema):
    """Reject unknown fields, as the API server's strict field validation does for structural CRD
    schemas: every object schema with properties and no preserve-unknown-fields gets
    additionalProperties: false."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def crd_schema(doc: dict) -> dict:
    return _strict(json.loads((DATA / CRD_SCHEMAS[(doc["apiVersion"], doc["kind"])]).read_text()))


def validate_custom(doc: dict) -> None:
    """The CRD's published schema, and the pod (and JobSet's job) templates as core objects."""
    jsonschema.validate(doc, crd_schema(doc), cls=jsonschema.Draft7Validator)
    validate_core(
        {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": pod_template(doc)}
    )
    if doc["kind"] == "JobSet":
        job = doc["spec"]["replicatedJobs"][0]["template"]
        validate_core({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "t"}, **job})


def validate(doc: dict) -> None:
    if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS:
        validate_custom(doc)
    else:
        validate_core(doc)


def test_every_manifest_validates(manifests):
    kind, docs = manifests
    expected = {
        "indexed-job": ["ConfigMap", "PersistentVolumeClaim", "Service", "Job"],
        "jobset": ["ConfigMap", "PersistentVolumeClaim", "JobSet"],
        "pytorchjob": ["ConfigMap", "PersistentVolumeClaim", "PyTorchJob"],
    }[kind]
    assert [d["kind"] for d in docs] == expected
    for doc in docs:
        validate(doc)


def test_broken_manifests_fail_validation(manifests):
    _, docs = manifests
    no_image = copy.deepcopy(workload(docs))
    del container(no_image)["image"]
    with pytest.raises(jsonschema.ValidationError):
        validate(no_image)
    typo = copy.deepcopy(workload(docs))
    container(typo)["imagePulPolicy"] = container(typo).pop("imagePullPolicy")
    with pytest.raises(jsonschema.ValidationError, match="imagePulPolicy"):
        validate(typo)
    bad_claim = copy.deepcopy(by_kind(docs, "PersistentVolumeClaim"))
    bad_claim["spec"]["accessModes"] = "ReadWriteMany"  # a string where a list belongs
    with pytest.raises(jsonschema.ValidationError):
        validate(bad_claim)


def test_custom_resource_schemas_catch_their_own_fields(tmp_path):
    docs = generate(tmp_path, "--kind", "pytorchjob")
    job = copy.deepcopy(workload(docs))
    job["spec"]["elasticPolicy"]["rdzvBackends"] = job["spec"]["elasticPolicy"].pop("rdzvBackend")
    with pytest.raises(jsonschema.ValidationError, match="rdzvBackends"):
        validate(job)
    jobset = copy.deepcopy(workload(generate(tmp_path, "--kind", "jobset")))
    jobset["spec"]["replicatedJobs"][0]["replicas"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        validate(jobset)


# --- what the pods run -------------------------------------------------------------------------------


def test_pods_run_seektrain_train_on_the_first_pods_rendezvous(manifests):
    kind, docs = manifests
    job = workload(docs)
    c = container(job)
    assert c["command"] == ["seektrain"] and c["image"] == DEFAULT_IMAGE
    args = build_parser().parse_args([a.replace("$(NODE_RANK)", "1") for a in c["args"]])
    assert (args.command, args.config, args.nnodes, args.nproc_per_node) == (
        "train",
        "/etc/seektrain/config.toml",
        str(NODES),
        GPUS,
    )
    host, port = args.rdzv_endpoint.rsplit(":", 1)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    name = job["metadata"]["name"]
    spec = pod_template(job)["spec"]
    if kind == "indexed-job":
        # pod 0 is <job>-0 in the headless Service named by the pod subdomain
        service = by_kind(docs, "Service")
        assert host == f"{name}-0.{spec['subdomain']}" and service["metadata"]["name"] == spec["subdomain"]
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"].items() <= pod_template(job)["metadata"]["labels"].items()
        assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == NODES
    elif kind == "jobset":
        rjob = job["spec"]["replicatedJobs"][0]
        assert host == f"{name}-{rjob['name']}-0-0.{job['spec']['network']['subdomain']}"
        assert rjob["template"]["spec"]["completions"] == NODES
    else:
        assert host == f"{name}-worker-0" and int(port) == job["spec"]["elasticPolicy"]["rdzvPort"]
        assert c["name"] == "pytorch" and "pytorchjob-port" in ports
        assert job["spec"]["elasticPolicy"]["rdzvBackend"] == "c10d"
        assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == NODES
    assert int(port) in ports.values()
    if kind != "pytorchjob":  # the node rank is the pod's completion index
        assert args.node_rank == 1
        (rank_env,) = [e for e in c["env"] if e["name"] == "NODE_RANK"]
        assert "job-completion-index" in rank_env["valueFrom"]["fieldRef"]["fieldPath"]


def test_pods_carry_config_volume_shm_gpus_nccl_and_metrics(manifests, tmp_path):
    kind, docs = manifests
    job = workload(docs)
    template, c = pod_template(job), container(job)
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    # the config: the ConfigMap mounted where --config points, and it loads as the job's config
    config_map = by_kind(docs, "ConfigMap")
    assert volumes[mounts["/etc/seektrain"]]["configMap"]["name"] == config_map["metadata"]["name"]
    (tmp_path / "config.toml").write_text(config_map["data"]["config.toml"])
    cfg = load_config(str(tmp_path / "config.toml"), [])
    assert cfg.run.dir == f"{WORKSPACE}/runs/tiny-k8s" and cfg.train.global_batch_size == 32
    assert cfg.metrics.prometheus_host == "0.0.0.0"  # reachable by Prometheus from outside the pod
    # run.dir on the claim, mounted as the working directory
    claim = by_kind(docs, "PersistentVolumeClaim")
    assert volumes[mounts[WORKSPACE]]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert c["workingDir"] == WORKSPACE and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory"}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == str(GPUS)
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["NCCL_DEBUG"] and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["HF_HOME"].startswith(WORKSPACE + "/")  # hub ids are read from a cache on the volume
    assert template["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "9400",
        "prometheus.io/path": "/metrics",
    }
    assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in c["ports"]
    # a failed pod is restarted (in place, or the whole set), and the grace period covers the SIGTERM save
    assert template["spec"]["terminationGracePeriodSeconds"] >= cfg.checkpoint.preempt_grace_s + 30
    restart = {
        "indexed-job": lambda: job["spec"]["backoffLimit"],
        "jobset": lambda: job["spec"]["failurePolicy"]["maxRestarts"],
        "pytorchjob": lambda: job["spec"]["runPolicy"]["backoffLimit"],
    }[kind]()
    assert restart >= 1


def test_existing_claim_options_and_namespace(tmp_path):
    docs = generate(
        tmp_path,
        "--pvc",
        "shared-runs",
        "--namespace",
        "ml",
        "--image",
        "registry.local/st:1",
        "--env",
        "NCCL_IB_HCA=mlx5",
        "--env",
        "NCCL_DEBUG=INFO",
        "--name",
        "exp-7",
    )
    assert [d["kind"] for d in docs] == ["ConfigMap", "Service", "Job"]
    assert all(d["metadata"]["namespace"] == "ml" for d in docs)
    job = workload(docs)
    assert job["metadata"]["name"] == "exp-7"
    volumes = {v["name"]: v for v in pod_template(job)["spec"]["volumes"]}
    assert volumes["workspace"]["persistentVolumeClaim"]["claimName"] == "shared-runs"
    c = container(job)
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert (
        c["image"] == "registry.local/st:1" and env["NCCL_IB_HCA"] == "mlx5" and env["NCCL_DEBUG"] == "INFO"
    )
    for doc in docs:
        validate(doc)


def test_one_node_needs_no_rendezvous(tmp_path):
    out = tmp_path / "one.yaml"
    assert (
        main(
            [
                "launch",
                "k8s",
                "--nodes",
                "1",
                "--gpus-per-node",
                "1",
                "--set",
                "train.global_batch_size=8",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    docs = list(yaml.safe_load_all(out.read_text()))
    args = container(workload(docs))["args"]
    assert "--rdzv-endpoint" not in args and "--node-rank" not in args
    assert by_kind(docs, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteOnce"]
    for doc in docs:
        validate(doc)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--set", "parallel.tp=3"], "tp"),  # the layout does not fit 2 x 4 ranks
        (["--set", "run.dir=/scratch/run"], "run.dir"),  # checkpoints would not be on the volume
        (["--name", "Bad_Name"], "--name"),
        (["--pvc-size", "lots"], "--pvc-size"),
        (["--env", "NCCL_DEBUG"], "--env"),
        (["--set", "metrics.prometheus_port=29400"], "rendezvous port"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, argv, message):
    out = tmp_path / "job.yaml"
    base = ["launch", "k8s", "--nodes", str(NODES), "--gpus-per-node", str(GPUS), "-o", str(out)]
    for item in RUN_SETS:
        base += ["--set", item]
    assert main(base + argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("seektrain: error:") and "\n" not in err and message in err
    assert not out.exists()


# --- the YAML writer ---------------------------------------------------------------------------------


def test_yaml_writer_round_trips_through_a_yaml_reader():
    tricky = [
        "yes",
        "No",
        "on",
        "OFF",
        "y",
        "null",
        "~",
        "",
        "1",
        "1.5",
        "1e3",
        "0x1f",
        "0o17",
        "012",
        "1:20",
        "-",
        "- a",
        "a: b",
        "a #b",
        "#c",
        "$(NODE_RANK)",
        "--nnodes",
        "*x",
        "&y",
        "!z",
        "@a",
        "`b",
        "%c",
        "{a}",
        "[1]",
        "'q'",
        '"d"',
        "tab\there",
        "é",
        "2026-11-30",
        "nvidia.com/gpu",
        " lead",
        "trail ",
        "multi\nline\n",
        "no newline\nat end",
        "two\n\n",
        "\nleading newline\n",
        "  indented\nx\n",
    ]
    doc = {
        "strings": tricky,
        "numbers": [0, -3, 2.5, True, False, None],
        "empty": {"d": {}, "l": []},
        "nested": [{"a": 1, "b": [{"c": "d"}, ["x", "y"]]}, []],
        "yes": "no",
        "1": "one",
        "config.toml": '[run]\ndir = "/workspace/runs/x"\n\n[metrics]\nprometheus_port = 9400\n',
    }
    assert yaml.safe_load(to_yaml(doc)) == doc
    assert list(yaml.safe_load_all(to_yaml_documents([doc, {"k": "v"}]))) == [doc, {"k": "v"}]
    assert "config.toml: |\n  [run]\n" in to_yaml(doc)  # a config file stays readable


def test_stdout_without_output_file_and_a_note_when_metrics_are_off(capsys):
    assert main(["launch", "k8s", "--nodes", "1", "--gpus-per-node", "2", "--kind", "jobset"]) == 0
    out, err = capsys.readouterr()
    docs = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in docs] == ["ConfigMap", "PersistentVolumeClaim", "JobSet"]
    assert "annotations" not in pod_template(workload(docs))["metadata"]
    assert "metrics.prometheus_port is 0" in err
