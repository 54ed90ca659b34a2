"""The Kubernetes manifests of deploy/kubernetes (docs/kubernetes.md "Install"): every object valid against
the Kubernetes OpenAPI schemas that kubernetes-validate ships (strict: an unknown field fails), the snapshot
objects against the external-snapshotter's CRDs and the KubeVirt example against KubeVirt's OpenAPI document
(both copied by scripts/csi-toolchain from their Go modules), and
consistent with `vbs csi` itself: the driver's name, the StorageClass parameters it accepts, the socket
paths, the csi-node profile's directory, the sidecars' published RBAC, and no secret in any file."""

from __future__ import annotations

import copy
import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

import vbs
from vbs.connectors.local_path import STATE_SUBDIR
from vbs.csi import proto
from vbs.csi.identity import DRIVER_NAME, IdentityService
from vbs.csi.requests import PARAMETERS, SECRET_ACCESS_KEY, SECRET_KEY_ID, SIDECAR_PREFIX, TOPOLOGY_KEY, create_fields

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
REFS = ROOT / ".tools" / "kubernetes"
# The oldest Kubernetes release the manifests are meant for, and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.31", kubernetes_validate.latest_version())
SIDECAR_REGISTRY = "registry.k8s.io/sig-storage/"


def manifest_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml")


def objects(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def all_objects() -> list[dict[str, Any]]:
    return [obj for path in manifest_files() if path.parent == DEPLOY for obj in objects(path)]


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in all_objects() if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the served version's openAPIV3Schema, from the CRDs scripts/csi-toolchain copied."""
    files = sorted((REFS / "crd").glob("*.yaml"))
    assert files, f"no CRDs in {REFS / 'crd'}: run `make setup` (scripts/csi-toolchain)"
    schemas = {}
    for path in files:
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version["served"]:
                schemas[(f"{group}/{version['name']}", kind)] = closed(version["schema"]["openAPIV3Schema"])
    return schemas


def closed(schema: Any) -> Any:
    """An OpenAPI schema in which an object with listed properties refuses any other (as the API server's
    strict field validation does), unless it preserves unknown fields or names additionalProperties."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed(value) for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def kubevirt_schema(kind: str) -> dict[str, Any]:
    """KubeVirt's OpenAPI (swagger 2.0) definition of ``kind`` of kubevirt.io/v1, closed as crd_schemas'."""
    path = REFS / "kubevirt" / "swagger.json"
    assert path.exists(), f"{path} missing: run `make setup` (scripts/csi-toolchain)"
    definitions = json.loads(path.read_text())["definitions"]
    return {"$ref": f"#/definitions/v1.{kind}", "definitions": closed(definitions)}


def validate(obj: dict[str, Any], crds: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Raise unless ``obj`` is valid for every release in K8S_VERSIONS (built-in kinds), its CRD, or
    KubeVirt's OpenAPI document."""
    if obj["apiVersion"] == "kubevirt.io/v1":
        jsonschema.Draft4Validator(kubevirt_schema(obj["kind"])).validate(obj)
        return
    crd = crds.get((obj["apiVersion"], obj["kind"]))
    if crd is not None:
        jsonschema.Draft202012Validator(crd).validate(obj)
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]},
                                     K8S_VERSIONS[-1], strict=True)  # its metadata, as ObjectMeta
        return
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


# --- schema validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_object_is_valid_against_its_schema(path: Path) -> None:
    crds = crd_schemas()
    found = objects(path)
    assert found
    for obj in found:
        validate(obj, crds)


def test_the_validators_refuse_what_the_api_server_would() -> None:
    """The checks above can fail: a misspelt field, a wrong type and a value outside a CRD's enum do, in
    built-in kinds, in the snapshot CRDs' and in KubeVirt's."""
    crds = crd_schemas()
    node = one("DaemonSet")
    typo = copy.deepcopy(node)
    typo["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["mountPropagaton"] = "Bidirectional"
    wrong_type = copy.deepcopy(one("Deployment"))
    wrong_type["spec"]["replicas"] = "one"
    snapshot_class = copy.deepcopy(one("VolumeSnapshotClass"))
    snapshot_class["deletionPolicy"] = "Keep"
    unknown = copy.deepcopy(one("VolumeSnapshotClass"))
    unknown["parameter"] = {"x": "y"}
    for bad in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            validate(bad, crds)
    vm = [o for o in objects(DEPLOY / "examples" / "kubevirt-vm.yaml") if o["kind"] == "VirtualMachine"][0]
    vm_typo = copy.deepcopy(vm)
    vm_typo["spec"]["template"]["spec"]["domain"]["devices"]["disks"][1]["seriall"] = "vbs-data"
    vm_type = copy.deepcopy(vm)
    vm_type["spec"]["template"]["spec"]["domain"]["cpu"]["cores"] = "one"
    for bad in (snapshot_class, unknown, vm_typo, vm_type):
        with pytest.raises(jsonschema.ValidationError):
            validate(bad, crds)


def test_kubevirt_example_uses_a_vbs_block_volume_without_a_datavolume() -> None:
    found = objects(DEPLOY / "examples" / "kubevirt-vm.yaml")
    assert {o["kind"] for o in found} == {"PersistentVolumeClaim", "VirtualMachine"}
    pvc = [o for o in found if o["kind"] == "PersistentVolumeClaim"][0]
    vm = [o for o in found if o["kind"] == "VirtualMachine"][0]
    assert pvc["spec"]["volumeMode"] == "Block"
    provisioners = {o["metadata"]["name"]: o["provisioner"] for o in all_objects() if o["kind"] == "StorageClass"}
    assert provisioners[pvc["spec"]["storageClassName"]] == DRIVER_NAME
    assert "dataVolumeTemplates" not in vm["spec"]
    volumes = vm["spec"]["template"]["spec"]["volumes"]
    assert not any("dataVolume" in v for v in volumes)
    claims = [v for v in volumes if v.get("persistentVolumeClaim", {}).get("claimName") == pvc["metadata"]["name"]]
    assert len(claims) == 1
    disks = vm["spec"]["template"]["spec"]["domain"]["devices"]["disks"]
    assert [d["disk"]["bus"] for d in disks if d["name"] == claims[0]["name"]] == ["virtio"]


def test_kustomization_applies_every_manifest_once() -> None:
    listed = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"]
    present = sorted(p.name for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == present
    assert listed[0] == "namespace.yaml"  # everything else lives in it


# --- consistency with `vbs csi` ------------------------------------------------------------------------


def test_csidriver_is_the_driver_getplugininfo_names() -> None:
    info = IdentityService(controller=True, ready=lambda: True).GetPluginInfo(proto.pb().GetPluginInfoRequest(),
                                                                              None)
    assert info.name == DRIVER_NAME
    driver = one("CSIDriver")
    assert driver["metadata"]["name"] == info.name
    assert driver["spec"]["attachRequired"] is True  # ControllerPublishVolume attaches (docs/kubernetes.md)
    for sc in (o for o in all_objects() if o["kind"] == "StorageClass"):
        assert sc["provisioner"] == info.name
    assert one("VolumeSnapshotClass")["driver"] == info.name


def test_storageclass_parameters_are_the_drivers() -> None:
    classes = {o["metadata"]["name"]: o for o in all_objects() if o["kind"] == "StorageClass"}
    assert {"vbs-gp3", "vbs-io2", "vbs-gp3-encrypted"} <= set(classes)
    types = {}
    for name, sc in classes.items():
        params = sc.get("parameters", {})
        assert all(isinstance(v, str) for v in params.values()), name
        unknown = {k for k in params if k not in PARAMETERS and not k.startswith(SIDECAR_PREFIX)}
        assert not unknown, f"{name}: vbs csi refuses {unknown}"
        fields = create_fields(params)  # the driver's own check of the values
        types[name] = fields
        assert sc["volumeBindingMode"] == "WaitForFirstConsumer"  # the zone follows the pod's node
    assert types["vbs-gp3"]["volume_type"] == "gp3"
    assert types["vbs-io2"]["volume_type"] == "io2" and types["vbs-io2"]["iops"] > 0
    assert types["vbs-gp3-encrypted"]["encrypted"] is True
    defaults = [n for n, sc in classes.items()
                if sc["metadata"].get("annotations", {}).get("storageclass.kubernetes.io/is-default-class") == "true"]
    assert defaults == ["vbs-gp3"]


def test_snapshot_class_has_no_parameters_and_the_snapshotter_adds_none() -> None:
    """The driver refuses a CreateSnapshot with parameters (vbs.csi.controller_snapshots)."""
    assert "parameters" not in one("VolumeSnapshotClass")
    assert "--extra-create-metadata" not in args_of(container(pod_spec(one("Deployment")), "csi-snapshotter"))


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [c for c in spec["containers"] if c["name"] == name]
    assert len(found) == 1, name
    return found[0]


def args_of(c: dict[str, Any]) -> list[str]:
    return list(c.get("args", []))


def flag(c: dict[str, Any], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args_of(c) if a.startswith(f"--{name}=")]
    assert len(values) == 1, f"{c['name']}: --{name}= once, got {values}"
    return values[0]


def mount_source(spec: dict[str, Any], c: dict[str, Any], path: str) -> tuple[str, dict[str, Any]]:
    """The volume (name, definition) that ``c`` mounts at the directory holding ``path`` (or at ``path``)."""
    for m in c.get("volumeMounts", []):
        mp = m["mountPath"].rstrip("/")
        if path == mp or path.startswith(mp + "/"):
            vol = [v for v in spec["volumes"] if v["name"] == m["name"]]
            assert len(vol) == 1
            return m["name"], vol[0]
    raise AssertionError(f"{c['name']} mounts nothing holding {path}")


def driver_socket(spec: dict[str, Any]) -> str:
    endpoint = flag(container(spec, "vbs-csi"), "endpoint")
    assert endpoint.startswith("unix:///")
    return endpoint.removeprefix("unix://")


@pytest.mark.parametrize("kind", ["Deployment", "DaemonSet"])
def test_every_sidecar_reaches_the_drivers_socket(kind: str) -> None:
    spec = pod_spec(one(kind))
    socket = driver_socket(spec)
    volume, _ = mount_source(spec, container(spec, "vbs-csi"), socket)
    sidecars = [c for c in spec["containers"] if c["name"] != "vbs-csi"]
    assert sidecars
    for c in sidecars:
        assert flag(c, "csi-address") == socket, c["name"]
        assert mount_source(spec, c, socket)[0] == volume, c["name"]
    probe_port = int(flag(container(spec, "liveness-probe"), "health-port"))
    driver = container(spec, "vbs-csi")
    assert [p["containerPort"] for p in driver["ports"] if p["name"] == "healthz"] == [probe_port]
    assert driver["livenessProbe"]["httpGet"]["port"] == "healthz"


def test_controller_runs_the_standard_sidecars_pinned() -> None:
    spec = pod_spec(one("Deployment"))
    images = {c["name"]: c["image"] for c in spec["containers"]}
    expected = {"csi-provisioner", "csi-attacher", "csi-snapshotter", "csi-resizer", "liveness-probe"}
    assert set(images) == expected | {"vbs-csi"}
    for name in expected:
        assert re.fullmatch(re.escape(SIDECAR_REGISTRY) + r"[a-z-]+:v\d+\.\d+\.\d+", images[name]), images[name]
    for name in expected - {"liveness-probe"}:
        assert "--leader-election" in args_of(container(spec, name)), name
    assert "--extra-create-metadata" in args_of(container(spec, "csi-provisioner"))
    # Every sidecar waits longer than the driver does for VBS (its --wait), so the driver answers first.
    wait = float(flag(container(spec, "vbs-csi"), "wait"))
    for name in expected - {"liveness-probe"}:
        assert float(flag(container(spec, name), "timeout").removesuffix("s")) > wait, name


def test_node_plugin_registers_its_socket_with_the_kubelet() -> None:
    spec = pod_spec(one("DaemonSet"))
    socket = driver_socket(spec)
    _, plugin_dir = mount_source(spec, container(spec, "vbs-csi"), socket)
    host_dir = plugin_dir["hostPath"]["path"]
    assert host_dir == f"/var/lib/kubelet/plugins/{DRIVER_NAME}"
    registrar = container(spec, "node-driver-registrar")
    assert registrar["image"].startswith(SIDECAR_REGISTRY + "csi-node-driver-registrar:v")
    assert flag(registrar, "kubelet-registration-path") == f"{host_dir}/{Path(socket).name}"
    _, registration = mount_source(spec, registrar, "/registration")
    assert registration["hostPath"]["path"] == "/var/lib/kubelet/plugins_registry"


def test_node_plugin_has_what_the_node_service_needs() -> None:
    """Root and privileged (loop devices, mounts), the kubelet's directory with Bidirectional propagation,
    /dev, and the csi-node profile's disk directory with the host agent's FUSE files behind its links."""
    daemonset = one("DaemonSet")
    spec = pod_spec(daemonset)
    node = container(spec, "vbs-csi")
    assert node["securityContext"]["privileged"] is True and node["securityContext"]["runAsUser"] == 0
    mounts = {m["mountPath"]: m for m in node["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}

    def host_path(mount_path: str) -> str:
        path: str = volumes[mounts[mount_path]["name"]]["hostPath"]["path"]
        return path

    assert mounts["/var/lib/kubelet"]["mountPropagation"] == "Bidirectional"
    assert host_path("/var/lib/kubelet") == "/var/lib/kubelet"
    assert host_path("/dev") == "/dev"
    profile = tomllib.loads((Path(vbs.__file__).parent / "profiles" / "hypervisor" / "csi-node.toml").read_text())
    disk_dir = flag(node, "disk-dir")
    assert disk_dir == profile["settings"]["dir"] and host_path(disk_dir) == disk_dir
    assert profile["settings"]["node_vm"] == "csi-node"  # vbs csi's --node-vm default, not overridden
    assert not any(a.startswith("--node-vm") for a in args_of(node))
    # The host agent's FUSE files, at the paths the links name: its state_dir (docs/install.md's) + theirs.
    local_paths = f"/var/lib/vbs/host/{STATE_SUBDIR}"
    assert mounts[local_paths]["mountPropagation"] == "HostToContainer"
    assert host_path(local_paths) == local_paths
    # The node id is the Kubernetes node's name; the zone is the one its nodeSelector picks.
    assert flag(node, "node-id") == "$(NODE_NAME)"
    assert [e["valueFrom"]["fieldRef"]["fieldPath"] for e in node["env"] if e["name"] == "NODE_NAME"] == \
        ["spec.nodeName"]
    zone = flag(node, "zone")
    assert spec["nodeSelector"][TOPOLOGY_KEY] == zone
    assert daemonset["metadata"]["name"].endswith(zone)
    assert not any(a.startswith("--controller-url") for a in args_of(node))  # the Node service only


def rules_bound_to(account: str, namespace: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(cluster-wide rules, rules in ``namespace``) that the manifests grant the ServiceAccount."""
    objs = all_objects()

    def bound(kind: str) -> set[str]:
        return {b["roleRef"]["name"] for b in objs if b["kind"] == kind
                and {"kind": "ServiceAccount", "name": account, "namespace": namespace} in b["subjects"]}

    cluster = [r for o in objs if o["kind"] == "ClusterRole" and o["metadata"]["name"] in bound("ClusterRoleBinding")
               for r in o["rules"]]
    local = [r for o in objs if o["kind"] == "Role" and o["metadata"]["namespace"] == namespace
             and o["metadata"]["name"] in bound("RoleBinding") for r in o["rules"]]
    return cluster, local


def grants(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)


def test_controller_account_has_every_permission_the_sidecars_publish() -> None:
    """Each sidecar's RBAC as its release publishes it (copied by scripts/csi-toolchain for the very image
    tag the Deployment runs): every rule of its ClusterRole granted cluster-wide, of its Role in the
    driver's namespace."""
    deployment = one("Deployment")
    spec = pod_spec(deployment)
    cluster, local = rules_bound_to(spec["serviceAccountName"], deployment["metadata"]["namespace"])
    assert one("ServiceAccount", spec["serviceAccountName"])
    checked = 0
    for c in spec["containers"]:
        if c["name"] in ("vbs-csi", "liveness-probe"):
            continue
        image, tag = c["image"].removeprefix(SIDECAR_REGISTRY).split(":")
        ref = REFS / "rbac" / f"{image}-{tag}.yaml"
        assert ref.exists(), f"{ref} missing: the toolchain pins another {image} (run `make setup`)"
        for obj in objects(ref):
            if obj["kind"] not in ("ClusterRole", "Role"):
                continue
            have = cluster if obj["kind"] == "ClusterRole" else local
            for rule in obj["rules"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        for verb in rule["verbs"]:
                            assert grants(have, group, resource, verb), (image, obj["kind"], group, resource, verb)
                            checked += 1
    assert checked > 50


def test_node_account_has_no_role_and_no_token() -> None:
    spec = pod_spec(one("DaemonSet"))
    assert spec["automountServiceAccountToken"] is False
    assert rules_bound_to(spec["serviceAccountName"], "vbs-csi") == ([], [])


# --- no secret in the manifests ------------------------------------------------------------------------


def walk(value: Any) -> Iterator[Any]:
    yield value
    if isinstance(value, dict):
        for item in value.values():
            yield from walk(item)
    elif isinstance(value, list):
        for item in value:
            yield from walk(item)


def test_no_secret_in_any_manifest() -> None:
    """The key is a Secret made with kubectl and mounted as a file: no Secret object, no key material, no
    secret in an environment variable or an argument."""
    for path in manifest_files():
        text = path.read_text()
        assert not re.search(r"aws_(secret_)?access_key(_id)?\s*[=:]", text), path
        assert not re.search(r"\bVBSK[A-Z0-9]{16}\b", text), path  # vbs.trust.credentials.generate's ids
        for obj in objects(path):
            assert obj["kind"] != "Secret", path
            for node in walk(obj):
                if isinstance(node, dict):
                    assert "secretKeyRef" not in node, path  # a secret in the environment
                if isinstance(node, str) and node.startswith("--"):
                    assert not re.search(r"secret|password|token", node.split("=")[0]), (path, node)


def test_the_per_namespace_key_example_names_one_secret_for_every_call_and_may_read_only_that() -> None:
    """examples/tenant-keys.yaml: each controller call of its class's volumes carries the Secret vbs-csi-key of the
    PVC's (or VolumeSnapshot's) namespace; the sidecars may get that Secret name and nothing else."""
    found = objects(DEPLOY / "examples" / "tenant-keys.yaml")
    sc = [o for o in found if o["kind"] == "StorageClass"][0]
    params = sc["parameters"]
    create_fields(params)  # the driver takes the class (the secret keys are the sidecars')
    for call in ("provisioner", "controller-publish", "controller-expand"):
        assert params[f"{SIDECAR_PREFIX}{call}-secret-name"] == "vbs-csi-key"
        assert params[f"{SIDECAR_PREFIX}{call}-secret-namespace"] == "${pvc.namespace}"
    snapshots = [o for o in found if o["kind"] == "VolumeSnapshotClass"][0]
    assert snapshots["driver"] == DRIVER_NAME
    assert snapshots["parameters"] == {f"{SIDECAR_PREFIX}snapshotter-secret-name": "vbs-csi-key",
                                       f"{SIDECAR_PREFIX}snapshotter-secret-namespace": "${volumesnapshot.namespace}"}
    role = [o for o in found if o["kind"] == "ClusterRole"][0]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["vbs-csi-key"],
                              "verbs": ["get"]}]
    binding = [o for o in found if o["kind"] == "ClusterRoleBinding"][0]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod_spec(one("Deployment"))["serviceAccountName"],
                                    "namespace": "vbs-csi"}]
    text = (DEPLOY / "examples" / "tenant-keys.yaml").read_text()
    assert f"{SECRET_KEY_ID}=" in text and f"{SECRET_ACCESS_KEY}=" in text  # the keys the driver reads


def test_the_key_is_the_secret_mounted_as_a_file() -> None:
    spec = pod_spec(one("Deployment"))
    driver = container(spec, "vbs-csi")
    credentials = flag(driver, "credentials-file")
    _, volume = mount_source(spec, driver, credentials)
    assert volume["secret"]["secretName"] == "vbs-csi-credentials"
    assert [i["path"] for i in volume["secret"]["items"]] == [Path(credentials).name]
    assert volume["secret"]["defaultMode"] & 0o007 == 0  # not world-readable
    for c in spec["containers"]:  # only the driver sees it
        if c is not driver:
            assert all(m["name"] != "credentials" for m in c.get("volumeMounts", [])), c["name"]
    assert spec["securityContext"]["runAsNonRoot"] is True  # the Controller service needs no root
