"""Where a module's tests are: in the file named after it, else in the files `MAP` lists.

The rule. Within a tier (`tests/unit/`, `tests/http/`, `tests/engine/`), the tests of `pkg/sub/mod.py` are in
`test_mod.py`, or in `test_sub_mod.py` where several modules are named `mod` (`testbed/adapters.py`:
`test_testbed_adapters.py`); an `__init__.py` or `__main__.py` that holds code is named as its package
(`trainer_client/__init__.py`: `test_trainer_client.py`), and a file may be named after a package as a whole
(`tests/engine/test_replicas.py`). A name is used once across the tiers (pytest imports the files by name), so
the module's own tests in one tier may leave the tests of another named after their behaviour
(`tests/unit/test_lineage_rules.py` beside `tests/engine/test_lineage.py`), as are the tests of behaviour that
spans several modules: `MAP` lists these files under each module they test. A file whose subject is no module
(the docs, the deployment, the package as users install it) is in `OTHER`.

Checked here:
- every module of the packages has a test file named after it, or `MAP` lists the files that test it;
- each file `MAP` lists exists and reaches its module: it imports the module, or a module that imports it
  (the import graph of the packages and of tests/support, as scripts/check_layers.py reads it), or runs it
  (`RUNS`);
- every test file is named after a module or a package, or is listed in `MAP` or `OTHER`: a file named after a
  module that is gone, or after a name several modules share, fails here.
"""

from __future__ import annotations

import ast
import functools
from pathlib import PurePosixPath

from support.modules import ROOT, package_modules, script

PACKAGES = ("gateway", "rollout_store", "training_data", "trainer_client", "testbed")
"""The shipped packages, and what the tests, the benchmarks and the demo run on."""
TIERS = ("tests/unit", "tests/http", "tests/engine")

U, H, E = "tests/unit/", "tests/http/", "tests/engine/"

MAP: dict[str, tuple[str, ...]] = {
    "gateway/__main__.py": (E + "test_shutdown.py", E + "test_cli.py"),
    "gateway/access_log.py": (H + "test_access_log.py",),
    "gateway/admin/context.py": (H + "test_pause_cache.py", H + "test_facts.py"),
    "gateway/admin/protocol.py": (H + "test_pause_cache.py", H + "test_requests.py"),
    "gateway/admin/router.py": (H + "test_pause_cache.py", H + "test_requests.py", E + "test_admin.py"),
    "gateway/admin/service.py": (H + "test_pause_cache.py", H + "test_facts.py", E + "test_admin.py"),
    "gateway/anthropic/protocol.py": (H + "test_messages_dialect.py", H + "test_bounds.py"),
    "gateway/anthropic/router.py": (H + "test_messages_dialect.py", E + "test_messages.py"),
    "gateway/anthropic/translate.py": (H + "test_messages_dialect.py", E + "test_messages.py"),
    "gateway/anthropic/wire.py": (U + "test_wires.py", H + "test_messages_dialect.py"),
    "gateway/app.py": (H + "test_cli_backend_warning.py", H + "test_agent_path.py", E + "test_trust.py"),
    "gateway/auth.py": (H + "test_requests.py", H + "test_viewer_data.py", E + "test_trust.py"),
    "gateway/cli.py": (
        U + "test_cli_errors.py",
        U + "test_cli_help.py",
        U + "test_config_file.py",
        E + "test_cli.py",
    ),
    "gateway/control/context.py": (H + "test_requests.py", H + "test_group_sizes.py"),
    "gateway/control/protocol.py": (U + "test_turn_rows.py", H + "test_requests.py", H + "test_bounds.py"),
    "gateway/control/router.py": (
        H + "test_requests.py",
        H + "test_group_sizes.py",
        E + "test_control_api.py",
    ),
    "gateway/encoding.py": (H + "test_requests.py", H + "test_bounds.py"),
    "gateway/errors.py": (U + "test_capture_rules.py", H + "test_requests.py", H + "test_agent_path.py"),
    "gateway/fleet/adapters.py": (H + "test_lora_policies.py", E + "test_fleet_lora.py"),
    "gateway/fleet/collector.py": (
        U + "test_prefixes.py",
        U + "test_metrics.py",
        H + "test_metrics_per_host.py",
    ),
    "gateway/fleet/engine.py": (
        H + "test_engine.py",
        H + "test_http1_fuzzed.py",
        H + "test_backend_return.py",
        E + "test_overload.py",
    ),
    "gateway/fleet/fleet.py": (U + "test_routing.py", H + "test_group_placement.py"),
    "gateway/fleet/health.py": (U + "test_routing.py", H + "test_backend_return.py", H + "test_run_state.py"),
    "gateway/fleet/http1.py": (H + "test_http1.py", H + "test_http1_fuzzed.py"),
    "gateway/fleet/kv_events.py": (U + "test_prefixes.py", E + "test_fleet.py"),
    "gateway/fleet/placement.py": (U + "test_routing.py", H + "test_group_placement.py", E + "test_fleet.py"),
    "gateway/fleet/replies.py": (H + "test_agent_path.py", H + "test_engine.py"),
    "gateway/fleet/servers.py": (U + "test_routing.py", U + "test_metrics.py"),
    "gateway/fleet/weight_versions.py": (H + "test_run_state.py", E + "test_admin.py"),
    "gateway/ids.py": (H + "test_requests.py",),
    "gateway/metrics.py": (H + "test_metrics_per_host.py", E + "test_operator_metrics.py"),
    "gateway/openai/protocol.py": (
        H + "test_requests.py",
        H + "test_bounds.py",
        H + "test_integer_fields.py",
    ),
    "gateway/openai/router.py": (
        H + "test_agent_path.py",
        H + "test_token_routes.py",
        H + "test_completions_lineage.py",
        E + "test_token_client_routes.py",
    ),
    "gateway/openapi.py": (E + "test_contract.py",),
    "gateway/replicas/adapters.py": (H + "test_lora_policies.py", E + "test_fleet_lora.py"),
    "gateway/replicas/apply.py": (H + "test_run_state.py",),
    "gateway/replicas/expiry.py": (U + "test_idle_rollouts.py", H + "test_rollout_expiry.py"),
    "gateway/replicas/facts.py": (U + "test_metrics.py", H + "test_metrics_per_host.py"),
    "gateway/replicas/publish.py": (H + "test_run_state.py", H + "test_lora_policies.py"),
    "gateway/replicas/replica.py": (H + "test_run_state.py", H + "test_metrics_per_host.py"),
    "gateway/replicas/shared.py": (
        H + "test_metrics_per_host.py",
        H + "test_readiness.py",
        E + "test_replica_fleet.py",
        E + "test_replicas.py",
    ),
    "gateway/responses/items.py": (U + "test_wires.py", H + "test_responses_dialect.py"),
    "gateway/responses/protocol.py": (H + "test_responses_dialect.py", H + "test_bounds.py"),
    "gateway/responses/router.py": (H + "test_responses_dialect.py", E + "test_responses.py"),
    "gateway/responses/translate.py": (U + "test_wires.py", H + "test_responses_dialect.py"),
    "gateway/responses/wire.py": (U + "test_wires.py", H + "test_responses_dialect.py"),
    "gateway/settings.py": (U + "test_config_file.py", U + "test_cli_help.py"),
    "gateway/store/backlog.py": (U + "test_metrics.py", H + "test_facts.py"),
    "gateway/store/caches.py": (U + "test_idle_rollouts.py", U + "test_agent_created_rollouts.py"),
    "gateway/store/expiry.py": (U + "test_idle_rollouts.py", H + "test_rollout_expiry.py"),
    "gateway/store/lineage.py": (U + "test_lineage_rules.py", H + "test_completions_lineage.py"),
    "gateway/store/operations.py": (U + "test_agent_created_rollouts.py", U + "test_store_locks.py"),
    "gateway/store/pins.py": (U + "test_routing.py", U + "test_idle_rollouts.py"),
    "gateway/store/processes.py": (H + "test_metrics_per_host.py", E + "test_workers.py"),
    "gateway/store/reads.py": (H + "test_agent_path.py", H + "test_completions_lineage.py"),
    "gateway/store/records.py": (U + "test_capture_rules.py", U + "test_turn_rows.py"),
    "gateway/store/store.py": (
        U + "test_agent_created_rollouts.py",
        U + "test_idle_rollouts.py",
        U + "test_store_locks.py",
    ),
    "gateway/store/versions.py": (H + "test_training_data_versions.py",),
    "gateway/store/writer.py": (
        U + "test_store_locks.py",
        U + "test_agent_created_rollouts.py",
        E + "test_concurrency.py",
        E + "test_durability.py",
    ),
    "gateway/turns/adapters.py": (H + "test_lora_policies.py", E + "test_fleet_lora.py"),
    "gateway/turns/admission.py": (
        H + "test_agent_created_groups.py",
        H + "test_agent_path.py",
        E + "test_limits.py",
        E + "test_trust.py",
    ),
    "gateway/turns/capture.py": (
        U + "test_capture_rules.py",
        U + "test_reply_bytes.py",
        E + "test_choices.py",
        E + "test_tools_multiturn.py",
        H + "test_weight_spans.py",
        E + "test_token_versions.py",
    ),
    "gateway/turns/context.py": (H + "test_agent_path.py",),
    "gateway/turns/exact.py": (E + "test_exact_mode.py",),
    "gateway/turns/forward.py": (H + "test_agent_path.py", H + "test_exact.py"),
    "gateway/turns/intake.py": (H + "test_requests.py", H + "test_bounds.py", H + "test_integer_fields.py"),
    "gateway/turns/recording.py": (
        H + "test_agent_path.py",
        E + "test_durability.py",
        E + "test_shutdown.py",
    ),
    "gateway/turns/relay.py": (H + "test_agent_path.py", E + "test_durability.py"),
    "gateway/turns/sampling.py": (H + "test_sampling_requests.py",),
    "gateway/turns/splice.py": (E + "test_templates.py",),
    "gateway/turns/traffic.py": (H + "test_run_state.py", H + "test_readiness.py"),
    "gateway/turns/upstream.py": (H + "test_agent_path.py", H + "test_token_routes.py"),
    "gateway/turns/wire.py": (U + "test_wires.py",),
    "gateway/telemetry.py": (H + "test_trace_context.py",),
    "gateway/ui/context.py": (H + "test_viewer_data.py",),
    "gateway/ui/queries.py": (H + "test_viewer_data.py", H + "test_trainer_reads.py", E + "test_viewer.py"),
    "gateway/ui/router.py": (H + "test_viewer_data.py", E + "test_viewer.py"),
    "gateway/ui/token_texts.py": (H + "test_viewer_data.py",),
    "gateway/workers/supervisor.py": (E + "test_workers.py",),
    "rollout_store/database.py": (
        U + "test_migrations.py",
        U + "test_store_locks.py",
        H + "test_readiness.py",
    ),
    "rollout_store/delta.py": (U + "test_lineage_rules.py",),
    "rollout_store/schema.py": (U + "test_migrations.py", U + "test_turn_rows.py"),
    "rollout_store/status.py": (U + "test_config_file.py", H + "test_agent_path.py"),
    "rollout_store/tokens.py": (U + "test_lineage_rules.py", U + "test_turn_rows.py"),
    "testbed/built.py": (U + "test_testbed_adapters.py",),
    "testbed/demo/train.py": (E + "test_training.py",),
    "testbed/families.py": (E + "test_templates.py",),
    "testbed/launcher.py": (E + "test_durability.py", E + "test_shutdown.py", E + "test_replica_fleet.py"),
    "testbed/process.py": (H + "test_readiness.py", E + "test_install.py"),
    "testbed/tiny_model.py": (E + "test_exact_mode.py", E + "test_local_render.py"),
    "testbed/vllm_server.py": (E + "test_fleet.py", E + "test_templates.py"),
    "trainer_client/claims.py": (H + "test_group_sizes.py", H + "test_trainer_reads.py"),
    "trainer_client/cli.py": (
        U + "test_cli_errors.py",
        U + "test_cli_pipes.py",
        U + "test_imports.py",
        H + "test_cli_export.py",
        H + "test_tree_samples.py",
        E + "test_cli.py",
    ),
    "trainer_client/client.py": (
        H + "test_trainer_reads.py",
        H + "test_tree_samples.py",
        H + "test_group_sizes.py",
    ),
    "trainer_client/hf.py": (E + "test_trainer_client.py", E + "test_teacher.py"),
    "trainer_client/reference/loop.py": (E + "test_training.py",),
    "trainer_client/reference/runner.py": (E + "test_training.py", E + "test_trl.py"),
    "trainer_client/reference/task.py": (E + "test_training.py",),
    "trainer_client/reference/toy_task.py": (E + "test_training.py", E + "test_trl.py"),
    "trainer_client/reference/trainer.py": (
        U + "test_loss.py",
        E + "test_training.py",
        E + "test_lora_training.py",
    ),
    "trainer_client/scoring.py": (U + "test_teacher_layouts.py", E + "test_teacher.py"),
    "trainer_client/stats.py": (
        U + "test_cli_pipes.py",
        H + "test_rollout_expiry.py",
        H + "test_group_sizes.py",
    ),
    "trainer_client/sync.py": (E + "test_admin.py", E + "test_fleet_lora.py", E + "test_tied_weights.py"),
    "trainer_client/trl.py": (U + "test_trl_rollout_samples.py", E + "test_tied_weights.py"),
    "trainer_client/verl.py": (U + "test_verl_layout.py",),
    "training_data/evaluation.py": (E + "test_trl.py", E + "test_training.py"),
    "training_data/loading.py": (
        H + "test_trainer_reads.py",
        H + "test_tree_samples.py",
        E + "test_retries.py",
    ),
    "training_data/samples.py": (H + "test_tree_samples.py", E + "test_rollout_trees.py"),
    "training_data/teacher_scores.py": (U + "test_teacher_layouts.py", E + "test_teacher.py"),
}
"""Module -> the test files that test it, beside the one named after it: every module no file is named after,
and the files named after a behaviour that tests it."""

OTHER: dict[str, str] = {
    U + "test_architecture_page.py": "docs/design/architecture.md names every module",
    U + "test_deploy.py": "deploy/: the Kubernetes and Compose manifests",
    U + "test_docs.py": "README.md and docs/: their code blocks and the generated references",
    U + "test_layers.py": "scripts/check_layers.py",
    U + "test_migrations.py": "migrations/, shipped as rollout_store.migrations",
    U + "test_test_map.py": "this map",
    E + "test_clients.py": "LangChain and LiteLLM through the gateway",
    E + "test_examples.py": "examples/",
    E + "test_harnesses.py": "Claude Code and Codex CLI through the gateway (requirements/npm/)",
    E + "test_healthcheck.py": "the Dockerfile's HEALTHCHECK",
    E + "test_install.py": "the sdist and the wheel (setup.py, pyproject.toml) as users install them",
    E + "test_quickstart.py": "README.md's quickstart",
    E + "test_sql_docs.py": "the docs' SQL",
    E + "test_verifiers.py": "a verifiers environment through the gateway (requirements/verifiers.txt)",
}
"""Test file -> its subject, which is no module of the packages."""

RUNS: dict[str, tuple[str, ...]] = {
    "gw": ("gateway.app",),
    "start": ("gateway.app",),
    "inprocess": ("gateway.app",),
    "gateway": ("gateway.__main__",),
    "start_gateway": ("gateway.__main__",),
    "testbed.launcher": ("gateway.__main__",),
    U + "test_imports.py": ("trainer_client.cli", "trainer_client"),
    E + "test_cli.py": ("gateway.__main__", "trainer_client.cli"),
    E + "test_lora_training.py": ("trainer_client.reference.trainer",),
}
"""What runs the gateway or a command line without importing it: the fixtures (`gw` and `start` build
`create_app` in process, tests/http/conftest.py; `inprocess` in a TestClient; `gateway` and `start_gateway`
serve it as `gateway serve` does, tests/conftest.py), `GatewayProcess` (`python -m gateway`), and the files
that start a process of their own (`python -m`, `python -c`) or run an example (examples/lora_grpo.py)."""

check = script("check_layers")
KNOWN = check.modules(ROOT, PACKAGES) | check.modules(ROOT / "tests", ["support"])
GRAPH = {name: check.imported(name, path, KNOWN) | set(RUNS.get(name, ())) for name, path in KNOWN.items()}
"""The packages' and tests/support's modules -> those each imports, or runs."""


def module_names(path: str) -> tuple[str, ...]:
    """The names a test file takes after a module or a package: `mod` and `sub_mod` (an `__init__.py` or
    `__main__.py`, or a package's directory, as its package)."""
    parts = PurePosixPath(path).with_suffix("").parts
    if parts[-1] in ("__init__", "__main__"):
        parts = parts[:-1]
    return (parts[-1], *([f"{parts[-2]}_{parts[-1]}"] if len(parts) > 1 else []))


MODULES = package_modules(PACKAGES)
NAMED = {
    name: [m for m in MODULES if name in module_names(m)]
    for module in MODULES
    for name in module_names(module)
}
"""Each name a test file may take -> the modules of that name: a name several modules share names none."""
PACKAGE_NAMES = {
    name
    for package in PACKAGES
    for directory in [ROOT / package, *(ROOT / package).rglob("*")]
    if (directory / "__init__.py").exists()
    for name in module_names(str(directory.relative_to(ROOT)))
}
TEST_FILES = sorted(str(path.relative_to(ROOT)) for tier in TIERS for path in (ROOT / tier).glob("test_*.py"))


def name_of(test_file: str) -> str:
    return PurePosixPath(test_file).stem.removeprefix("test_")


def named_after(module: str) -> list[str]:
    """The test files named after the module, by a name no other module takes."""
    names = {name for name in module_names(module) if NAMED[name] == [module]}
    return [test_file for test_file in TEST_FILES if name_of(test_file) in names]


@functools.cache
def reached(test_file: str) -> set[str]:
    """The modules a test file imports or runs, and all that they import or run in turn."""
    names = {test_file}
    for node in ast.walk(ast.parse((ROOT / test_file).read_text(), test_file)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names |= {argument.arg for argument in node.args.args}  # the fixtures it asks for
    todo = [*(names & KNOWN.keys()), *(module for name in names for module in RUNS.get(name, ()))]
    seen: set[str] = set()
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(GRAPH.get(module, ()))
    return seen


def dotted(module: str) -> str:
    parts = PurePosixPath(module).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_a_module_is_named_as_mod_or_sub_mod_and_an_init_or_main_as_its_package():
    assert [module_names(path) for path in ("gateway/fleet/leaders.py", "trainer_client/__init__.py")] == [
        ("leaders", "fleet_leaders"),
        ("trainer_client",),
    ]
    assert module_names("testbed/demo/__main__.py") == ("demo", "testbed_demo")
    assert NAMED["adapters"] == [
        "gateway/fleet/adapters.py",
        "gateway/replicas/adapters.py",
        "gateway/turns/adapters.py",
        "testbed/adapters.py",
    ]


def test_every_module_has_a_test_file_named_after_it_or_listed_in_the_map():
    missing = [module for module in MODULES if not named_after(module) and module not in MAP]
    assert not missing, "\n".join(
        f"{module}: no test file is named {' or '.join(f'test_{n}.py' for n in module_names(module))}: "
        "name its tests so, or list the files that test it in MAP"
        for module in missing
    )


def test_the_map_names_only_modules_of_the_packages():
    assert sorted(set(MAP) - set(MODULES)) == []


def test_each_file_the_map_lists_exists_and_reaches_its_module():
    problems = []
    for module, test_files in MAP.items():
        for test_file in test_files:
            if not (ROOT / test_file).exists():
                problems.append(f"{module}: {test_file} does not exist")
            elif dotted(module) not in reached(test_file):
                problems.append(f"{module}: {test_file} neither imports it nor runs it (RUNS)")
    assert not problems, "\n".join(problems)


def test_every_test_file_is_named_after_a_module_or_a_package_or_listed():
    listed = {*(f for files in MAP.values() for f in files), *OTHER}
    problems = []
    for test_file in TEST_FILES:
        name = name_of(test_file)
        if test_file in listed or name in PACKAGE_NAMES or len(NAMED.get(name, ())) == 1:
            continue
        if name in NAMED:
            problems.append(
                f"{test_file}: {', '.join(NAMED[name])} share its name: name it after one of them "
                f"(test_SUB_{name}.py), or list it in MAP under the modules it tests"
            )
        else:
            problems.append(
                f"{test_file}: no module or package is named {name}: list it in MAP under the modules it "
                "tests, or in OTHER with its subject"
            )
    assert not problems, "\n".join(problems)


def test_each_file_other_lists_exists():
    assert [test_file for test_file in OTHER if not (ROOT / test_file).exists()] == []
