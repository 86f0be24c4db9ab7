"""No value ever becomes code (issue 22, items 6-7): hostile values fed through every field the launchers
write are either refused in one line or arrive intact, as data, in a script that runs nothing extra.

* sbatch scripts: each one is checked with ``bash -n`` and then run by bash with fake ``srun``,
  ``scontrol`` and ``sbatch`` on PATH (``srun`` records its argv); no ``PWNED`` file may appear, the value
  must reach ``srun`` unchanged, and the ``#SBATCH`` directives sbatch reads (it stops at the first line
  that is not a comment) must still hold ``--signal``, ``--requeue`` and ``--output``.
* Kubernetes manifests: parsed back with PyYAML, they must equal the documents we built (so the value is
  intact, as a string, and no key or document was added), and the ConfigMap's TOML must read back too.
* ``-o`` replaces only a launch file seektrain wrote (or a foreign one with ``--force``), never the config.

Everything runs in this process except the generated scripts, which bash runs (a few ms each).
"""

from __future__ import annotations

import os
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from seektrain.cli.main import main
from seektrain.errors import UserError
from seektrain.launch.k8s import K8sOptions, build_manifests, cluster_config
from seektrain.launch.slurm import plan_slurm_job, render_sbatch
from seektrain.launch.yaml_text import to_yaml_documents

PAYLOADS = [
    "\ntouch PWNED #",
    "$(touch PWNED)",
    "`touch PWNED`",
    "';touch PWNED;'",
    '";touch PWNED;"',
    "x;touch PWNED",
    "x\rtouch PWNED",
    "a\u2028b",
    "x\x85touch PWNED",  # NEL: a line break to YAML 1.1 readers
]

FAKES = {
    # srun records each argument on its own NUL-terminated record, so newlines survive
    "srun": 'for a in "$@"; do printf "%s\\0" "$a"; done > "$SRUN_ARGV"\n',
    "scontrol": 'if [ "$1" = show ]; then echo node-0; fi\n',
    "sbatch": "exit 0\n",
    "torchrun": "exit 0\n",
}
SLURM_ENV = {
    "SLURM_JOB_ID": "7",
    "SLURM_JOB_NODELIST": "node-0",
    "SLURM_NNODES": "1",
    "SLURM_CPUS_PER_TASK": "2",
    "SLURM_NODEID": "0",
}


def _one_line(err: UserError) -> None:
    assert "\n" not in str(err) and "\r" not in str(err), repr(str(err))


def _directives(script: str) -> list[str]:
    """What sbatch reads: ``#SBATCH`` lines up to the first line that is neither empty nor a comment."""
    read = []
    for line in script.splitlines()[1:]:
        if line.startswith("#SBATCH"):
            read.append(line.split(None, 1)[1])
        elif line.strip() and not line.startswith("#"):
            break
    return read


@pytest.fixture(scope="module")
def fake_bin(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fakebin")
    for name, body in FAKES.items():
        (folder / name).write_text("#!/bin/bash\n" + body)
        (folder / name).chmod(0o755)
    return folder


def _run_script(script: str, where: Path, fake_bin: Path) -> list[str]:
    """bash -n, then bash itself in ``where`` with the fakes first on PATH; srun's argv."""
    path = where / "job.sbatch"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)
    argv_file = where / "srun.argv"
    env = {**os.environ, **SLURM_ENV, "PATH": f"{fake_bin}:{os.environ['PATH']}", "SRUN_ARGV": str(argv_file)}
    subprocess.run(["bash", str(path)], cwd=where, env=env, check=True, timeout=30, capture_output=True)
    assert not list(where.rglob("PWNED")), "the script ran an injected command"
    return argv_file.read_bytes().decode().split("\0")[:-1]


def _slurm_cases(tmp: Path, payload: str) -> list[tuple[str, dict, str | None]]:
    """(field, plan_slurm_job keyword arguments, the argument srun must receive intact or None)."""
    config = tmp / "job.toml"
    run = str(tmp / "run")
    named = tmp / f"c{payload}.toml"
    named.write_text('[model]\npreset = "tiny-dense"\n')
    workdir = tmp / f"w{payload}"
    workdir.mkdir(exist_ok=True)
    base = {"config": str(config), "overrides": [f"run.dir={run}"]}
    return [
        ("--partition", {**base, "partition": payload}, None),
        ("--account", {**base, "account": payload}, None),
        ("--image", {**base, "image": "nvcr.io/nvidia/pytorch:24.05" + payload}, None),
        ("--image path", {**base, "image": f"/images/x{payload}.sqsh"}, None),
        ("--time", {**base, "time": "24:00:00" + payload}, None),
        (
            "--set value",
            {**base, "overrides": [f"run.dir={run}", f"run.name={payload}"]},
            f"run.name={payload}",
        ),
        (
            "--set data.path",
            {**base, "overrides": [f"run.dir={run}", f"data.path=d{payload}"]},
            f"data.path=d{payload}",
        ),
        ("run.dir", {**base, "overrides": [f"run.dir={run}{payload}"]}, None),
        ("config name", {**base, "config": str(named)}, None),
        ("working directory", {**base, "workdir": workdir}, None),
        ("python", {**base, "python": f"/usr/bin/python{payload}"}, f"/usr/bin/python{payload}"),
    ]


@pytest.mark.parametrize("payload", PAYLOADS, ids=[repr(p) for p in PAYLOADS])
def test_slurm_script_never_runs_a_value(payload, tmp_path, fake_bin):
    (tmp_path / "job.toml").write_text('[model]\npreset = "tiny-dense"\n')
    accepted = 0
    for field, kwargs, intact in _slurm_cases(tmp_path, payload):
        config = kwargs.pop("config")
        overrides = kwargs.pop("overrides")
        try:
            job = plan_slurm_job(config, overrides, 1, 0, nproc_per_node=1, cpus_per_task=2, **kwargs)
        except UserError as err:
            _one_line(err)
            # a --set value (or the interpreter) is data, quoted in the TRAIN array: refused only when it
            # would end the header's comment line
            assert intact is None or not payload.isprintable(), (field, str(err))
            continue
        accepted += 1
        script = render_sbatch(job)
        read = _directives(script)
        assert any(d.startswith("--signal=TERM@") for d in read), (field, read)
        assert "--requeue" in read and any(d.startswith("--output=") for d in read), (field, read)
        where = tmp_path / f"exec-{accepted}"
        where.mkdir()
        argv = _run_script(script, where, fake_bin)
        assert intact is None or intact in argv, (field, intact, argv)
    assert accepted == (3 if payload.isprintable() else 0)


def test_safe_values_reach_srun_and_every_directive(tmp_path, fake_bin):
    config = tmp_path / "job.toml"
    config.write_text('[model]\npreset = "tiny-dense"\n')
    job = plan_slurm_job(
        str(config),
        [f"run.dir={tmp_path}/run", "run.name=my run (v2)"],
        1,
        0,
        nproc_per_node=1,
        cpus_per_task=2,
        partition="gpu,gpu-long",
        account="proj-1",
        time="1-00:00:00",
        image="nvcr.io#nvidia/pytorch:24.05-py3",
    )
    script = render_sbatch(job)
    read = _directives(script)
    assert "--partition=gpu,gpu-long" in read and "--account=proj-1" in read and "--time=1-00:00:00" in read
    argv = _run_script(script, tmp_path, fake_bin)
    assert "--container-image=nvcr.io#nvidia/pytorch:24.05-py3" in argv and "run.name=my run (v2)" in argv


K8S_FIELDS = ["name", "namespace", "pvc", "pvc_size", "storage_class", "image", "env value", "env name"]


def _k8s_opts(field: str, value: str) -> K8sOptions:
    opts = K8sOptions(nodes=2, gpus_per_node=1)
    if field == "env value":
        opts.env = {"NCCL_IB_HCA": value}
    elif field == "env name":
        opts.env = {value: "1"}
    elif field == "image":
        opts.image = "seektrain:1" + value
    else:
        setattr(opts, field, value)
    return opts


def _check_manifests(cfg, opts: K8sOptions) -> list[dict]:
    from seektrain.config.loader import config_to_toml

    docs = build_manifests(cfg, opts, config_to_toml(cfg))
    parsed = list(yaml.safe_load_all(to_yaml_documents(docs)))
    assert parsed == docs  # every value intact, as written; not one key or document more
    toml_text = parsed[0]["data"]["config.toml"]
    return [parsed, tomllib.loads(toml_text)]


@pytest.mark.parametrize("payload", PAYLOADS, ids=[repr(p) for p in PAYLOADS])
def test_k8s_manifests_carry_values_as_data(payload):
    base = cluster_config(None, ["model.preset=tiny-dense"], 2)
    for field in K8S_FIELDS:
        try:
            opts = _k8s_opts(field, payload)
            opts.check()
        except UserError as err:
            _one_line(err)
            continue
        parsed, _ = _check_manifests(base, opts)
        assert field == "env value", f"{field}={payload!r} was accepted"
        env = parsed[-1]["spec"]["template"]["spec"]["containers"][0]["env"]
        assert {"name": "NCCL_IB_HCA", "value": payload} in env
    for key in ("run.name", "data.path", "run.dir"):  # config values reach the ConfigMap's TOML
        value = f"x{payload}" if key != "run.name" else payload
        try:
            cfg = cluster_config(None, ["model.preset=tiny-dense", f"{key}={value}"], 2)
        except UserError as err:
            _one_line(err)
            continue
        _, toml_cfg = _check_manifests(cfg, K8sOptions(nodes=2, gpus_per_node=1))
        section, name = key.split(".")
        assert toml_cfg[section][name] == getattr(getattr(cfg, section), name), key  # as the pods read it


def test_k8s_names_quantities_and_host_paths_refused(tmp_path):
    for field, value in [
        ("name", "MyJob"),
        ("namespace", "Prod"),
        ("pvc", "a..b"),
        ("storage_class", "fast..ssd"),
        ("pvc_size", "0"),
        ("pvc_size", "0.0Gi"),
        ("image", "Seektrain:1"),
    ]:
        with pytest.raises(UserError) as err:
            _k8s_opts(field, value).check()
        _one_line(err.value)
    for key in ("data.path", "data.tokenizer", "model.hf_path"):
        with pytest.raises(UserError, match=key):
            cluster_config(None, [f"{key}={tmp_path}/x"], 2)
    _k8s_opts("pvc", "claims.run-1").check()  # dotted subdomains and sizes above 0 are fine
    _k8s_opts("pvc_size", "0.5Gi").check()


# ----------------------------------------------------------------------------- -o (item 7)
def _launch(kind: str, tmp: Path, *extra: str) -> list[str]:
    if kind == "slurm":
        return [
            "launch",
            "slurm",
            "--nodes",
            "1",
            "--gpus-per-node",
            "0",
            "--set",
            f"run.dir={tmp}/run",
            *extra,
        ]
    return ["launch", "k8s", "--nodes", "1", "--gpus-per-node", "1", *extra]


@pytest.mark.parametrize("kind", ["slurm", "k8s"])
def test_output_replaces_only_our_own_files(kind, tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text('[model]\npreset = "tiny-dense"\n')
    conf = ["--config", str(config)]
    out = tmp_path / "job.out"
    assert main(_launch(kind, tmp_path, *conf, "-o", str(out))) == 0
    first = out.read_text()
    assert f"# Generated by `seektrain launch {kind}`" in "\n".join(first.splitlines()[:2])
    assert main(_launch(kind, tmp_path, *conf, "-o", str(out))) == 0  # ours: regenerated in place
    notes = tmp_path / "notes.md"
    notes.write_text("keep me")
    capsys.readouterr()
    assert main(_launch(kind, tmp_path, *conf, "-o", str(notes))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--force" in err[0] and notes.read_text() == "keep me", err
    for force in ([], ["--force"]):  # the config being read: never, not even with --force
        link = tmp_path / "link.toml"
        link.unlink(missing_ok=True)
        link.symlink_to(config)
        assert main(_launch(kind, tmp_path, *conf, "-o", str(link), *force)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--config" in err[0], err
        assert config.read_text() == '[model]\npreset = "tiny-dense"\n'
    assert main(_launch(kind, tmp_path, *conf, "-o", str(notes), "--force")) == 0
    assert notes.read_text().startswith(first.splitlines()[0])
