"""The Kubernetes manifests (deploy/k8s, and the decode-ep overlay) are valid against the
API's schemas (kubernetes-validate, strict: no unknown field passes), and everything they
tell ferry exists in ferry: each container's command line, with the topology file it
mounts, parses with ferry's own parser; each environment variable is in
``engine.envs``'s registry or a Kubernetes substitution; each port, probe, Service and
ServiceMonitor port is one the process listens on, as its parsed configuration says.

kustomize is not needed: its generators (the topology ConfigMap, the Secret) and the
overlay's delete patches are applied here, as kustomize applies them."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from engine import envs
from server import serve
from server.cli import build_parser, commands, with_topology

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES = "1.33.0"  # the oldest release the manifests are for
OVERLAYS = [K8S, K8S / "decode-ep"]
# flags of the decode EP group being built (ferry worker --decode-ep N): the overlay that
# uses them is not deployable until they exist, and then this list must go
PENDING_FLAGS = {"--decode-ep", "--ep-node-rank", "--ep-leader"}
LWS_ENV = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}  # the controller's
LIBRARY_ENV = {"NCCL_NVLS_ENABLE": "read by NCCL"}
SAMPLE = {"POD_IP": "10.1.2.3", "POD_NAME": "ferry-decode-0", "LWS_WORKER_INDEX": "0",
          "LWS_LEADER_ADDRESS": "ferry-decode-ep-0.ferry"}  # fmt: skip


def build(directory: Path) -> list[dict]:
    """The resources ``kubectl apply -k directory`` would create."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    resources: list[dict] = []
    for entry in kust.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            resources += build(path)
        else:
            resources += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for gen in kust.get("configMapGenerator", []):
        data = {Path(f).name: (directory / f).read_text() for f in gen["files"]}
        resources.append({"apiVersion": "v1", "kind": "ConfigMap",
                          "metadata": {"name": gen["name"]}, "data": data})  # fmt: skip
    for gen in kust.get("secretGenerator", []):
        keys = {}
        for env in gen["envs"]:  # not in git: its example says what it holds
            for line in (directory / f"{env}.example").read_text().splitlines():
                if line and not line.startswith("#"):
                    keys[line.split("=", 1)[0]] = "a-value"
        resources.append({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                          "metadata": {"name": gen["name"]}, "stringData": keys})  # fmt: skip
    for patch in kust.get("patches", []):
        body = yaml.safe_load(patch["patch"])
        assert body.pop("$patch") == "delete"
        gone = [r for r in resources if _matches(r, patch["target"])]
        assert len(gone) == 1, patch["target"]
        resources.remove(gone[0])
    return resources


def _matches(resource: dict, target: dict) -> bool:
    return resource["kind"] == target["kind"] and resource["metadata"]["name"] == target["name"]


def pod_templates(resource: dict) -> list[dict]:
    spec = resource.get("spec", {})
    if resource["kind"] == "LeaderWorkerSet":
        lws = spec["leaderWorkerTemplate"]
        return [t for t in (lws.get("leaderTemplate"), lws["workerTemplate"]) if t]
    return [spec["template"]] if "template" in spec else []


ALL = [(d.relative_to(ROOT).as_posix(), r) for d in OVERLAYS for r in build(d)]
IDS = [f"{where}:{r['kind']}/{r['metadata']['name']}" for where, r in ALL]


@pytest.mark.parametrize("where, resource", ALL, ids=IDS)
def test_every_resource_validates_strictly(where, resource):
    if resource["kind"] in CUSTOM:
        CUSTOM[resource["kind"]](resource)
        for template in pod_templates(resource):  # what a CRD's pods are, core schema
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                          "metadata": {"name": "t"}, "template": template},
                                         KUBERNETES, strict=True)  # fmt: skip
        return
    kubernetes_validate.validate(resource, KUBERNETES, strict=True)


def _leader_worker_set(resource: dict) -> None:
    """The LeaderWorkerSet v1 fields it uses (its CRD schema is not bundled)."""
    assert resource["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = resource["spec"]
    assert set(spec) <= {"replicas", "leaderWorkerTemplate", "rolloutStrategy",
                         "startupPolicy", "networkConfig"}  # fmt: skip
    lws = spec["leaderWorkerTemplate"]
    assert set(lws) <= {"size", "restartPolicy", "leaderTemplate", "workerTemplate",
                        "subGroupPolicy"}  # fmt: skip
    assert lws["restartPolicy"] in ("RecreateGroupOnPodRestart", "None")
    assert spec["startupPolicy"] in ("LeaderCreated", "LeaderReady")
    assert isinstance(lws["size"], int) and lws["size"] >= 1


def _service_monitor(resource: dict) -> None:
    """The Prometheus Operator's ServiceMonitor v1 fields it uses."""
    assert resource["apiVersion"] == "monitoring.coreos.com/v1"
    spec = resource["spec"]
    assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scheme", "scrapeTimeout"}


CUSTOM = {"LeaderWorkerSet": _leader_worker_set, "ServiceMonitor": _service_monitor}


def _containers(resources: list[dict]) -> list[tuple[dict, dict, dict]]:
    """(resource, pod spec, container) for every ferry container."""
    return [(r, t["spec"], c) for r in resources for t in pod_templates(r)
            for c in t["spec"]["containers"] if c["image"].startswith("ferry:")]  # fmt: skip


def _command_line(resources: list[dict], resource: dict, pod: dict, container: dict,
                  tmp: Path) -> list[str]:  # fmt: skip
    """The container's ``ferry`` command line as the kubelet runs it: ``$(VAR)`` replaced
    (each one a variable the pod has), the topology file read from its ConfigMap."""
    assert not container.get("command"), "the image's entrypoint is ferry"
    declared = {e["name"] for e in container.get("env", [])}
    if resource["kind"] == "LeaderWorkerSet":
        declared |= LWS_ENV
    argv = []
    for arg in container["args"]:
        for var in re.findall(r"\$\((\w+)\)", arg):
            assert var in declared, f"$({var}) in {container['name']}'s args is not set"
            arg = arg.replace(f"$({var})", SAMPLE[var])
        argv.append(arg)
    if "--config" in argv:
        path = argv[argv.index("--config") + 1]
        argv[argv.index("--config") + 1] = str(_mounted_file(resources, pod, container, path,
                                                             tmp))  # fmt: skip
    return argv


def _mounted_file(resources: list[dict], pod: dict, container: dict, path: str,
                  tmp: Path) -> Path:  # fmt: skip
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        if path.startswith(mount["mountPath"] + "/"):
            config_map = volumes[mount["name"]]["configMap"]["name"]
            key = path[len(mount["mountPath"]) + 1 :]
            (found,) = [r for r in resources if r["kind"] == "ConfigMap"
                        and r["metadata"]["name"] == config_map]  # fmt: skip
            local = tmp / key
            local.write_text(found["data"][key])
            return local
    raise AssertionError(f"{path} is on no volume of {container['name']}")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    subs = commands(parser)
    flags = {o for p in subs.values() for o in p._option_string_actions}
    pending = [a for a in argv if a in PENDING_FLAGS]
    assert not set(pending) & flags, f"{pending} exist now: use them, empty PENDING_FLAGS"
    for flag in pending:  # drop the flag and its value
        i = argv.index(flag)
        argv = argv[:i] + argv[i + 2 :]
    args, unknown = parser.parse_known_args(with_topology(argv, subs))
    assert not unknown, f"not ferry flags: {unknown}"
    return args


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


@pytest.mark.parametrize("directory", OVERLAYS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_every_flag_env_var_and_port_exists_in_ferry(directory, tmp_path):
    resources = build(directory)
    containers = _containers(resources)
    assert {c["name"] for _, _, c in containers} >= {"frontend", "prefill", "decode"}
    for resource, pod, container in containers:
        args = _parse(_command_line(resources, resource, pod, container, tmp_path))
        for env in container.get("env", []):
            name = env["name"]
            if name.startswith("FERRY_"):
                assert name in envs.REGISTRY, f"{name} is not one of ferry's variables"
            else:
                used = any(f"$({name})" in a for a in container["args"])
                assert used or name in LIBRARY_ENV, f"{name}: ferry does not read it"
        ports = _ports(container)
        if args.command == "serve":
            config = serve.server_config(args)
            assert ports == {"http": config.port}
            assert config.host == "0.0.0.0"  # reachable from the Service
            assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
            assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
            assert pod["terminationGracePeriodSeconds"] > config.drain_timeout_s
        else:
            assert args.command == "worker" and args.role == container["name"]
            assert ports["worker"] == int(args.listen.rsplit(":", 1)[1])
            assert args.redis, "a worker in its own pod joins the frontends through Redis"
            for probe in ("startupProbe", "livenessProbe"):
                assert container[probe]["tcpSocket"]["port"] in ports
            assert serve.transfer_config(args).transport in ("tcp", "nccl")  # across pods
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            port = container.get(probe, {}).get("httpGet", {}).get("port")
            assert port is None or port in ports


def test_services_and_the_service_monitor_reach_ports_that_exist():
    resources = build(K8S)
    services = [r for r in resources if r["kind"] == "Service"]
    pods = [(t["metadata"]["labels"], c) for r in resources for t in pod_templates(r)
            for c in t["spec"]["containers"]]  # fmt: skip
    for service in services:
        selected = [c for labels, c in pods
                    if service["spec"]["selector"].items() <= labels.items()]  # fmt: skip
        assert selected, f"service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            assert all(port["targetPort"] in _ports(c) for c in selected)
    (monitor,) = [r for r in resources if r["kind"] == "ServiceMonitor"]
    (scraped,) = [s for s in services if monitor["spec"]["selector"]["matchLabels"].items()
                  <= s["metadata"]["labels"].items()]  # fmt: skip
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in scraped["spec"]["ports"]}


def test_secrets_config_maps_and_claims_that_pods_name_exist():
    for directory in OVERLAYS:
        resources = build(directory)
        named = {(r["kind"], r["metadata"]["name"]): r for r in resources}
        for resource in resources:
            for template in pod_templates(resource):
                for volume in template["spec"].get("volumes", []):
                    if "configMap" in volume:
                        assert ("ConfigMap", volume["configMap"]["name"]) in named
                    if "persistentVolumeClaim" in volume:
                        claim = volume["persistentVolumeClaim"]["claimName"]
                        assert ("PersistentVolumeClaim", claim) in named
                for container in template["spec"]["containers"]:
                    for env in container.get("env", []):
                        ref = env.get("valueFrom", {}).get("secretKeyRef")
                        if ref:
                            secret = named[("Secret", ref["name"])]
                            assert ref["key"] in secret["stringData"]


def test_the_topology_points_at_the_redis_and_the_volumes_the_manifests_have(tmp_path):
    resources = build(K8S)
    (topology,) = [r for r in resources if r["kind"] == "ConfigMap"]
    data = yaml.safe_load(topology["data"]["topology.yaml"])
    host, port = re.fullmatch(r"redis://([\w.-]+):(\d+)/\d+", data["control"]["redis"]).groups()
    (redis,) = [r for r in resources if r["kind"] == "Service" and r["metadata"]["name"] == host]
    assert int(port) in {p["port"] for p in redis["spec"]["ports"]}
    for _, _, container in _containers(resources):
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert str(Path(data["model"]["model"]).parent) in mounts
        if container["name"] != "frontend":
            assert data["tiers"]["kv-dir"] in mounts
    frontend_policy = next(r for r in resources if r["kind"] == "NetworkPolicy"
                           and r["metadata"]["name"] == "ferry-frontend")  # fmt: skip
    assert frontend_policy["spec"]["ingress"][0]["ports"] == [{"port": data["server"]["port"]}]
