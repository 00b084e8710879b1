"""The Kubernetes manifests in deploy/kubernetes/, without a cluster: the RayJob against KubeRay's own
CRD schema (../shared/kuberay), the core resources (Secret, Service, PersistentVolumeClaim, Job, and
the pod templates inside the RayJob) against Kubernetes' own JSON schemas as shipped offline by the
kubernetes-validate package, both strictly (an unknown field is an error, as with
``kubectl apply --validate=strict``); the commands they run against the ones docs/running-at-scale.md
gives, and those commands' settings against the stages' own configs."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "deploy" / "kubernetes"
KUBERAY = REPO.parent / "shared" / "kuberay"
DOCS = REPO / "docs" / "running-at-scale.md"
KUBERNETES_VERSION = "1.33"  # the oldest version still supported upstream when this was written
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # KubeRay's CRD is 1 MB of YAML


def documents(name: str) -> list[dict]:
    return [d for d in yaml.load_all((MANIFESTS / name).read_text(), Loader=LOADER) if d]


def every_document() -> list[dict]:
    return [d for f in sorted(MANIFESTS.glob("*.yaml")) for d in documents(f.name)]


def one(kind: str) -> dict:
    found = [d for d in every_document() if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} resources in {MANIFESTS}"
    return found[0]


# ---------------------------------------------------------------------------------------------
# KubeRay's CRD schema


def strict_schema(node):
    """KubeRay's OpenAPI schema as JSON Schema: ``x-kubernetes-int-or-string`` as integer or string,
    and every object with listed properties closed to others (the API server's strict field
    validation), except where the CRD keeps unknown fields."""
    if isinstance(node, list):
        return [strict_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict_schema(v) for k, v in node.items()}
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


@pytest.fixture(scope="module")
def rayjob_validator():
    jsonschema = pytest.importorskip("jsonschema")
    crd_file = KUBERAY / "ray.io_rayjobs.yaml"
    if not crd_file.is_file():
        pytest.skip(f"KubeRay's CRDs not found at {KUBERAY}")
    crd = yaml.load(crd_file.read_text(), Loader=LOADER)
    assert crd["spec"]["group"] == "ray.io" and crd["spec"]["names"]["kind"] == "RayJob"
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict_schema(version["schema"]["openAPIV3Schema"])
    return jsonschema.Draft202012Validator(schema)


def crd_errors(validator, resource: dict) -> list[str]:
    return sorted(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(resource))


def test_the_rayjob_meets_kuberays_schema(rayjob_validator):
    job = one("RayJob")
    assert job["apiVersion"] == "ray.io/v1"  # apiVersion, kind and metadata are Kubernetes' own checks
    assert DNS_LABEL.match(job["metadata"]["name"]) and len(job["metadata"]["name"]) <= 63
    assert crd_errors(rayjob_validator, job) == []
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["activeDeadlineSeconds"] > 0 and spec["backoffLimit"] >= 1
    workers = spec["rayClusterSpec"]["workerGroupSpecs"]
    assert [int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) > 0
            for g in workers] == [True]


def test_kuberays_schema_catches_what_the_api_server_would_refuse(rayjob_validator):
    """The check can fail: a misspelt field, a string where a number belongs, a bad enum value."""
    job = one("RayJob")
    misspelt = copy.deepcopy(job)
    misspelt["spec"]["shutdownAfterJobFinish"] = misspelt["spec"].pop("shutdownAfterJobFinishes")
    assert any("shutdownAfterJobFinish" in e for e in crd_errors(rayjob_validator, misspelt))
    wrong_type = copy.deepcopy(job)
    wrong_type["spec"]["backoffLimit"] = "two"
    assert any(e.startswith("spec.backoffLimit:") for e in crd_errors(rayjob_validator, wrong_type))
    deep = copy.deepcopy(job)  # inside a pod template of the cluster
    deep["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["envfrom"] = []
    assert any("envfrom" in e for e in crd_errors(rayjob_validator, deep))
    quantity = copy.deepcopy(job)  # int-or-string accepts both, nothing else
    quantity["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"][
        "limits"]["cpu"] = 4
    assert crd_errors(rayjob_validator, quantity) == []
    quantity["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"][
        "limits"]["cpu"] = [4]
    assert crd_errors(rayjob_validator, quantity) != []


# ---------------------------------------------------------------------------------------------
# Kubernetes' own schemas


@pytest.fixture(scope="module")
def kubernetes_validate():
    return pytest.importorskip("kubernetes_validate", reason="pip install -e '.[kubernetes]' (Kubernetes' schemas)")


def core_resources() -> list[dict]:
    """Every core resource of the manifests, and each pod template inside the RayJob as a PodTemplate."""
    found = [d for d in every_document() if d["kind"] != "RayJob"]
    cluster = one("RayJob")["spec"]["rayClusterSpec"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    found += [{"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"group-{i}"}, "template": g["template"]}
              for i, g in enumerate(groups)]
    return found


def test_the_core_resources_meet_kubernetes_schemas(kubernetes_validate):
    kinds = sorted(d["kind"] for d in core_resources())
    assert kinds == ["Job", "PersistentVolumeClaim", "PodTemplate", "PodTemplate", "Secret", "Service"]
    for resource in core_resources():
        assert DNS_LABEL.match(resource["metadata"]["name"])
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)  # raises on a problem


def test_kubernetes_schemas_catch_what_the_api_server_would_refuse(kubernetes_validate):
    from kubernetes_validate.utils import ValidationError

    job = one("Job")
    bad = copy.deepcopy(job)
    bad["spec"]["completionMode"] = 2
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)
    bad = copy.deepcopy(job)
    bad["spec"]["template"]["spec"]["containers"][0]["comand"] = ["torchrun"]
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


# ---------------------------------------------------------------------------------------------
# The commands


def doc_commands(section: str) -> list[list[str]]:
    """The commands in the ``bash`` blocks of one section of docs/running-at-scale.md, each as its
    arguments (continuation lines joined, comments dropped)."""
    text = DOCS.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    body = text[start:end if end > 0 else None]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", body, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #", 1)[0].strip()
            if line and not line.startswith("#"):
                commands.append(shlex.split(line))
    return commands


def documented(section: str, head: list[str]) -> list[str]:
    found = [c for c in doc_commands(section) if c[: len(head)] == head]
    assert len(found) == 1, f"{len(found)} commands starting {' '.join(head)} in the '{section}' section"
    return found[0]


def stage_overrides(command: list[str], module: str) -> list[str]:
    return command[command.index(module) + 1:]


def test_the_rayjob_runs_the_documented_stage1_command_and_its_settings_are_valid():
    from hydra import compose, initialize_config_dir

    import stages.score_teacher as stage

    entrypoint = shlex.split(one("RayJob")["spec"]["entrypoint"])
    assert entrypoint == documented("On Kubernetes", ["python", "-m", "stages.score_teacher"])
    overrides = stage_overrides(entrypoint, "stages.score_teacher")
    assert "ray=cluster" in overrides
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        job = stage.job_config(compose(config_name="score_teacher", overrides=overrides))
    assert job.output_dir.startswith("s3://") and job.ray.address == "auto"


def test_the_job_runs_the_documented_torchrun_command_and_its_settings_are_valid():
    from hydra import compose, initialize_config_dir

    import stages.train_student as stage

    (container,) = one("Job")["spec"]["template"]["spec"]["containers"]
    command = container["command"] + container.get("args", [])
    assert command == documented("On Kubernetes", ["torchrun"])
    overrides = stage_overrides(command, "stages.train_student")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        job = stage.job_config(compose(config_name="train_student", overrides=overrides))
    assert all(str(f).startswith("s3://") for f in job.data.folders)
    assert str(job.output_dir).startswith("/runs/")


def flag(command: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in command if a.startswith(f"{name}=")]
    return value


def test_the_pieces_of_stage2_fit_together():
    """Rendezvous name, node count, GPUs, the shared volume and the Secret agree across resources."""
    job, service, claim, secret = one("Job"), one("Service"), one("PersistentVolumeClaim"), one("Secret")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = container["command"]
    nodes = int(flag(command, "--nnodes"))
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == nodes >= 2
    assert int(flag(command, "--nproc_per_node")) == int(container["resources"]["limits"]["nvidia.com/gpu"])
    # pod i of an indexed Job is <job>-<i>; with subdomain = the headless Service, <job>-0.<service> resolves
    host, port = flag(command, "--rdzv-endpoint").split(":")
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert pod["subdomain"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert [p["port"] for p in service["spec"]["ports"]] == [int(port)]
    assert flag(command, "--node_rank") == "$(NODE_RANK)"
    (rank,) = [e for e in container["env"] if e["name"] == "NODE_RANK"]
    assert rank["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    # the run folder is on the shared volume
    (runs,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert runs["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == runs["name"]]
    assert flag(command, "student_root").startswith(mount["mountPath"] + "/")
    assert "AWS_SECRET_ACCESS_KEY" in secret["stringData"]


def test_every_pod_takes_its_credentials_from_the_secret_and_no_manifest_holds_one():
    secret = one("Secret")
    cluster = one("RayJob")["spec"]["rayClusterSpec"]
    templates = [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"]),
                 one("Job")["spec"]["template"]]
    for template in templates:
        for container in template["spec"]["containers"]:
            assert {"secretRef": {"name": secret["metadata"]["name"]}} in container["envFrom"]
            assert not {e["name"] for e in container.get("env", [])} & set(secret["stringData"])
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_MAX_ATTEMPTS", "VOCAGNO_SERVER_KEY"} <= set(secret["stringData"])
    assert all(v.startswith("<") or not v or v.isdigit() or v == "us-east-1"
               for v in secret["stringData"].values()), "the Secret in the repository holds placeholders only"
