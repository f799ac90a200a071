"""The names in manifests/ are the ones the pipeline's defaults use (KubernetesConfig, rangefinder.container_images).

Nothing here repeats a literal from config.py: every expected value is read from the defaults, so a rename on one
side without the other fails here instead of as a pod stuck in ContainerCreating on a cluster.
"""

from __future__ import annotations

import re
from urllib.parse import urlparse

import pytest
import yaml

from rangefinder import container_images as images
from rangefinder.config import KubernetesConfig
from tests.manifests.manifest_support import MANIFESTS, entry_points, pod_specs

K8S = KubernetesConfig()
# The entry points that hold the pipeline namespace's pieces, with the namespace MLflow must admit pods from.
PIPELINE_ENTRIES = [".", "pipeline-namespace", "overlays/kubeflow-profile"]
MLFLOW_ENTRIES = [".", "mlflow", "overlays/external-database", "overlays/kubeflow-profile"]


@pytest.fixture(autouse=True)
def _no_image_overrides(monkeypatch):
    # The manifests pin the release's default names; a developer's override must not change what is compared.
    for var in ("RANGEFINDER_IMAGE", "RANGEFINDER_CPU_IMAGE", "RANGEFINDER_MLFLOW_IMAGE", "RANGEFINDER_REGISTRY"):
        monkeypatch.delenv(var, raising=False)


def _tracking_endpoint() -> tuple[str, str, int]:
    """(service, namespace, port) of KubernetesConfig.mlflow_tracking_uri."""
    uri = urlparse(K8S.mlflow_tracking_uri)
    assert uri.hostname.endswith(".svc.cluster.local"), f"{K8S.mlflow_tracking_uri} is not an in-cluster Service name"
    service, namespace = uri.hostname.split(".")[:2]
    return service, namespace, uri.port or 80


def _pipeline_namespace(r) -> str:
    return r.find("ServiceAccount", K8S.service_account)["metadata"]["namespace"]


def _mlflow_container(r) -> dict:
    service, _, _ = _tracking_endpoint()
    return r.find("Deployment", service)["spec"]["template"]["spec"]["containers"][0]


# ---------------------------------------------------------------------------------------------------------------
# MLflow side


@pytest.mark.parametrize("entry", MLFLOW_ENTRIES)
def test_the_mlflow_service_is_the_tracking_uri(rendered, entry):
    service, namespace, port = _tracking_endpoint()
    svc = rendered[entry].find("Service", service)
    assert svc["metadata"]["namespace"] == namespace
    assert port in [p["port"] for p in svc["spec"]["ports"]]
    # ... and the Service really leads to the server's port.
    (svc_port,) = [p for p in svc["spec"]["ports"] if p["port"] == port]
    container = _mlflow_container(rendered[entry])
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named.get(svc_port["targetPort"], svc_port["targetPort"]) in named.values()
    assert f"--port={named[svc_port['targetPort']]}" in container["args"]


@pytest.mark.parametrize("entry", MLFLOW_ENTRIES)
def test_mlflow_answers_to_the_tracking_uri_host(rendered, entry):
    # MLflow compares the Host header exactly: clients send host:port, so both forms must be allowed.
    uri = urlparse(K8S.mlflow_tracking_uri)
    (flag,) = [a for a in _mlflow_container(rendered[entry])["args"] if a.startswith("--allowed-hosts=")]
    allowed = flag.split("=", 1)[1].split(",")
    assert uri.netloc in allowed and uri.hostname in allowed


@pytest.mark.parametrize("entry", MLFLOW_ENTRIES)
def test_mlflow_runs_the_released_server_image(rendered, entry):
    assert _mlflow_container(rendered[entry])["image"] == images.mlflow_server_image()


@pytest.mark.parametrize("entry", MLFLOW_ENTRIES)
def test_mlflow_serves_artifacts_from_s3(rendered, entry):
    r = rendered[entry]
    container = _mlflow_container(r)
    assert "--serve-artifacts" in container["args"]
    config = r.find("ConfigMap", container["envFrom"][0]["configMapRef"]["name"])["data"]
    assert config["MLFLOW_ARTIFACTS_DESTINATION"].startswith("s3://")
    assert "MLFLOW_S3_ENDPOINT_URL" in config
    assert "--artifacts-destination=$(MLFLOW_ARTIFACTS_DESTINATION)" in container["args"]
    # The store's keys reach the server (and only the server) from the Secret it names.
    store = r.find("Secret", container["envFrom"][1]["secretRef"]["name"])
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(store["stringData"])


@pytest.mark.parametrize("entry", MLFLOW_ENTRIES)
def test_mlflow_backend_store_comes_from_the_database_secret(rendered, entry):
    r = rendered[entry]
    env = {e["name"]: e for e in _mlflow_container(r)["env"]}
    uri = env["MLFLOW_BACKEND_STORE_URI"]
    if "valueFrom" in uri:  # external database: the whole URI is in the Secret
        ref = uri["valueFrom"]["secretKeyRef"]
        assert r.find("Secret", ref["name"])["stringData"][ref["key"]].startswith("postgresql://")
        assert not r.has("StatefulSet", "mlflow-postgres")
        return
    # Bundled database: the URI points at its Service, and both read the same Secret.
    assert uri["value"].startswith("postgresql://")
    host_port = uri["value"].split("@", 1)[1].split("/", 1)[0]
    db_service, db_port = host_port.split(":")
    svc = r.find("Service", db_service)
    assert int(db_port) in [p["port"] for p in svc["spec"]["ports"]]
    sts = r.find("StatefulSet", db_service)
    secret_names = {e["valueFrom"]["secretKeyRef"]["name"] for e in env.values() if "valueFrom" in e}
    sts_secrets = {v["secret"]["secretName"] for v in sts["spec"]["template"]["spec"]["volumes"] if "secret" in v}
    assert secret_names == sts_secrets
    assert sts["spec"]["volumeClaimTemplates"], "the database keeps its data on a PVC"


@pytest.mark.parametrize("entry", [e for e in MLFLOW_ENTRIES if e in PIPELINE_ENTRIES] + ["mlflow"])
def test_only_pipeline_pods_reach_mlflow(rendered, entry):
    r = rendered[entry]
    service, _, port = _tracking_endpoint()
    policy = r.find("NetworkPolicy", "mlflow-from-pipeline-pods")
    mlflow_labels = r.find("Deployment", service)["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= mlflow_labels.items()
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    # The step pods that log to MLflow carry KubernetesConfig.mlflow_client_labels (rangefinder.pipelines.pipeline).
    assert peer["podSelector"]["matchLabels"] == K8S.mlflow_client_labels
    # Alone, manifests/mlflow admits the namespace manifests/pipeline-namespace deploys to.
    pipeline_side = r if r.has("ServiceAccount", K8S.service_account) else rendered["pipeline-namespace"]
    expected_ns = _pipeline_namespace(pipeline_side)
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": expected_ns}
    assert [p["port"] for p in rule["ports"]] == [port]
    # Everything else is denied by the namespace's default policy.
    deny = r.find("NetworkPolicy", "default-deny-ingress")["spec"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] and not deny.get("ingress")


def test_only_mlflow_reaches_its_database(rendered):
    r = rendered["mlflow"]
    service, _, _ = _tracking_endpoint()
    policy = r.find("NetworkPolicy", "mlflow-postgres-from-mlflow")["spec"]
    db_labels = r.find("StatefulSet", "mlflow-postgres")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= db_labels.items()
    (rule,) = policy["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}, "a namespaceSelector would open the database to other namespaces"
    mlflow_labels = r.find("Deployment", service)["spec"]["template"]["metadata"]["labels"]
    assert peer["podSelector"]["matchLabels"].items() <= mlflow_labels.items()


# ---------------------------------------------------------------------------------------------------------------
# Pipeline namespace side


@pytest.mark.parametrize("entry", PIPELINE_ENTRIES)
def test_the_mlflow_secret_has_the_keys_the_steps_read(rendered, entry):
    r = rendered[entry]
    secret = r.find("Secret", K8S.mlflow_secret)
    assert secret["metadata"]["namespace"] == _pipeline_namespace(r)
    assert sorted(secret["stringData"]) == sorted(K8S.mlflow_secret_keys)
    assert secret["stringData"]["MLFLOW_TRACKING_URI"] == K8S.mlflow_tracking_uri


@pytest.mark.parametrize("entry", PIPELINE_ENTRIES)
def test_the_hf_token_secret_is_an_empty_template(rendered, entry):
    r = rendered[entry]
    secret = r.find("Secret", K8S.hf_token_secret)
    assert secret["metadata"]["namespace"] == _pipeline_namespace(r)
    assert secret["stringData"] == {K8S.hf_token_secret_key: ""}  # never a real token in the repository


@pytest.mark.parametrize("entry", PIPELINE_ENTRIES)
def test_the_data_pvc_is_there(rendered, entry):
    r = rendered[entry]
    pvc = r.find("PersistentVolumeClaim", K8S.data_pvc)
    assert pvc["metadata"]["namespace"] == _pipeline_namespace(r)
    # CPU and GPU steps on different nodes mount it at the same time.
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


@pytest.mark.parametrize("entry", PIPELINE_ENTRIES)
def test_the_runner_account_is_bound_to_its_role_only(rendered, entry):
    r = rendered[entry]
    binding = r.find("RoleBinding", K8S.service_account)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": K8S.service_account,
                                    "namespace": _pipeline_namespace(r)}]
    assert binding["roleRef"]["kind"] == "Role", "a namespaced Role, never a ClusterRole"
    role = r.find("Role", binding["roleRef"]["name"])
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"], rule
        if "secrets" in rule["resources"]:
            assert rule["verbs"] == ["get"] and rule.get("resourceNames"), "Secrets: read named ones only"
        if "configmaps" in rule["resources"]:
            assert rule.get("resourceNames"), "ConfigMaps: named ones only"
    writes = {(g, res) for rule in role["rules"] for g in rule["apiGroups"] for res in rule["resources"]
              if set(rule["verbs"]) & {"create", "update", "patch", "delete", "deletecollection"}}
    assert writes == {("argoproj.io", "workflowtaskresults")}
    assert not any(d["kind"] in ("ClusterRole", "ClusterRoleBinding") for d in r.docs)


# ---------------------------------------------------------------------------------------------------------------
# Examples


def test_gpu_check_job_is_placed_like_the_training_steps(rendered):
    r = rendered["examples/gpu-node-pool"]
    (job,) = [d for d in r.docs if d["kind"] == "Job"]
    (spec,) = pod_specs(job)
    assert spec["nodeSelector"] == K8S.node_selector
    assert spec["tolerations"] == [t.model_dump(exclude_none=True) for t in K8S.tolerations]
    (container,) = spec["containers"]
    assert container["image"] == images.trainer_image()
    assert container["resources"]["limits"][K8S.accelerator_type] == 1
    assert spec["serviceAccountName"] == K8S.service_account


def _tolerates(toleration, taint: dict) -> bool:
    """Kubernetes' rule: same key (or an empty key with Exists), Exists or equal value, same effect (or none)."""
    if toleration.effect and toleration.effect != taint["effect"]:
        return False
    if toleration.key and toleration.key != taint["key"]:
        return False
    return toleration.operator == "Exists" or toleration.value == taint.get("value")


def test_the_example_node_pool_matches_the_selector_and_tolerations():
    pool_file = MANIFESTS / "examples" / "gpu-node-pool" / "eksctl-nodegroup.yaml"
    (group,) = yaml.safe_load(pool_file.read_text())["managedNodeGroups"]
    assert K8S.node_selector.items() <= group["labels"].items()
    for taint in group["taints"]:
        assert any(_tolerates(t, taint) for t in K8S.tolerations), f"no default toleration for {taint}"
    # The autoscaler's scale-from-zero hints name the same label and taint.
    tags = group["tags"]
    for key, value in K8S.node_selector.items():
        assert tags[f"k8s.io/cluster-autoscaler/node-template/label/{key}"] == value
    for taint in group["taints"]:
        assert tags[f"k8s.io/cluster-autoscaler/node-template/taint/{taint['key']}"] == (
            f"{taint['value']}:{taint['effect']}")


def test_the_tolerates_rule_is_kubernetes_rule():
    (default,) = K8S.tolerations
    assert _tolerates(default, {"key": default.key, "value": "anything", "effect": default.effect})
    assert not _tolerates(default, {"key": "other.example/gpu", "value": "x", "effect": default.effect})
    assert not _tolerates(default, {"key": default.key, "value": "x", "effect": "NoExecute"})


def test_the_recurring_run_is_a_valid_kfp_request_for_the_runner_account():
    import kfp_server_api

    body = yaml.safe_load((MANIFESTS / "examples" / "recurring-run" / "recurring-run.yaml").read_text())
    run = kfp_server_api.ApiClient()._ApiClient__deserialize(body, "V2beta1RecurringRun")
    # Every key was understood (a misspelt one would be dropped silently by the generated model).
    assert set(body) <= set(run.openapi_types), f"keys KFP does not know: {sorted(set(body) - set(run.openapi_types))}"
    assert all(getattr(run, key) is not None for key in body), body
    assert run.service_account == K8S.service_account
    # The same cron check `rangefinder schedule` makes (six fields, seconds first, as KFP's scheduler reads them).
    from rangefinder.pipelines.client import validate_cron

    assert validate_cron(run.trigger.cron_schedule.cron) == run.trigger.cron_schedule.cron
    assert run.max_concurrency == "1" and run.no_catchup is True and run.mode == "ENABLE"
    assert run.pipeline_version_reference.pipeline_id and run.pipeline_version_reference.pipeline_version_id
    # It does what its description says: the parameters, each one of the published pipeline's, name a dataset on the
    # data volume and turn the retrain on. With none it trained the embedded shapes weekly and never retrained.
    package = next(yaml.safe_load_all((MANIFESTS.parent / "pipelines" / "rangefinder-finetune.yaml").read_text()))
    params = run.runtime_config.parameters
    assert set(params) <= set(package["root"]["inputDefinitions"]["parameters"]), sorted(params)
    assert "full-data retrain" in run.description and params.get("retrain") is True
    assert str(params.get("dataset_dir", "")).startswith(K8S.data_mount_path + "/"), params


def test_the_readme_lists_every_entry_point():
    """manifests/README.md's table is where an installer looks for what to apply: multi-node/ (the RBAC that
    `distributed.num_nodes > 1` needs, which the top README and docs/scaling.md send people to install) was missing."""
    entries = entry_points()
    # A part of another entry point (the profile overlay's own pipeline-namespace) is applied with it.
    own = {e for e in entries if not any(e.startswith(f"{o}/") for o in entries if o != ".")}
    table = (MANIFESTS / "README.md").read_text()
    listed = {e.rstrip("/") for e in re.findall(r"^\| `([^`]+)` (?:\(this folder\) )?\|", table, re.M)}
    assert sorted(own - listed) == []


# ---------------------------------------------------------------------------------------------------------------
# Training across nodes (distributed.num_nodes > 1)


def test_the_multi_node_rbac_lets_the_runner_manage_its_trainjobs_only(rendered):
    r = rendered["multi-node"]
    binding = r.find("RoleBinding", "rangefinder-trainjob-submitter")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": K8S.service_account, "namespace": "kubeflow"}]
    role = r.find("Role", binding["roleRef"]["name"])
    writes = {(g, res): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"]
              for res in rule["resources"] if set(rule["verbs"]) & {"create", "update", "patch", "delete"}}
    assert writes == {("trainer.kubeflow.org", "trainjobs"): {"create", "get", "list", "watch", "delete"}}
    cluster_role = r.find("ClusterRole", "rangefinder-trainingruntime-reader")
    assert cluster_role["rules"] == [{"apiGroups": ["trainer.kubeflow.org"], "resources": ["clustertrainingruntimes"],
                                      "verbs": ["get", "list"]}]
    cluster_binding = r.find("ClusterRoleBinding", "rangefinder-trainingruntime-reader")
    assert cluster_binding["subjects"] == binding["subjects"]
