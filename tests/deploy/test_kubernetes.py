"""The Kubernetes manifests in deploy/kubernetes/, without a cluster: the RayJob against KubeRay's own
CRD schema (../shared/kuberay), the core resources (Secret, Service, PersistentVolumeClaim, Job, and
the pod templates inside the RayJob) against Kubernetes' own JSON schemas as shipped offline by the
kubernetes-validate package, both strictly (an unknown field is an error, as with
``kubectl apply --validate=strict``); the commands they run against the ones docs/kubernetes.md
gives, and those commands' settings against the stages' own configs; what each pod template mounts
(the shared Hugging Face cache, the runs volume, a sized /dev/shm) against what its containers use;
the models the init containers download against the ones the stages load; the image reference
against the Dockerfile and the documented build."""

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
DOCS = REPO / "docs" / "kubernetes.md"
KUBERNETES_VERSION = "1.33"  # the oldest version still supported upstream when this was written
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # KubeRay's CRD is 1 MB of YAML


def documents(name: str) -> list[dict]:
    return [d for d in yaml.load_all((MANIFESTS / name).read_text(), Loader=LOADER) if d]


def every_document() -> list[dict]:
    return [d for f in sorted(MANIFESTS.glob("*.yaml")) for d in documents(f.name)]


def claims() -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in every_document() if d["kind"] == "PersistentVolumeClaim"}


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
    assert kinds == ["Job", "PersistentVolumeClaim", "PersistentVolumeClaim", "PodTemplate", "PodTemplate", "Secret",
                     "Service"]
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
    """The commands in the ``bash`` blocks of one section of docs/kubernetes.md, each as its
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
    """The stage's settings (Hydra's own, ``hydra.*``, left out: they are checked with the volumes)."""
    return [a for a in command[command.index(module) + 1:] if not a.startswith("hydra.")]


def stage1_config():
    from hydra import compose, initialize_config_dir

    import stages.score_teacher as stage

    overrides = stage_overrides(shlex.split(one("RayJob")["spec"]["entrypoint"]), "stages.score_teacher")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return stage.job_config(compose(config_name="score_teacher", overrides=overrides))


def stage2_config():
    from hydra import compose, initialize_config_dir

    import stages.train_student as stage

    (container,) = one("Job")["spec"]["template"]["spec"]["containers"]
    overrides = stage_overrides(container["command"] + container.get("args", []), "stages.train_student")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return stage.job_config(compose(config_name="train_student", overrides=overrides))


def test_the_rayjob_runs_the_documented_stage1_command_and_its_settings_are_valid():
    entrypoint = shlex.split(one("RayJob")["spec"]["entrypoint"])
    assert entrypoint == documented("Stage 1: a RayJob", ["python", "-m", "stages.score_teacher"])
    assert "ray=cluster" in stage_overrides(entrypoint, "stages.score_teacher")
    job = stage1_config()
    assert job.output_dir.startswith("s3://") and job.ray.address == "auto"


def test_the_job_runs_the_documented_torchrun_command_and_its_settings_are_valid():
    (container,) = one("Job")["spec"]["template"]["spec"]["containers"]
    command = container["command"] + container.get("args", [])
    assert command == documented("Stage 2: an indexed Job", ["torchrun"])
    job = stage2_config()
    assert all(str(f).startswith("s3://") for f in job.data.folders)
    assert str(job.output_dir).startswith("/runs/") and str(job.data.cache_dir).startswith("/runs/")


def flag(command: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in command if a.startswith(f"{name}=")]
    return value


def test_the_pieces_of_stage2_fit_together():
    """Rendezvous name, node count, GPUs, the shared volume and the Secret agree across resources."""
    job, service, secret = one("Job"), one("Service"), one("Secret")
    claim = claims()["vocagno-runs"]
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
    (runs,) = [v for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == "vocagno-runs"]
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
        for container in template["spec"]["containers"] + template["spec"].get("initContainers", []):
            assert {"secretRef": {"name": secret["metadata"]["name"]}} in container["envFrom"]
            assert not {e["name"] for e in container.get("env", [])} & set(secret["stringData"])
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_MAX_ATTEMPTS", "VOCAGNO_SERVER_KEY"} <= set(secret["stringData"])
    assert all(v.startswith("<") or not v or v.isdigit() or v == "us-east-1"
               for v in secret["stringData"].values()), "the Secret in the repository holds placeholders only"


# ---------------------------------------------------------------------------------------------
# What each pod mounts, what it downloads, what it runs


HF_CACHE, RUNS = "vocagno-hf-cache", "vocagno-runs"
IMAGE_GID = 100  # the Ray image's user ray is in group users (100); the Dockerfile gives /app to ray:users


def pod_templates() -> dict[str, dict]:
    """Every pod template of the manifests, by role: the Ray head, each Ray worker group, the trainer."""
    cluster = one("RayJob")["spec"]["rayClusterSpec"]
    found = {"ray-head": cluster["headGroupSpec"]["template"]}
    found |= {f"ray-worker-{g['groupName']}": g["template"] for g in cluster["workerGroupSpecs"]}
    found["trainer"] = one("Job")["spec"]["template"]
    return found


def quantity(value) -> float:
    """A Kubernetes quantity (``64Gi``, ``16G``, ``500M``, ``4``) in bytes (or units)."""
    number, suffix = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value)).groups()
    scale = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    return float(number) * scale[suffix]


def under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def command_paths(role: str, container: dict) -> list[str]:
    """The absolute paths a container's stage writes, from its command's settings (the RayJob's
    entrypoint for the Ray head): the roots of its outputs, its caches and Hydra's log folder."""
    if role == "ray-head" and container["name"] == "ray-head":
        args = shlex.split(one("RayJob")["spec"]["entrypoint"])
    else:
        args = container.get("command", []) + container.get("args", [])
    keys = ("output_root", "scored_root", "student_root", "data.cache_dir", "artifacts_dir", "hydra.run.dir")
    return [a.split("=", 1)[1] for a in args if a.split("=", 1)[0] in keys and a.split("=", 1)[1].startswith("/")]


def mount_problems(role: str, template: dict) -> list[str]:
    """What a pod template fails to mount: a mount of a volume it does not declare, a volume no
    container mounts, a claim no manifest defines, HF_HOME or a path the stage writes that is not on
    its shared volume, /dev/shm not a sized memory volume (for Ray's object store, data-loader workers
    and NCCL), ephemeral storage not sized."""
    spec = template["spec"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    problems = [] if len(volumes) == len(spec.get("volumes", [])) else [f"{role}: a volume name declared twice"]
    defined = claims()
    containers = spec["containers"] + spec.get("initContainers", [])
    mounted = set()

    def volume_at(container: dict, path: str) -> dict | None:
        found = [m for m in container.get("volumeMounts", []) if under(path, m["mountPath"])]
        return volumes.get(max(found, key=lambda m: len(m["mountPath"]))["name"]) if found else None

    for container in containers:
        where = f"{role}/{container['name']}"
        for m in container.get("volumeMounts", []):
            mounted.add(m["name"])
            if m["name"] not in volumes:
                problems.append(f"{where}: mounts {m['name']!r} at {m['mountPath']}, which the pod does not declare")
        resources = container.get("resources", {})
        if not all("ephemeral-storage" in resources.get(k, {}) for k in ("requests", "limits")):
            problems.append(f"{where}: ephemeral-storage not requested and limited")
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        if "HF_HOME" not in env:
            problems.append(f"{where}: no HF_HOME")
        elif (v := volume_at(container, env["HF_HOME"])) is None or v.get("persistentVolumeClaim", {}).get(
                "claimName") != HF_CACHE:
            problems.append(f"{where}: HF_HOME={env['HF_HOME']} is not on the {HF_CACHE} volume")
        for path in command_paths(role, container):
            if (v := volume_at(container, path)) is None or v.get("persistentVolumeClaim", {}).get("claimName") != RUNS:
                problems.append(f"{where}: {path} is not on the {RUNS} volume")
    for name in sorted(set(volumes) - mounted):
        problems.append(f"{role}: volume {name!r} is declared but no container mounts it")
    for name, volume in volumes.items():
        claim = volume.get("persistentVolumeClaim", {}).get("claimName")
        if claim is not None and claim not in defined:
            problems.append(f"{role}: volume {name!r} names claim {claim!r}, which no manifest defines")
        if claim is not None and spec.get("securityContext", {}).get("fsGroup") != IMAGE_GID:
            problems.append(f"{role}: volume {name!r} is not made writable by the image's group (fsGroup {IMAGE_GID})")
    for container in spec["containers"]:
        where = f"{role}/{container['name']}"
        shm = volume_at(container, "/dev/shm")
        if shm is None or not any(m["mountPath"] == "/dev/shm" for m in container.get("volumeMounts", [])):
            problems.append(f"{where}: nothing mounted at /dev/shm (a container's own is 64 MB)")
        elif shm.get("emptyDir", {}).get("medium") != "Memory" or "sizeLimit" not in shm["emptyDir"]:
            problems.append(f"{where}: /dev/shm is not an emptyDir of medium Memory with a sizeLimit")
        elif quantity(shm["emptyDir"]["sizeLimit"]) >= quantity(container["resources"]["limits"]["memory"]):
            problems.append(f"{where}: /dev/shm's sizeLimit is not below the memory limit it counts against")
    return problems


def test_every_pod_template_mounts_what_it_needs():
    templates = pod_templates()
    assert sorted(templates) == ["ray-head", "ray-worker-gpu", "trainer"]
    for role, template in templates.items():
        assert mount_problems(role, template) == []
    for name, claim in claims().items():
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"], f"{name}: every pod, on any node, mounts it"
    # what each role needs, besides what its settings name: the cache everywhere, /runs where logs
    # and runs are written, /dev/shm for every Ray node and trainer
    mounts = {role: {m["mountPath"] for c in t["spec"]["containers"] for m in c.get("volumeMounts", [])}
              for role, t in templates.items()}
    assert mounts == {"ray-head": {"/hf", "/runs", "/dev/shm"}, "ray-worker-gpu": {"/hf", "/dev/shm"},
                      "trainer": {"/hf", "/runs", "/dev/shm"}}


@pytest.mark.parametrize("role", ["ray-head", "ray-worker-gpu", "trainer"])
def test_the_mount_check_catches_a_missing_or_wrong_mount(role):
    """The check can fail: each planted mistake in a pod template is named."""
    template = pod_templates()[role]

    def planted(change) -> list[str]:
        bad = copy.deepcopy(template)
        change(bad["spec"])
        return mount_problems(role, bad)

    def drop_mount(path, init_too=False):
        def change(spec):
            for c in spec["containers"] + (spec.get("initContainers", []) if init_too else []):
                c["volumeMounts"] = [m for m in c["volumeMounts"] if m["mountPath"] != path]
        return change

    assert any("/dev/shm" in p for p in planted(drop_mount("/dev/shm")))
    assert any("HF_HOME" in p for p in planted(drop_mount("/hf")))
    assert any("declared but no container mounts it" in p for p in planted(drop_mount("/hf", init_too=True)))
    if "initContainers" in template["spec"]:  # the download into the cache, too
        def drop_init_mount(spec):
            spec["initContainers"][0]["volumeMounts"] = []
        assert any("HF_HOME" in p and "download" in p for p in planted(drop_init_mount))
    if role != "ray-worker-gpu":
        assert any("is not on the vocagno-runs volume" in p for p in planted(drop_mount("/runs")))

    def rename(spec):
        spec["containers"][0]["volumeMounts"][0]["name"] = "hf-cahce"
    assert any("which the pod does not declare" in p for p in planted(rename))

    def no_fs_group(spec):
        spec.pop("securityContext")
    assert any("fsGroup" in p for p in planted(no_fs_group))

    def disk_shm(spec):
        for v in spec["volumes"]:
            if v["name"] == "shm":
                v["emptyDir"].pop("medium")
    assert any("medium Memory" in p for p in planted(disk_shm))

    def no_disk_size(spec):
        for c in spec["containers"]:
            c["resources"]["limits"].pop("ephemeral-storage")
    assert any("ephemeral-storage" in p for p in planted(no_disk_size))


def test_the_ray_object_store_fits_in_its_shm_volume():
    cluster = one("RayJob")["spec"]["rayClusterSpec"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        spec = group["template"]["spec"]
        (shm,) = [v for v in spec["volumes"] if v["name"] == "shm"]
        store = int(group["rayStartParams"]["object-store-memory"])
        assert store < quantity(shm["emptyDir"]["sizeLimit"])  # else Ray falls back to disk for it


def hf_download(init: dict) -> list[str]:
    command = init["command"]
    if command[:2] == ["sh", "-c"]:
        command = shlex.split(command[2].split("exec ", 1)[1])
    assert command[:2] == ["hf", "download"]
    return command


def test_the_init_containers_download_the_models_the_stages_load_into_the_shared_cache():
    """The head's init container downloads the entrypoint's teacher, pod 0's the experiment's student,
    each into the cache the stage then reads (a different model would be downloaded by every pod)."""
    head = pod_templates()["ray-head"]["spec"]
    (init,) = head["initContainers"]
    teacher = stage1_config().teacher
    command = hf_download(init)
    assert command[2] == teacher.model and flag_value(command, "--revision") == (teacher.revision or "main")

    trainer = pod_templates()["trainer"]["spec"]
    (init,) = trainer["initContainers"]
    student = stage2_config().student
    command = hf_download(init)
    assert command[2] == student.model and flag_value(command, "--revision") == (student.revision or "main")
    assert init["command"][2].startswith('[ "$NODE_RANK" != 0 ] ||'), "only pod 0 downloads"
    (rank,) = [e for e in init["env"] if e["name"] == "NODE_RANK"]
    assert rank["valueFrom"]["fieldRef"]["fieldPath"].endswith("['batch.kubernetes.io/job-completion-index']")
    for spec in (head, trainer):
        homes = {e["value"] for c in spec["containers"] + spec["initContainers"] for e in c["env"] if e["name"] == "HF_HOME"}
        assert len(homes) == 1


def flag_value(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_stage2_is_offline_and_every_variable_its_command_names_is_set():
    (container,) = one("Job")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_HUB_OFFLINE"]["value"] == "1"
    # Kubernetes leaves $(NAME) as it is when NAME is not in the container's env
    for name in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(container["command"])):
        assert name in env, f"$({name}) in the command is not set"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # NCCL: the transport is logged, and what to set per cluster is named in the manifest and the docs
    assert env["NCCL_DEBUG"]["value"] == "INFO" and "NET" in env["NCCL_DEBUG_SUBSYS"]["value"]
    manifest, docs = (MANIFESTS / "train-student.yaml").read_text(), DOCS.read_text()
    for name in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"):
        assert name in manifest and name in docs


def test_retries_and_deadlines():
    """Stage 2: a disruption (eviction, preemption, a drained node) is not counted against
    backoffLimit; the deadline bounds the whole Job. Stage 1: retries on a new cluster."""
    job = one("Job")["spec"]
    assert job["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy requires it
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in job["podFailurePolicy"]["rules"]
    assert job["activeDeadlineSeconds"] > 7 * 24 * 3600 and job["backoffLimit"] >= 1
    rayjob = one("RayJob")["spec"]
    assert rayjob["backoffLimit"] >= 1 and rayjob["activeDeadlineSeconds"] >= 24 * 3600


def test_every_pod_runs_one_pushed_image_built_from_the_dockerfile():
    images = set()
    for template in pod_templates().values():
        for c in template["spec"]["containers"] + template["spec"].get("initContainers", []):
            images.add(c["image"])
    (image,) = images
    registry, _, rest = image.partition("/")
    assert "." in registry or ":" in registry, f"{image}: no registry host"
    name, _, tag = rest.rpartition(":")
    assert name and tag and tag != "latest", f"{image}: a tag of its own, not latest"
    dockerfile = (MANIFESTS / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM rayproject/ray:([0-9.]+)-", dockerfile, re.M)
    assert base == one("RayJob")["spec"]["rayClusterSpec"]["rayVersion"]
    import tomllib
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "trackers" in extras and re.search(r'pip install .*-e "\.\[trackers\]"', dockerfile)
    # the build context: everything the Dockerfile copies is let through its ignore file
    ignore = (MANIFESTS / "Dockerfile.dockerignore").read_text().splitlines()
    copied = [src for line in re.findall(r"^COPY (?:--\S+ )*(.*)$", dockerfile, re.M) for src in line.split()[:-1]]
    assert copied and all(f"!{src}" in ignore for src in copied)
    build = documented("Build, apply, watch", ["docker", "build"])
    build, push = build[:build.index("&&")], build[build.index("&&") + 1:]
    assert flag_value(build, "-f") == "deploy/kubernetes/Dockerfile" and build[-1] == "."  # from the repository root
    assert push == ["docker", "push", flag_value(build, "-t")]
    # the documented apply puts the pushed reference in place of the manifests' placeholder
    applied = [c for c in doc_commands("Build, apply, watch") if c[0] == "sed"]
    assert applied and all(c[1] == f"s|{image}|{flag_value(build, '-t')}|" for c in applied)
