"""Derive tests/data/kuberay_fields.json from KubeRay's CRD files (run by hand, not by pytest).

    python tests/data/derive_kuberay_fields.py CRD_DIR KUBERAY_REF > tests/data/kuberay_fields.json

CRD_DIR holds ray.io_rayclusters.yaml and ray.io_rayjobs.yaml from
ray-project/kuberay:ray-operator/config/crd/bases at KUBERAY_REF. Each table maps a dotted
property path ("a.b[].c", "m.*" for any key of a map) to its schema type. Sub-trees
the manifests here have no use for are kept as one opaque entry (their children are left out,
so a manifest that starts using them fails the lint until this is re-run with a smaller
OPAQUE set). Pod templates, the RayJob's embedded RayCluster spec and object metadata are
tables of their own, referenced by name.
"""
import json
import sys
from pathlib import Path

import yaml

# Left out below these keys (kept as a single entry each).
OPAQUE = {
    # KubeRay sub-trees
    "networkPolicy", "autoscalerOptions", "upgradeStrategy", "gcsFaultToleranceOptions",
    "historyServerOptions", "headService", "ingressOptions", "scaleStrategy", "submitterConfig",
    "deletionStrategy", "status",
    # core Kubernetes PodSpec / Container sub-trees
    "affinity", "initContainers", "ephemeralContainers", "topologySpreadConstraints",
    "resourceClaims", "dnsConfig", "os", "readinessGates", "schedulingGates", "schedulingGroup",
    "hostAliases", "livenessProbe", "readinessProbe", "startupProbe", "lifecycle",
    "securityContext", "resizePolicy", "restartPolicyRules", "volumeDevices", "envFrom",
    "valueFrom", "claims", "selector", "dataSource", "dataSourceRef",
    # volume sources other than the common ones
    "awsElasticBlockStore", "azureDisk", "azureFile", "cephfs", "cinder", "downwardAPI",
    "ephemeral", "fc", "flexVolume", "flocker", "gcePersistentDisk", "gitRepo", "glusterfs",
    "image", "iscsi", "photonPersistentDisk", "portworxVolume", "projected", "quobyte", "rbd",
    "scaleIO", "storageos", "vsphereVolume",
}
# Sub-trees replaced by a reference to another table.
REFS = {"template": "PodTemplateSpec", "submitterPodTemplate": "PodTemplateSpec",
        "rayClusterSpec": "RayClusterSpec"}


def v1_schema(path: Path) -> dict:
    crd = yaml.safe_load(path.read_text())
    (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return ver["schema"]["openAPIV3Schema"]


def type_of(s: dict) -> str:
    if s.get("x-kubernetes-int-or-string"):
        return "int-or-string"
    return s.get("type", "any")


def walk(s: dict, prefix: str, out: dict, required: dict) -> None:
    """Record every property path below schema `s` (and the required keys of each object)."""
    if s.get("type") == "array" and "items" in s:
        out[prefix + "[]"] = type_of(s["items"])
        walk(s["items"], prefix + "[]", out, required)
        return
    if s.get("required"):
        required[prefix] = sorted(s["required"])
    for key, sub in (s.get("properties") or {}).items():
        if key == "status" and prefix == "":
            continue  # written by the operator, never by a manifest
        path = f"{prefix}.{key}" if prefix else key
        if key in REFS and "properties" in sub:
            out[path] = REFS[key]
            continue
        t = type_of(sub)
        out[path] = t
        # Only object/array sub-trees are opaque (`image` is a volume source but also a
        # container's image string).
        if key in OPAQUE and t in ("object", "array"):
            continue
        walk(sub, path, out, required)
    extra = s.get("additionalProperties")
    if isinstance(extra, dict):
        out[f"{prefix}.*" if prefix else "*"] = type_of(extra)


def table(s: dict) -> tuple[dict, dict]:
    out: dict = {}
    required: dict = {}
    walk(s, "", out, required)
    return dict(sorted(out.items())), dict(sorted(required.items()))


def main() -> None:
    crd_dir, ref = Path(sys.argv[1]), sys.argv[2]
    rc = v1_schema(crd_dir / "ray.io_rayclusters.yaml")
    rj = v1_schema(crd_dir / "ray.io_rayjobs.yaml")
    rc_spec, rj_spec = rc["properties"]["spec"], rj["properties"]["spec"]

    cluster_spec = table(rc_spec)
    assert table(rj_spec["properties"]["rayClusterSpec"]) == cluster_spec, \
        "RayJob.spec.rayClusterSpec differs from RayCluster.spec"
    job = table(rj)
    job[0]["metadata"] = "ObjectMeta"  # the CRDs leave top-level metadata untyped

    head_tpl = rc_spec["properties"]["headGroupSpec"]["properties"]["template"]
    worker_tpl = rc_spec["properties"]["workerGroupSpecs"]["items"]["properties"]["template"]
    pod = table(head_tpl)
    assert table(worker_tpl) == pod, "head and worker pod templates differ"
    assert table(rj_spec["properties"]["submitterPodTemplate"]) == pod, "submitter template differs"

    volume = head_tpl["properties"]["spec"]["properties"]["volumes"]["items"]["properties"]
    claim_spec = table(volume["ephemeral"]["properties"]["volumeClaimTemplate"]["properties"]["spec"])
    pvc = ({"apiVersion": "string", "kind": "string", "metadata": "ObjectMeta", "spec": "object",
            **{f"spec.{k}": v for k, v in claim_spec[0].items()}},
           {f"spec.{k}" if k else "spec": v for k, v in claim_spec[1].items()})

    tables = {
        "RayCluster": ({"apiVersion": "string", "kind": "string", "metadata": "ObjectMeta",
                        "spec": "RayClusterSpec"}, {"": ["spec"]}),
        "RayJob": job,
        "RayClusterSpec": cluster_spec,
        "PodTemplateSpec": pod,
        "PersistentVolumeClaim": pvc,
        "ObjectMeta": table(head_tpl["properties"]["metadata"]),
    }
    doc = {
        "_source": (
            f"Derived by tests/data/derive_kuberay_fields.py from ray-project/kuberay {ref}: "
            "ray-operator/config/crd/bases/ray.io_rayclusters.yaml and ray.io_rayjobs.yaml "
            "(apiVersion ray.io/v1). PodTemplateSpec is the core Kubernetes pod template those "
            "CRDs embed; PersistentVolumeClaim.spec is the PersistentVolumeClaimSpec they embed "
            "under volumes[].ephemeral.volumeClaimTemplate; ObjectMeta is the metadata subset "
            "they embed for pod templates (their own top-level metadata is untyped)."
        ),
        "_format": (
            "paths: dotted property path -> schema type, 'a[]' = items of array a, 'm.*' = "
            "any key of map m; a type naming another table continues the path there. "
            "required: object path -> keys it must have. Keys listed in _opaque are kept "
            "without their children."
        ),
        "_opaque": sorted(OPAQUE),
    }
    for name, (paths, required) in tables.items():
        doc[name] = {"paths": paths, "required": required}
    json.dump(doc, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
